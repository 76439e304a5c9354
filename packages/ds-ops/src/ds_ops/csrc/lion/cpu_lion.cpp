// Lion step on a list of CPU tensors (DeepSpeedCPULion), in tiles, with an optional in-pass copy of the
// updated parameters into a bf16/fp16 tensor. See includes/ds_cpu_optim.h for tiles and rounding.
//
// Per element, in fp32 (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
//   p = p * decay                                  decay = 1 - lr * weight_decay
//   c = m * beta1 + g * (1 - beta1)
//   p = p + neg_lr * sign(c)
//   m = m * beta2 + g * (1 - beta2)
#include "ds_cpu_optim.h"

namespace {

struct LionHyper {
  float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr;
};

void lion_tile(int64_t numel, float* __restrict p, const float* __restrict g, float* __restrict m,
               const LionHyper& h) {
#pragma omp simd
  for (int64_t i = 0; i < numel; ++i) {
    const float grad = g[i];
    const float c = m[i] * h.beta1 + grad * h.one_minus_beta1;
    const float sign = static_cast<float>((c > 0.0f) - (c < 0.0f));
    p[i] = p[i] * h.decay + h.neg_lr * sign;
    m[i] = m[i] * h.beta2 + grad * h.one_minus_beta2;
  }
}

}  // namespace

DS_DEFINE_OP_INFO()

// Updates `num_tensors` tensors (entry k of each array is tensor k). Returns ds::kOk, or
// ds::kBadDType / ds::kBadSize without touching memory. `copies` may be null, and so may any entry.
DS_EXPORT int32_t ds_cpu_lion_step(int32_t num_tensors, const int64_t* numels, void* const* params,
                                   const int32_t* param_dtypes, void* const* grads, const int32_t* grad_dtypes,
                                   void* const* exp_avgs, const int32_t* state_dtypes, void* const* copies,
                                   const int32_t* copy_dtypes, float decay, float beta1, float one_minus_beta1,
                                   float beta2, float one_minus_beta2, float neg_lr, int32_t num_threads) {
  const int32_t status =
      ds::check_args(num_tensors, numels, param_dtypes, grad_dtypes, state_dtypes, copies, copy_dtypes);
  if (status != ds::kOk) return status;
  const LionHyper h{decay, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr};
  ds::for_each_tile(num_tensors, numels, num_threads, [&](int32_t k, int64_t offset, int64_t n) {
    alignas(64) float p_buf[ds::kTile], g_buf[ds::kTile], m_buf[ds::kTile];
    float* p = ds::load_tile(params[k], param_dtypes[k], offset, n, p_buf);
    const float* g = ds::load_tile(grads[k], grad_dtypes[k], offset, n, g_buf);  // read only
    float* m = ds::load_tile(exp_avgs[k], state_dtypes[k], offset, n, m_buf);
    lion_tile(n, p, g, m, h);
    ds::store_tile(params[k], param_dtypes[k], offset, n, p);
    ds::store_tile(exp_avgs[k], state_dtypes[k], offset, n, m);
    if (void* copy = ds::copy_target(copies, k)) ds::store_tile(copy, copy_dtypes[k], offset, n, p);
  });
  return ds::kOk;
}
