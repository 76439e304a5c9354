// Adam / AdamW step on a list of CPU tensors (DeepSpeedCPUAdam), in tiles, with an optional in-pass copy of
// the updated parameters into a bf16/fp16 tensor. See includes/ds_cpu_optim.h for tiles and rounding.
//
// Per element, in fp32 (the order torch.optim.Adam uses, so results agree to rounding):
//   g = grad (+ l2 * p)                   Adam's L2 term (adamw_mode=False)
//   p = p * decay                         AdamW's decoupled decay, decay = 1 - lr * weight_decay
//   m = m + (1 - beta1) * (g - m)
//   v = v * beta2 + (1 - beta2) * g * g
//   p = p + neg_step_size * m / (sqrt(v) / bc2_sqrt + eps)    neg_step_size = -lr / (1 - beta1^t)
//
// ds_cpu_adam_rollback undoes one such step (DeepSpeedCPUAdam.rollback_subgroup) given the same gradient
// and hyper-parameters, by running those lines backwards:
//   p = p - neg_step_size * m / (sqrt(v) / bc2_sqrt + eps)   the same update term, from the step's m and v
//   p = p / decay
//   g = grad (+ l2 * p)                   with the restored p, as the step saw it
//   m = (m - (1 - beta1) * g) / beta1
//   v = max(0, (v - (1 - beta2) * g * g) / beta2)           rounding must not leave a negative variance
// Each line inverts one rounded fp32 operation, so the state comes back to within a few ulps (parameters
// stored in bf16/fp16 to within their own rounding, since the step rounded them once more).
#include <algorithm>
#include <cmath>

#include "ds_cpu_optim.h"

namespace {

struct AdamHyper {
  float decay, l2, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
};

template <bool kL2>
void adam_tile(int64_t numel, float* __restrict p, const float* __restrict g, float* __restrict m,
               float* __restrict v, const AdamHyper& h) {
#pragma omp simd
  for (int64_t i = 0; i < numel; ++i) {
    float grad = g[i];
    if (kL2) grad = grad + h.l2 * p[i];
    const float param = p[i] * h.decay;
    const float exp_avg = m[i] + h.one_minus_beta1 * (grad - m[i]);
    const float exp_avg_sq = v[i] * h.beta2 + h.one_minus_beta2 * grad * grad;
    const float denom = std::sqrt(exp_avg_sq) / h.bc2_sqrt + h.eps;
    p[i] = param + h.neg_step_size * (exp_avg / denom);
    m[i] = exp_avg;
    v[i] = exp_avg_sq;
  }
}

struct AdamInverse {
  AdamHyper step;
  float beta1;
};

template <bool kL2>
void adam_rollback_tile(int64_t numel, float* __restrict p, const float* __restrict g, float* __restrict m,
                        float* __restrict v, const AdamInverse& r) {
  const AdamHyper& h = r.step;
#pragma omp simd
  for (int64_t i = 0; i < numel; ++i) {
    const float denom = std::sqrt(v[i]) / h.bc2_sqrt + h.eps;
    const float param = (p[i] - h.neg_step_size * (m[i] / denom)) / h.decay;
    float grad = g[i];
    if (kL2) grad = grad + h.l2 * param;
    p[i] = param;
    m[i] = (m[i] - h.one_minus_beta1 * grad) / r.beta1;
    v[i] = std::max(0.0f, (v[i] - h.one_minus_beta2 * grad * grad) / h.beta2);
  }
}

// Loads each tile of tensor k's parameter, gradient and moments as fp32, runs `tile_fn(n, p, g, m, v)` on it
// and stores the results back (and into the optional copy): the loop the step and the rollback share.
template <typename TileFn>
int32_t for_each_adam_tile(int32_t num_tensors, const int64_t* numels, void* const* params,
                           const int32_t* param_dtypes, void* const* grads, const int32_t* grad_dtypes,
                           void* const* exp_avgs, void* const* exp_avg_sqs, const int32_t* state_dtypes,
                           void* const* copies, const int32_t* copy_dtypes, int32_t num_threads, TileFn tile_fn) {
  const int32_t status =
      ds::check_args(num_tensors, numels, param_dtypes, grad_dtypes, state_dtypes, copies, copy_dtypes);
  if (status != ds::kOk) return status;
  ds::for_each_tile(num_tensors, numels, num_threads, [&](int32_t k, int64_t offset, int64_t n) {
    alignas(64) float p_buf[ds::kTile], g_buf[ds::kTile], m_buf[ds::kTile], v_buf[ds::kTile];
    float* p = ds::load_tile(params[k], param_dtypes[k], offset, n, p_buf);
    const float* g = ds::load_tile(grads[k], grad_dtypes[k], offset, n, g_buf);  // read only
    float* m = ds::load_tile(exp_avgs[k], state_dtypes[k], offset, n, m_buf);
    float* v = ds::load_tile(exp_avg_sqs[k], state_dtypes[k], offset, n, v_buf);
    tile_fn(n, p, g, m, v);
    ds::store_tile(params[k], param_dtypes[k], offset, n, p);
    ds::store_tile(exp_avgs[k], state_dtypes[k], offset, n, m);
    ds::store_tile(exp_avg_sqs[k], state_dtypes[k], offset, n, v);
    if (void* copy = ds::copy_target(copies, k)) ds::store_tile(copy, copy_dtypes[k], offset, n, p);
  });
  return ds::kOk;
}

}  // namespace

