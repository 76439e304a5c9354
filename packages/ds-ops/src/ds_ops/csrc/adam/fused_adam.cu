// Multi-tensor Adam / AdamW on CUDA (FusedAdam): one launch updates every tensor of one dtype.
//
// The host passes a device array of tensor descriptors and the prefix sum of their chunk counts;
// block b updates chunk b, finding its tensor by binary search, so there is no per-tensor launch
// and no limit on the number of tensors per launch. Math is in fp32 for fp32/fp16/bf16 tensors, in
// the order of torch.optim.Adam (see adam/cpu_adam.cpp); states have the parameter's dtype, as in
// DeepSpeed's FusedAdam. No torch header is included: the library takes raw device pointers and
// the cudaStream_t to run on, and loads through ctypes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#define DS_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int32_t kAbiVersion = 2;  // must equal ds_ops.op_builder ABI_VERSION
constexpr int kThreads = 512;

enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// One tensor's device addresses and size, as the host packs them (five int64 each).
struct TensorMeta {
  int64_t param, grad, exp_avg, exp_avg_sq, numel;
};

struct AdamHyper {
  float decay, l2, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T, bool kL2>
__global__ void __launch_bounds__(kThreads) fused_adam_kernel(const TensorMeta* __restrict__ tensors,
                                                              const int64_t* __restrict__ chunk_offsets,
                                                              int32_t num_tensors, int64_t chunk_numel,
                                                              AdamHyper h) {
  const int64_t chunk = blockIdx.x;
  int32_t lo = 0;  // the last tensor whose first chunk is <= this chunk
  int32_t hi = num_tensors - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (chunk_offsets[mid] <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const TensorMeta t = tensors[lo];
  const int64_t start = (chunk - chunk_offsets[lo]) * chunk_numel;
  const int64_t end = min(start + chunk_numel, t.numel);
  T* __restrict__ p = reinterpret_cast<T*>(t.param);
  const T* __restrict__ g = reinterpret_cast<const T*>(t.grad);
  T* __restrict__ m = reinterpret_cast<T*>(t.exp_avg);
  T* __restrict__ v = reinterpret_cast<T*>(t.exp_avg_sq);
  for (int64_t i = start + threadIdx.x; i < end; i += kThreads) {
    float grad = to_float(g[i]);
    const float param_in = to_float(p[i]);
    if (kL2) grad = __fadd_rn(grad, __fmul_rn(h.l2, param_in));
    const float param = __fmul_rn(param_in, h.decay);
    const float m_in = to_float(m[i]);
    const float exp_avg = __fadd_rn(m_in, __fmul_rn(h.one_minus_beta1, __fsub_rn(grad, m_in)));
    const float exp_avg_sq =
        __fadd_rn(__fmul_rn(to_float(v[i]), h.beta2), __fmul_rn(__fmul_rn(h.one_minus_beta2, grad), grad));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(exp_avg_sq), h.bc2_sqrt), h.eps);
    p[i] = from_float<T>(__fadd_rn(param, __fmul_rn(h.neg_step_size, __fdiv_rn(exp_avg, denom))));
    m[i] = from_float<T>(exp_avg);
    v[i] = from_float<T>(exp_avg_sq);
  }
}

template <typename T>
void launch(const TensorMeta* tensors, const int64_t* offsets, int32_t num_tensors, int64_t num_chunks,
            int64_t chunk_numel, const AdamHyper& h, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned int>(num_chunks));
  if (h.l2 != 0.0f) {
    fused_adam_kernel<T, true><<<grid, kThreads, 0, stream>>>(tensors, offsets, num_tensors, chunk_numel, h);
  } else {
    fused_adam_kernel<T, false><<<grid, kThreads, 0, stream>>>(tensors, offsets, num_tensors, chunk_numel, h);
  }
}

}  // namespace

DS_EXPORT int32_t ds_op_abi_version() { return kAbiVersion; }
DS_EXPORT const char* ds_op_simd_level() { return "cuda"; }

// Returns 0, -1 for a bad dtype or size, else the cudaError_t of the launch.
// `meta` is a device int64 array: num_tensors TensorMeta (five int64 each), then num_tensors + 1
// chunk offsets (prefix sums of ceil(numel / chunk_numel); every numel > 0).
DS_EXPORT int32_t ds_fused_adam_step(const void* meta, int32_t num_tensors, int64_t num_chunks, int64_t chunk_numel,
                                     int32_t dtype, float decay, float l2, float one_minus_beta1, float beta2,
                                     float one_minus_beta2, float bc2_sqrt, float eps, float neg_step_size,
                                     void* stream) {
  if (num_tensors <= 0 || num_chunks <= 0) return num_tensors == 0 && num_chunks == 0 ? 0 : -1;
  if (chunk_numel <= 0 || num_chunks > 0x7fffffffLL) return -1;
  const auto* tensors = static_cast<const TensorMeta*>(meta);
  const auto* offsets = reinterpret_cast<const int64_t*>(tensors + num_tensors);
  const AdamHyper h{decay, l2, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size};
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kFloat32:
      launch<float>(tensors, offsets, num_tensors, num_chunks, chunk_numel, h, cuda_stream);
      break;
    case kBFloat16:
      launch<__nv_bfloat16>(tensors, offsets, num_tensors, num_chunks, chunk_numel, h, cuda_stream);
      break;
    case kFloat16:
      launch<__half>(tensors, offsets, num_tensors, num_chunks, chunk_numel, h, cuda_stream);
      break;
    default:
      return -1;
  }
  return static_cast<int32_t>(cudaGetLastError());
}
