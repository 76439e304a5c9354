// Shared machinery of the CPU optimizer kernels: dtype conversion, tiles, the OpenMP loop.
//
// The kernels work on raw pointers and include no torch header, so an op compiles in a couple of
// seconds and loads through ctypes without a Python extension module.
//
// [Note: tiles] A parameter is processed in tiles of kTile elements. An fp32 array is updated in
// place through a pointer; a bf16/fp16 array is widened into a per-thread fp32 tile buffer (in L1/L2),
// updated there, and narrowed back. The optional copy of the updated parameter into a bf16/fp16
// tensor is written from the same tile while it is still in cache, so ZeRO-Offload needs no second
// pass over memory. Each tile is independent, so results do not depend on the thread count. A call
// takes a list of tensors (a param group) and spreads all their tiles over one OpenMP region.
//
// [Note: rounding] Sources are compiled with -ffp-contract=off: no fused multiply-add is formed, so
// an update is the same bit pattern whatever SIMD width the compiler picks (AVX-512, AVX2, NEON,
// scalar) and whatever the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#define DS_EXPORT extern "C" __attribute__((visibility("default")))

#ifndef DS_SIMD_LEVEL
#define DS_SIMD_LEVEL "unknown"
#endif

namespace ds {

// Must equal ds_ops.op_builder's ABI_VERSION: a prebuilt or cached library with another value is rebuilt.
constexpr int32_t kAbiVersion = 2;

enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

enum Status : int32_t { kOk = 0, kBadDType = 1, kBadSize = 2 };

// 4096 fp32 = 16 KiB per buffer; four buffers fit in L2 on any current core.
constexpr int64_t kTile = 4096;
// Below this many elements one thread does the work: waking a team costs more than it saves.
constexpr int64_t kMinParallelNumel = 65536;

inline bool valid_dtype(int32_t dtype) { return dtype == kFloat32 || dtype == kBFloat16 || dtype == kFloat16; }

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// Round to nearest even, NaN to the canonical quiet NaN: the same bits as torch's float->bfloat16 cast.
inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(__FLT16_MANT_DIG__) && !defined(DS_SOFT_HALF)
// The compiler has _Float16: conversions are IEEE round-to-nearest-even (F16C/NEON instructions when enabled).
inline float half_to_float(uint16_t bits) {
  _Float16 value;
  std::memcpy(&value, &bits, sizeof(value));
  return static_cast<float>(value);
}

inline uint16_t float_to_half(float value) {
  const _Float16 half = static_cast<_Float16>(value);
  uint16_t bits;
  std::memcpy(&bits, &half, sizeof(bits));
  return bits;
}
#else
// Portable bit manipulation for compilers without _Float16; same rounding (nearest even).
inline float half_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t out;
  if (exponent == 0x1fu) {
    out = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    out = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    out = sign;
  } else {  // subnormal half: normalise
    exponent = 113u;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    out = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float value;
  std::memcpy(&value, &out, sizeof(value));
  return value;
}

inline uint16_t float_to_half(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;             // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;            // overflows to inf after rounding
  if (magnitude < 0x38800000u) {                                  // subnormal or zero half
    if (magnitude < 0x33000000u) return sign;                     // below half the smallest subnormal
    const uint32_t drop = 126u - (magnitude >> 23);  // 14..24: the half is mantissa24 * 2^-drop
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    uint32_t half = mantissa >> drop;
    const uint32_t rest = mantissa & ((1u << drop) - 1u);
    const uint32_t halfway = 1u << (drop - 1u);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
  rounded -= 0x38000000u;  // rebias exponent 127 -> 15
  return sign | static_cast<uint16_t>(rounded >> 13);
}
#endif

// A float view of elements [offset, offset + numel) of `data`: the array itself when it is fp32
// (updated in place), else `buffer` filled by widening.
inline float* load_tile(void* data, int32_t dtype, int64_t offset, int64_t numel, float* buffer) {
  if (dtype == kFloat32) return static_cast<float*>(data) + offset;
  const uint16_t* src = static_cast<const uint16_t*>(data) + offset;
  if (dtype == kBFloat16) {
#pragma omp simd
    for (int64_t i = 0; i < numel; ++i) buffer[i] = bf16_to_float(src[i]);
  } else {
    int64_t i = 0;
#if defined(__F16C__)
    // GCC does not vectorize _Float16 conversions without AVX512-FP16; F16C does 8 at a time.
    for (; i + 8 <= numel; i += 8) {
      const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm256_storeu_ps(buffer + i, _mm256_cvtph_ps(half));
    }
#endif
    for (; i < numel; ++i) buffer[i] = half_to_float(src[i]);
  }
  return buffer;
}

// Write `values` to elements [offset, offset + numel) of `data` (a no-op for an fp32 array updated in place).
inline void store_tile(void* data, int32_t dtype, int64_t offset, int64_t numel, const float* values) {
  if (dtype == kFloat32) {
    float* dst = static_cast<float*>(data) + offset;
    if (dst != values) std::memcpy(dst, values, static_cast<size_t>(numel) * sizeof(float));
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(data) + offset;
  if (dtype == kBFloat16) {
#pragma omp simd
    for (int64_t i = 0; i < numel; ++i) dst[i] = float_to_bf16(values[i]);
  } else {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= numel; i += 8) {
      const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(values + i), _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), half);
    }
#endif
    for (; i < numel; ++i) dst[i] = float_to_half(values[i]);
  }
}