DS_DEFINE_OP_INFO()

// Updates `num_tensors` tensors; entry k of each array describes tensor k. Returns ds::kOk, or
// ds::kBadDType / ds::kBadSize without touching memory. dtypes: 0 fp32, 1 bf16, 2 fp16; exp_avg and
// exp_avg_sq of a tensor share its state dtype. `copies` may be null, and so may any entry.
DS_EXPORT int32_t ds_cpu_adam_step(int32_t num_tensors, const int64_t* numels, void* const* params,
                                   const int32_t* param_dtypes, void* const* grads, const int32_t* grad_dtypes,
                                   void* const* exp_avgs, void* const* exp_avg_sqs, const int32_t* state_dtypes,
                                   void* const* copies, const int32_t* copy_dtypes, float decay, float l2,
                                   float one_minus_beta1, float beta2, float one_minus_beta2, float bc2_sqrt,
                                   float eps, float neg_step_size, int32_t num_threads) {
  const AdamHyper h{decay, l2, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size};
  return for_each_adam_tile(num_tensors, numels, params, param_dtypes, grads, grad_dtypes, exp_avgs, exp_avg_sqs,
                            state_dtypes, copies, copy_dtypes, num_threads,
                            [&](int64_t n, float* p, const float* g, float* m, float* v) {
                              if (l2 != 0.0f) {
                                adam_tile<true>(n, p, g, m, v, h);
                              } else {
                                adam_tile<false>(n, p, g, m, v, h);
                              }
                            });
}

// Undoes the step `ds_cpu_adam_step` made with the same arguments (the same gradients and scalars; `beta1`
// is added, and must be > 0, as must beta2 and decay: the caller checks). Same return codes.
DS_EXPORT int32_t ds_cpu_adam_rollback(int32_t num_tensors, const int64_t* numels, void* const* params,
                                       const int32_t* param_dtypes, void* const* grads, const int32_t* grad_dtypes,
                                       void* const* exp_avgs, void* const* exp_avg_sqs, const int32_t* state_dtypes,
                                       void* const* copies, const int32_t* copy_dtypes, float decay, float l2,
                                       float one_minus_beta1, float beta2, float one_minus_beta2, float bc2_sqrt,
                                       float eps, float neg_step_size, float beta1, int32_t num_threads) {
  const AdamInverse r{{decay, l2, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size}, beta1};
  return for_each_adam_tile(num_tensors, numels, params, param_dtypes, grads, grad_dtypes, exp_avgs, exp_avg_sqs,
                            state_dtypes, copies, copy_dtypes, num_threads,
                            [&](int64_t n, float* p, const float* g, float* m, float* v) {
                              if (l2 != 0.0f) {
                                adam_rollback_tile<true>(n, p, g, m, v, r);
                              } else {
                                adam_rollback_tile<false>(n, p, g, m, v, r);
                              }
                            });
}
