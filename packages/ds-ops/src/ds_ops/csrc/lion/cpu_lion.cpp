// Lion step on one CPU tensor (DeepSpeedCPULion), in tiles, with an optional in-pass copy of the
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

// Returns ds::kOk, or ds::kBadDType / ds::kBadSize without touching memory. copy_out may be null.
DS_EXPORT int32_t ds_cpu_lion_step(int64_t numel, void* param, int32_t param_dtype, const void* grad,
                                   int32_t grad_dtype, void* exp_avg, int32_t state_dtype, void* copy_out,
                                   int32_t copy_dtype, float decay, float beta1, float one_minus_beta1, float beta2,
                                   float one_minus_beta2, float neg_lr, int32_t num_threads) {
  const int32_t status = ds::check_args(numel, param_dtype, grad_dtype, state_dtype, copy_out, copy_dtype);
  if (status != ds::kOk) return status;
  const LionHyper h{decay, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr};
  void* grad_data = const_cast<void*>(grad);
  ds::for_each_tile(numel, num_threads, [&](int64_t offset, int64_t n) {
    alignas(64) float p_buf[ds::kTile], g_buf[ds::kTile], m_buf[ds::kTile];
    float* p = ds::load_tile(param, param_dtype, offset, n, p_buf);
    const float* g = ds::load_tile(grad_data, grad_dtype, offset, n, g_buf);
    float* m = ds::load_tile(exp_avg, state_dtype, offset, n, m_buf);
    lion_tile(n, p, g, m, h);
    ds::store_tile(param, param_dtype, offset, n, p);
    ds::store_tile(exp_avg, state_dtype, offset, n, m);
    if (copy_out != nullptr) ds::store_tile(copy_out, copy_dtype, offset, n, p);
  });
  return ds::kOk;
}
