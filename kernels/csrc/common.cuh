// jitwarm kernels: shared header for host (g++) and CUDA (nvcc) builds.
//
// Per-element helpers are JW_HD (__host__ __device__ under nvcc, inline otherwise), so the CPU-loop
// driver and the CUDA grid driver of a family run the same arithmetic. Storage types are float and
// jitwarm::bf16 (raw bits, round to nearest even), arithmetic is float32 everywhere.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_runtime.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/base.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#define JW_HD __host__ __device__ __forceinline__
#else
#define JW_HD inline
#endif

namespace jitwarm {

using tvm::ffi::TensorView;

#ifdef __CUDACC__
constexpr int32_t kDeviceType = kDLCUDA;
constexpr const char* kDeviceName = "cuda";
#else
constexpr int32_t kDeviceType = kDLCPU;
constexpr const char* kDeviceName = "cpu";
#endif

// bfloat16 as raw bits: conversions are bit operations, identical on host and device.
struct bf16 {
  uint16_t bits;
};

JW_HD float f32_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

JW_HD uint32_t bits_from_f32(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

JW_HD float load_f32(const float* p, int64_t i) { return p[i]; }
JW_HD float load_f32(const bf16* p, int64_t i) { return f32_from_bits(uint32_t(p[i].bits) << 16); }

JW_HD void store_f32(float* p, int64_t i, float v) { p[i] = v; }
JW_HD void store_f32(bf16* p, int64_t i, float v) {
  uint32_t u = bits_from_f32(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a (quiet) NaN, never round it to inf
    p[i].bits = uint16_t((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even (torch's rule)
  p[i].bits = uint16_t(u >> 16);
}

template <typename T>
struct DType;
template <>
struct DType<float> {
  static DLDataType dl() { return DLDataType{kDLFloat, 32, 1}; }
};
template <>
struct DType<bf16> {
  static DLDataType dl() { return DLDataType{kDLBfloat, 16, 1}; }
};
template <>
struct DType<int32_t> {
  static DLDataType dl() { return DLDataType{kDLInt, 32, 1}; }
};

// Contiguous as torch's is_contiguous() (and so ops.py) sees it: a tensor with no elements is contiguous
// whatever its strides. tvm-ffi's TensorView::IsContiguous says so only from 0.1.12 on; 0.1.11, the version
// sglang 0.5.23 and vLLM 0.33.0 pin, rejects e.g. out = torch.empty(8, 0).t() (strides (1, 1)), which
// ops.py has already accepted. For a non-empty tensor the two versions agree (size-1 dims: any stride).
inline bool is_contiguous(const TensorView& t) { return t.numel() == 0 || t.IsContiguous(); }

// Checks every tensor argument before a kernel runs (ops.py checks first; this is the C ABI's own
// guard, so a direct call with a bad tensor raises ValueError instead of reading out of bounds).
template <typename T>
T* checked(const TensorView& t, const char* name, int32_t ndim, int32_t device_id) {
  TVM_FFI_CHECK(t.ndim() == ndim, ValueError)
      << name << ": expected " << ndim << " dims, got " << t.ndim();
  TVM_FFI_CHECK(t.dtype() == DType<T>::dl(), ValueError)
      << name << ": expected dtype " << DType<T>::dl() << ", got " << t.dtype();
  TVM_FFI_CHECK(t.device().device_type == kDeviceType, ValueError)
      << name << ": this module is built for " << kDeviceName << " tensors";
  TVM_FFI_CHECK(t.device().device_id == device_id, ValueError)
      << name << ": on device " << t.device().device_id << ", other arguments on " << device_id;
  TVM_FFI_CHECK(is_contiguous(t), ValueError) << name << ": must be contiguous";
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

inline void check_dim(const TensorView& t, const char* name, int32_t dim, int64_t expected) {
  TVM_FFI_CHECK(t.size(dim) == expected, ValueError)
      << name << ": dim " << dim << " is " << t.size(dim) << ", expected " << expected;
}

#ifdef __CUDACC__
inline cudaStream_t current_stream(int32_t device_id) {
  // tvm-ffi sets the env stream from torch's current stream when torch tensors are passed.
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device_id));
}
#endif

}  // namespace jitwarm