// Call fn(tensor, offset, numel) for every tile of every tensor, spread over up to `num_threads`
// OpenMP threads in one parallel region: one fork/join per call however many tensors there are
// (a region per tensor costs a barrier each, which hurts on a busy host). Threads take the tiles in
// interleaved chunks of 64 (1 MiB of each stream). Paired runs of benchmarks/cpu_adam.py (50M
// parameters, 2 threads, ds/torch fused Adam, median of per-round ratios, two runs each): chunks of
// 64 0.93/0.92 flat and 0.93/0.96 in 1M tensors; of 4 0.97/0.99 and 0.99/0.95; contiguous halves
// 0.94/0.97 and 0.98/0.94. Tiles are independent, so results are the same bits either way.
template <typename TileFn>
inline void for_each_tile(int32_t num_tensors, const int64_t* numels, int32_t num_threads, TileFn fn) {
  std::vector<int64_t> first_tile(static_cast<size_t>(num_tensors) + 1, 0);
  int64_t total_numel = 0;
  for (int32_t k = 0; k < num_tensors; ++k) {
    first_tile[k + 1] = first_tile[k] + (numels[k] + kTile - 1) / kTile;
    total_numel += numels[k];
  }
  const int64_t num_tiles = first_tile[num_tensors];
  auto run_tile = [&](int64_t tile) {
    // the last tensor whose first tile is <= tile (empty tensors own no tile and are skipped)
    const auto k = static_cast<int32_t>(std::upper_bound(first_tile.begin(), first_tile.end(), tile) -
                                        first_tile.begin() - 1);
    const int64_t offset = (tile - first_tile[k]) * kTile;
    fn(k, offset, std::min(kTile, numels[k] - offset));
  };
  if (num_threads <= 1 || total_numel < kMinParallelNumel) {
    for (int64_t tile = 0; tile < num_tiles; ++tile) run_tile(tile);
    return;
  }
#pragma omp parallel for num_threads(num_threads) schedule(static, 64)
  for (int64_t tile = 0; tile < num_tiles; ++tile) run_tile(tile);
}

// Arguments every optimizer kernel checks before touching memory. `copies` may be null (no copies),
// and so may any entry of it.
inline int32_t check_args(int32_t num_tensors, const int64_t* numels, const int32_t* param_dtypes,
                          const int32_t* grad_dtypes, const int32_t* state_dtypes, void* const* copies,
                          const int32_t* copy_dtypes) {
  if (num_tensors < 0) return kBadSize;
  for (int32_t k = 0; k < num_tensors; ++k) {
    if (numels[k] < 0) return kBadSize;
    if (!valid_dtype(param_dtypes[k]) || !valid_dtype(grad_dtypes[k]) || !valid_dtype(state_dtypes[k])) {
      return kBadDType;
    }
    if (copies != nullptr && copies[k] != nullptr && !valid_dtype(copy_dtypes[k])) return kBadDType;
  }
  return kOk;
}

// The copy target of tensor k, or null.
inline void* copy_target(void* const* copies, int32_t k) { return copies == nullptr ? nullptr : copies[k]; }

}  // namespace ds

// Every op library defines these once (DS_DEFINE_OP_INFO in its single translation unit); the loader
// checks the ABI version and ds_report shows the SIMD level the library was compiled for.
#define DS_DEFINE_OP_INFO()                                                   \
  DS_EXPORT int32_t ds_op_abi_version() { return ds::kAbiVersion; }           \
  DS_EXPORT const char* ds_op_simd_level() { return DS_SIMD_LEVEL; }
