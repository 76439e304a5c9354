// Adagrad step on one CPU tensor (DeepSpeedCPUAdagrad), in tiles, with an optional in-pass copy of
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

// Returns ds::kOk, or ds::kBadDType / ds::kBadSize without touching memory. copy_out may be null.
DS_EXPORT int32_t ds_cpu_adagrad_step(int64_t numel, void* param, int32_t param_dtype, const void* grad,
                                      int32_t grad_dtype, void* exp_avg_sq, int32_t state_dtype, void* copy_out,
                                      int32_t copy_dtype, float l2, float eps, float neg_lr, int32_t num_threads) {
  const int32_t status = ds::check_args(numel, param_dtype, grad_dtype, state_dtype, copy_out, copy_dtype);
  if (status != ds::kOk) return status;
  void* grad_data = const_cast<void*>(grad);
  ds::for_each_tile(numel, num_threads, [&](int64_t offset, int64_t n) {
    alignas(64) float p_buf[ds::kTile], g_buf[ds::kTile], s_buf[ds::kTile];
    float* p = ds::load_tile(param, param_dtype, offset, n, p_buf);
    const float* g = ds::load_tile(grad_data, grad_dtype, offset, n, g_buf);
    float* s = ds::load_tile(exp_avg_sq, state_dtype, offset, n, s_buf);
    if (l2 != 0.0f) {
      adagrad_tile<true>(n, p, g, s, l2, eps, neg_lr);
    } else {
      adagrad_tile<false>(n, p, g, s, l2, eps, neg_lr);
    }
    ds::store_tile(param, param_dtype, offset, n, p);
    ds::store_tile(exp_avg_sq, state_dtype, offset, n, s);
    if (copy_out != nullptr) ds::store_tile(copy_out, copy_dtype, offset, n, p);
  });
  return ds::kOk;
}
