// norm_rope: fused RMSNorm + NeoX rotary embedding of q and k, in place.
//
// One item is one (token, head) vector of HEAD_DIM values: the host driver loops over items, the CUDA
// driver gives each item a warp (kWarps items per CTA). Both use the helpers below for the math.
//
// Angles must agree bit for bit across backends (at positions near 2**20 one ulp of inv_freq moves the
// angle by ~0.06 rad): inv_freq(i) is theta ** (-2 i / ROPE_DIM) in double, rounded once to float, and
// the angle is one float multiply float(pos) * inv_freq(i). Never build this with fast math.
#pragma once

#include "common.cuh"

namespace jitwarm {
namespace norm_rope {

template <int ROPE_DIM>
JW_HD float inv_freq(int i, double theta) {
  return static_cast<float>(pow(theta, (-2.0 * i) / ROPE_DIM));
}

// 1 / sqrt(mean(x^2) + eps), IEEE division and square root (no approximate rsqrt).
JW_HD float rms_scale(float sum_sq, int head_dim, float eps) {
  return 1.f / sqrtf(sum_sq / static_cast<float>(head_dim) + eps);
}

// Output element e of a normed head vector: dims below ROPE_DIM rotate with their NeoX partner
// (i paired with i + ROPE_DIM/2), the rest pass through. c, s: cos and sin of pair (e mod ROPE_DIM/2).
template <int ROPE_DIM>
JW_HD float rope_elem(int e, const float* normed, float c, float s) {
  constexpr int half = ROPE_DIM / 2;
  if (e >= ROPE_DIM) return normed[e];
  if (e < half) return normed[e] * c - normed[e + half] * s;
  return normed[e] * c + normed[e - half] * s;
}

template <typename T>
struct Args {
  T* q;
  T* k;
  const int32_t* positions;
  const T* q_weight;
  const T* k_weight;
  float eps;
  double theta;
  int32_t num_tokens;
};

// Item (token t, head h): heads [0, HQ) are q's, [HQ, HQ + HK) are k's.
template <int HEAD_DIM, int HQ, int HK, typename T>
JW_HD T* item_ptr(const Args<T>& a, int64_t t, int h, const T** weight) {
  if (h < HQ) {
    *weight = a.q_weight;
    return a.q + (t * HQ + h) * HEAD_DIM;
  }
  *weight = a.k_weight;
  return a.k + (t * HK + (h - HQ)) * HEAD_DIM;
}

#ifdef __CUDACC__
constexpr int kWarps = 4;

template <int HEAD_DIM, int ROPE_DIM, int HQ, int HK, typename T>
__global__ void __launch_bounds__(kWarps * 32) norm_rope_kernel(Args<T> a) {
  constexpr int half = ROPE_DIM / 2;
  __shared__ float inv_s[half];
  __shared__ float buf[kWarps][HEAD_DIM];
  for (int i = threadIdx.x; i < half; i += blockDim.x) inv_s[i] = inv_freq<ROPE_DIM>(i, a.theta);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t item = int64_t(blockIdx.x) * kWarps + warp;
  if (item >= int64_t(a.num_tokens) * (HQ + HK)) return;  // whole warp: the shuffles below stay full
  const int64_t t = item / (HQ + HK);
  const T* w;
  T* x = item_ptr<HEAD_DIM, HQ, HK>(a, t, int(item % (HQ + HK)), &w);
  float* b = buf[warp];
  float sum_sq = 0.f;
  for (int e = lane; e < HEAD_DIM; e += 32) {
    const float v = load_f32(x, e);
    b[e] = v;
    sum_sq += v * v;
  }
  for (int off = 16; off > 0; off >>= 1) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, off);
  const float r = rms_scale(sum_sq, HEAD_DIM, a.eps);
  for (int e = lane; e < HEAD_DIM; e += 32) b[e] = b[e] * r * load_f32(w, e);
  __syncwarp();
  const float pos = static_cast<float>(a.positions[t]);
  for (int e = lane; e < HEAD_DIM; e += 32) {
    float c = 1.f, s = 0.f;
    if (e < ROPE_DIM) {
      const float angle = pos * inv_s[e < half ? e : e - half];
      c = cosf(angle);
      s = sinf(angle);
    }
    store_f32(x, e, rope_elem<ROPE_DIM>(e, b, c, s));
  }
}
#else
template <int HEAD_DIM, int ROPE_DIM, int HQ, int HK, typename T>
void run_host(const Args<T>& a) {
  constexpr int half = ROPE_DIM / 2;
  float inv[half], cs[half], sn[half], b[HEAD_DIM];
  for (int i = 0; i < half; ++i) inv[i] = inv_freq<ROPE_DIM>(i, a.theta);
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const float pos = static_cast<float>(a.positions[t]);
    for (int i = 0; i < half; ++i) {
      const float angle = pos * inv[i];
      cs[i] = cosf(angle);
      sn[i] = sinf(angle);
    }
    for (int h = 0; h < HQ + HK; ++h) {
      const T* w;
      T* x = item_ptr<HEAD_DIM, HQ, HK>(a, t, h, &w);
      float sum_sq = 0.f;
      for (int e = 0; e < HEAD_DIM; ++e) {
        b[e] = load_f32(x, e);
        sum_sq += b[e] * b[e];
      }
      const float r = rms_scale(sum_sq, HEAD_DIM, a.eps);
      for (int e = 0; e < HEAD_DIM; ++e) b[e] = b[e] * r * load_f32(w, e);
      for (int e = 0; e < HEAD_DIM; ++e) {
        const int i = e < half ? e : e - half;
        store_f32(x, e, e < ROPE_DIM ? rope_elem<ROPE_DIM>(e, b, cs[i], sn[i]) : b[e]);
      }
    }
  }
}
#endif

