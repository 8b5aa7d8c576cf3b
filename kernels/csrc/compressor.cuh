// compressor: online softmax pooling over blocks of RATIO positions (the compressed-KV step).
//
// One (request, channel) pair is one independent sequential fold over the request's tokens, so the
// per-element helper `channel` is the whole kernel body: the host driver loops over (request,
// channel), the CUDA driver gives each pair a thread (grid: requests x channel blocks).
#pragma once

#include "common.cuh"

namespace jitwarm {
namespace compressor {

// Running max, running sum of weights, running weighted sum: one request and channel.
struct State {
  float m, s, a;
};

JW_HD State fresh() { return State{-INFINITY, 0.f, 0.f}; }

// Fold one token in with a numerically stable running max (weight = exp(score)).
JW_HD void fold(State& st, float x, float score) {
  const float m_new = st.m > score ? st.m : score;
  const bool live = m_new != -INFINITY;  // all scores so far -inf: nothing to weigh yet
  const float c = live ? expf(st.m - m_new) : 1.f;
  const float w = live ? expf(score - m_new) : 0.f;
  st.s = st.s * c + w;
  st.a = st.a * c + x * w;
  st.m = m_new;
}

template <typename T>
struct Args {
  const T* kv;
  const T* score;
  const int32_t* cu_lens;
  const int32_t* token_out_row;
  float* state;
  T* out;
  int32_t num_req;
  int32_t num_tokens;
  int32_t num_rows;
};

// Request q's first token and length. The uniform path places it at q * MAX_LEN and never reads
// cu_lens; the ragged path reads cu_lens and bounds the length by MAX_LEN (the unroll bound).
template <bool UNIFORM, int MAX_LEN, typename T>
JW_HD int32_t request_span(const Args<T>& a, int32_t q, int32_t* start) {
  if (UNIFORM) {
    *start = q * MAX_LEN;
    return MAX_LEN;
  }
  *start = a.cu_lens[q];
  const int32_t len = a.cu_lens[q + 1] - a.cu_lens[q];
  return len < 0 ? 0 : (len > MAX_LEN ? MAX_LEN : len);
}

// The kernel body for one (request, channel): load the state, fold the tokens in order, write and
// reset at every block the plan closes, store the state back.
template <int HEAD_DIM, bool UNIFORM, int MAX_LEN, typename T>
JW_HD void channel(const Args<T>& a, int32_t q, int32_t d) {
  int32_t start;
  const int32_t len = request_span<UNIFORM, MAX_LEN>(a, q, &start);
  float* st_ptr = a.state + int64_t(q) * 3 * HEAD_DIM + d;
  State st{st_ptr[0], st_ptr[HEAD_DIM], st_ptr[2 * HEAD_DIM]};
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int32_t j = 0; j < MAX_LEN; ++j) {
    const int32_t t = start + j;
    if (j >= len || t < 0 || t >= a.num_tokens) break;
    const int64_t i = int64_t(t) * HEAD_DIM + d;
    fold(st, load_f32(a.kv, i), load_f32(a.score, i));
    const int32_t row = a.token_out_row[t];
    if (row >= 0) {
      if (row < a.num_rows) store_f32(a.out, int64_t(row) * HEAD_DIM + d, st.a / st.s);
      st = fresh();
    }
  }
  st_ptr[0] = st.m;
  st_ptr[HEAD_DIM] = st.s;
  st_ptr[2 * HEAD_DIM] = st.a;
}

// Threads per CTA: one per channel, at most 256 (wider heads take several CTAs per request).
template <int HEAD_DIM>
constexpr int kBlockThreads = HEAD_DIM < 256 ? HEAD_DIM : 256;

#ifdef __CUDACC__
template <int HEAD_DIM, bool UNIFORM, int MAX_LEN, typename T>
__global__ void __launch_bounds__(kBlockThreads<HEAD_DIM>) compressor_kernel(Args<T> a) {
  const int32_t d = blockIdx.y * kBlockThreads<HEAD_DIM> + threadIdx.x;
  if (d < HEAD_DIM) channel<HEAD_DIM, UNIFORM, MAX_LEN>(a, blockIdx.x, d);
}
#endif

template <int RATIO, int HEAD_DIM, typename T, bool UNIFORM, int MAX_LEN>
struct Kernel {
  static_assert(RATIO >= 1 && HEAD_DIM >= 1 && MAX_LEN >= 1, "spec params must be positive");

  // run(kv, score, cu_lens, token_out_row, state, out)
  static void run(TensorView kv, TensorView score, TensorView cu_lens, TensorView token_out_row,
                  TensorView state, TensorView out) {
    const int32_t dev = kv.device().device_id;
    Args<T> a;
    a.kv = checked<T>(kv, "kv", 2, dev);
    a.score = checked<T>(score, "score", 2, dev);
    a.cu_lens = checked<int32_t>(cu_lens, "cu_lens", 1, dev);
    a.token_out_row = checked<int32_t>(token_out_row, "token_out_row", 1, dev);
    a.state = checked<float>(state, "state", 3, dev);
    a.out = checked<T>(out, "out", 2, dev);
    const int64_t num_tokens = kv.size(0), num_req = state.size(0), num_rows = out.size(0);
    TVM_FFI_CHECK(num_req >= 1 && num_tokens < INT_MAX && num_rows < INT_MAX, ValueError)
        << "state/kv/out: sizes out of range";
    check_dim(kv, "kv", 1, HEAD_DIM);
    check_dim(score, "score", 0, num_tokens);
    check_dim(score, "score", 1, HEAD_DIM);
    check_dim(cu_lens, "cu_lens", 0, num_req + 1);
    check_dim(token_out_row, "token_out_row", 0, num_tokens);
    check_dim(state, "state", 1, 3);
    check_dim(state, "state", 2, HEAD_DIM);
    check_dim(out, "out", 1, HEAD_DIM);
    if (UNIFORM) {
      TVM_FFI_CHECK(num_tokens == num_req * MAX_LEN, ValueError)
          << "kv: uniform spec with max_len " << MAX_LEN << " needs " << num_req * MAX_LEN << " tokens";
    }
    a.num_req = static_cast<int32_t>(num_req);
    a.num_tokens = static_cast<int32_t>(num_tokens);
    a.num_rows = static_cast<int32_t>(num_rows);
#ifdef __CUDACC__
    tvm::ffi::CUDADeviceGuard guard(dev);
    constexpr int threads = kBlockThreads<HEAD_DIM>;
    dim3 grid(a.num_req, (HEAD_DIM + threads - 1) / threads);
    compressor_kernel<HEAD_DIM, UNIFORM, MAX_LEN, T><<<grid, threads, 0, current_stream(dev)>>>(a);
    TVM_FFI_CHECK_CUDA_ERROR(cudaGetLastError());
#else
    for (int32_t q = 0; q < a.num_req; ++q) {
      for (int32_t d = 0; d < HEAD_DIM; ++d) channel<HEAD_DIM, UNIFORM, MAX_LEN>(a, q, d);
    }
#endif
  }

  // Number of kernel instantiations forced onto the current device (0 on the host build).
  static int64_t preload() {
#ifdef __CUDACC__
    cudaFuncAttributes attr;
    TVM_FFI_CHECK_CUDA_ERROR(cudaFuncGetAttributes(&attr, compressor_kernel<HEAD_DIM, UNIFORM, MAX_LEN, T>));
    return 1;
#else
    return 0;
#endif
  }
};

}  // namespace compressor
}  // namespace jitwarm
