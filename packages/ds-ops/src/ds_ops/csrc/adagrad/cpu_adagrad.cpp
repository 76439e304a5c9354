// Adagrad step on a list of CPU tensors (DeepSpeedCPUAdagrad), in tiles, with an optional in-pass copy of
// the updated parameters into a bf16/fp16 tensor. See includes/ds_cpu_optim.h for tiles and rounding.
//
// Per element, in fp32 (the order torch.optim.Adagrad uses with lr_decay=0):
//   g = grad (+ l2 * p)
//   s = s + g * g
//   p = p + neg_lr * g / (sqrt(s) + eps)
#include <cmath>

#include "ds_cpu_optim.h"

namespace {

template <bool kL2>
void adagrad_tile(int64_t numel, float* __restrict p, const float* __restrict g, float* __restrict s, float l2,
                  float eps, float neg_lr) {
#pragma omp simd
  for (int64_t i = 0; i < numel; ++i) {
    float grad = g[i];
    if (kL2) grad = grad + l2 * p[i];
    const float sum = s[i] + grad * grad;
    const float std_dev = std::sqrt(sum) + eps;
    p[i] = p[i] + neg_lr * (grad / std_dev);
    s[i] = sum;
  }
}

}  // namespace

DS_DEFINE_OP_INFO()

// Updates `num_tensors` tensors (entry k of each array is tensor k). Returns ds::kOk, or
// ds::kBadDType / ds::kBadSize without touching memory. `copies` may be null, and so may any entry.
DS_EXPORT int32_t ds_cpu_adagrad_step(int32_t num_tensors, const int64_t* numels, void* const* params,
                                      const int32_t* param_dtypes, void* const* grads, const int32_t* grad_dtypes,
                                      void* const* exp_avg_sqs, const int32_t* state_dtypes, void* const* copies,
                                      const int32_t* copy_dtypes, float l2, float eps, float neg_lr,
                                      int32_t num_threads) {
  const int32_t status =
      ds::check_args(num_tensors, numels, param_dtypes, grad_dtypes, state_dtypes, copies, copy_dtypes);
  if (status != ds::kOk) return status;
  ds::for_each_tile(num_tensors, numels, num_threads, [&](int32_t k, int64_t offset, int64_t n) {
    alignas(64) float p_buf[ds::kTile], g_buf[ds::kTile], s_buf[ds::kTile];
    float* p = ds::load_tile(params[k], param_dtypes[k], offset, n, p_buf);
    const float* g = ds::load_tile(grads[k], grad_dtypes[k], offset, n, g_buf);  // read only
    float* s = ds::load_tile(exp_avg_sqs[k], state_dtypes[k], offset, n, s_buf);
    if (l2 != 0.0f) {
      adagrad_tile<true>(n, p, g, s, l2, eps, neg_lr);
    } else {
      adagrad_tile<false>(n, p, g, s, l2, eps, neg_lr);
    }
    ds::store_tile(params[k], param_dtypes[k], offset, n, p);
    ds::store_tile(exp_avg_sqs[k], state_dtypes[k], offset, n, s);
    if (void* copy = ds::copy_target(copies, k)) ds::store_tile(copy, copy_dtypes[k], offset, n, p);
  });
  return ds::kOk;
}