template <int HEAD_DIM, int ROPE_DIM, int HQ, int HK, typename T, bool UNIFORM, int MAX_LEN>
struct Kernel {
  static_assert(ROPE_DIM >= 2 && ROPE_DIM % 2 == 0 && ROPE_DIM <= HEAD_DIM,
                "rope_dim must be even, at least 2 and at most head_dim");
  static_assert(HQ >= 1 && HK >= 1 && MAX_LEN >= 1, "spec params must be positive");

  // run(q, k, positions, q_weight, k_weight, eps, theta)
  static void run(TensorView q, TensorView k, TensorView positions, TensorView q_weight, TensorView k_weight,
                  double eps, double theta) {
    const int32_t dev = q.device().device_id;
    Args<T> a;
    a.q = checked<T>(q, "q", 3, dev);
    a.k = checked<T>(k, "k", 3, dev);
    a.positions = checked<int32_t>(positions, "positions", 1, dev);
    a.q_weight = checked<T>(q_weight, "q_weight", 1, dev);
    a.k_weight = checked<T>(k_weight, "k_weight", 1, dev);
    const int64_t num_tokens = q.size(0);
    TVM_FFI_CHECK(num_tokens >= 1 && num_tokens < INT_MAX, ValueError) << "q: bad token count " << num_tokens;
    check_dim(q, "q", 1, HQ);
    check_dim(q, "q", 2, HEAD_DIM);
    check_dim(k, "k", 0, num_tokens);
    check_dim(k, "k", 1, HK);
    check_dim(k, "k", 2, HEAD_DIM);
    check_dim(positions, "positions", 0, num_tokens);
    check_dim(q_weight, "q_weight", 0, HEAD_DIM);
    check_dim(k_weight, "k_weight", 0, HEAD_DIM);
    if (UNIFORM) {
      TVM_FFI_CHECK(num_tokens % MAX_LEN == 0, ValueError)
          << "q: uniform spec with max_len " << MAX_LEN << " got " << num_tokens << " tokens";
    }
    a.eps = static_cast<float>(eps);
    a.theta = theta;
    a.num_tokens = static_cast<int32_t>(num_tokens);
#ifdef __CUDACC__
    tvm::ffi::CUDADeviceGuard guard(dev);
    const int64_t items = num_tokens * (HQ + HK);
    const unsigned blocks = static_cast<unsigned>((items + kWarps - 1) / kWarps);
    norm_rope_kernel<HEAD_DIM, ROPE_DIM, HQ, HK, T><<<blocks, kWarps * 32, 0, current_stream(dev)>>>(a);
    TVM_FFI_CHECK_CUDA_ERROR(cudaGetLastError());
#else
    run_host<HEAD_DIM, ROPE_DIM, HQ, HK>(a);
#endif
  }

  // Number of kernel instantiations forced onto the current device (0 on the host build).
  static int64_t preload() {
#ifdef __CUDACC__
    cudaFuncAttributes attr;
    TVM_FFI_CHECK_CUDA_ERROR(cudaFuncGetAttributes(&attr, norm_rope_kernel<HEAD_DIM, ROPE_DIM, HQ, HK, T>));
    return 1;
#else
    return 0;
#endif
  }
};

}  // namespace norm_rope
}  // namespace jitwarm
