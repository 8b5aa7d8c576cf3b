// plan: ragged verify layout and compression plan, one CTA of THREADS threads.
//
// The kernel is written as phases separated by block barriers. Each phase is a JW_HD function of
// (tid, shared, per-thread registers); the CUDA driver runs them with __syncthreads() between phases,
// the host driver runs each phase for every tid before the next one, so both execute the same
// barrier-separated program. Requests are split in contiguous chunks of ceil(R / THREADS), so R may
// exceed THREADS.
//
// Barrier contract (docs/kernels.md, "plan": the incident's second cause was a missing barrier here): the min/max
// tree reduction and the scan write shared arrays that other threads read in the next round, so every
// round ends with a barrier, and the uniform/ragged branch reads lo[0]/hi[0] only after the barrier
// that ends the last round.
#pragma once

#include "common.cuh"

namespace jitwarm {
namespace plan {

struct Args {
  const int32_t* lens;
  const int32_t* prefix;
  int32_t* cu_lens;
  int32_t* token_req;
  int32_t* token_pos;
  int32_t* token_out_row;
  int32_t* num_out;
  int32_t* uniform;
  int32_t num_req;
  int32_t num_tokens;
};

template <int THREADS>
struct Shared {
  int32_t sum[THREADS];   // tokens per chunk, then their inclusive scan
  int32_t rows[THREADS];  // closed blocks per chunk, then their inclusive scan
  int32_t lo[THREADS];    // min length, tree-reduced into lo[0]
  int32_t hi[THREADS];    // max length, tree-reduced into hi[0]
};

struct Regs {
  int32_t begin, end;    // this thread's requests
  int32_t sum, rows;     // this thread's tokens and closed blocks
  int32_t t_sum, t_rows; // scan operand read before the barrier, added after it
};

JW_HD int32_t imin(int32_t a, int32_t b) { return a < b ? a : b; }
JW_HD int32_t imax(int32_t a, int32_t b) { return a > b ? a : b; }
JW_HD int32_t clamp_len(int32_t len) { return len < 0 ? 0 : len; }

// Blocks of RATIO positions closed by positions prefix .. prefix + len - 1 (prefix >= 0).
template <int RATIO>
JW_HD int32_t closed_blocks(int32_t prefix, int32_t len) {
  return (prefix + len) / RATIO - prefix / RATIO;
}

template <int RATIO, int THREADS>
JW_HD void load(int tid, const Args& a, Shared<THREADS>& s, Regs& r) {
  const int32_t chunk = (a.num_req + THREADS - 1) / THREADS;
  r.begin = imin(a.num_req, tid * chunk);
  r.end = imin(a.num_req, r.begin + chunk);
  int32_t sum = 0, rows = 0, lo = INT_MAX, hi = INT_MIN;
  for (int32_t q = r.begin; q < r.end; ++q) {
    const int32_t len = clamp_len(a.lens[q]);
    sum += len;
    rows += closed_blocks<RATIO>(a.prefix[q], len);
    lo = imin(lo, len);
    hi = imax(hi, len);
  }
  r.sum = sum;
  r.rows = rows;
  s.sum[tid] = sum;
  s.rows[tid] = rows;
  s.lo[tid] = lo;
  s.hi[tid] = hi;
}

// One round of the min/max tree: thread tid < stride folds in tid + stride, which no active thread
// writes in the same round; the round's barrier publishes the result to the next round.
template <int THREADS>
JW_HD void minmax_round(int tid, int stride, Shared<THREADS>& s) {
  if (tid < stride) {
    s.lo[tid] = imin(s.lo[tid], s.lo[tid + stride]);
    s.hi[tid] = imax(s.hi[tid], s.hi[tid + stride]);
  }
}

// Hillis-Steele inclusive scan, split in a read and a write phase with a barrier between them: a
// thread must not add into sum[tid] while tid + off still has to read the old value.
template <int THREADS>
JW_HD void scan_read(int tid, int off, const Shared<THREADS>& s, Regs& r) {
  r.t_sum = tid >= off ? s.sum[tid - off] : 0;
  r.t_rows = tid >= off ? s.rows[tid - off] : 0;
}

template <int THREADS>
JW_HD void scan_write(int tid, Shared<THREADS>& s, const Regs& r) {
  s.sum[tid] += r.t_sum;
  s.rows[tid] += r.t_rows;
}

template <int RATIO>
JW_HD void emit_request(const Args& a, int32_t q, int32_t start, int32_t row_base, int32_t len) {
  const int32_t prefix = a.prefix[q];
  a.cu_lens[q] = start;
  for (int32_t j = 0; j < len; ++j) {
    const int32_t t = start + j;
    if (t >= a.num_tokens) break;  // lens disagree with the outputs' size: never write past them
    const int32_t pos = prefix + j;
    a.token_req[t] = q;
    a.token_pos[t] = pos;
    a.token_out_row[t] = (pos + 1) % RATIO == 0 ? row_base + (pos + 1) / RATIO - prefix / RATIO - 1 : -1;
  }
}

// Runs after the last scan barrier. The uniform/ragged branch is taken here, from the reduced
// lo[0] == hi[0]: the uniform path places request q at q * len without the token scan.
template <int RATIO, int THREADS>
JW_HD void emit(int tid, const Args& a, const Shared<THREADS>& s, const Regs& r) {
  const int32_t lo = s.lo[0];
  const bool uniform = lo == s.hi[0];
  int32_t start = s.sum[tid] - r.sum;
  int32_t row = s.rows[tid] - r.rows;
  for (int32_t q = r.begin; q < r.end; ++q) {
    const int32_t len = uniform ? lo : clamp_len(a.lens[q]);
    emit_request<RATIO>(a, q, uniform ? q * lo : start, row, len);
    start += len;
    row += closed_blocks<RATIO>(a.prefix[q], len);
  }
  if (tid == 0) {
    a.cu_lens[a.num_req] = uniform ? a.num_req * lo : s.sum[THREADS - 1];
    a.num_out[0] = s.rows[THREADS - 1];
    a.uniform[0] = uniform ? 1 : 0;
  }
}

#ifdef __CUDACC__
template <int RATIO, int THREADS>
__global__ void __launch_bounds__(THREADS) plan_kernel(Args a) {
  __shared__ Shared<THREADS> s;
  Regs r;
  const int tid = threadIdx.x;
  load<RATIO, THREADS>(tid, a, s, r);
  __syncthreads();
  for (int stride = THREADS / 2; stride > 0; stride >>= 1) {
    minmax_round<THREADS>(tid, stride, s);
    __syncthreads();
  }
  for (int off = 1; off < THREADS; off <<= 1) {
    scan_read<THREADS>(tid, off, s, r);
    __syncthreads();
    scan_write<THREADS>(tid, s, r);
    __syncthreads();
  }
  emit<RATIO, THREADS>(tid, a, s, r);
}
#else
template <int RATIO, int THREADS>
void run_host(const Args& a) {
  Shared<THREADS> s;  // at most 40 KiB of stack together with r, and reentrant
  Regs r[THREADS];
  for (int tid = 0; tid < THREADS; ++tid) load<RATIO, THREADS>(tid, a, s, r[tid]);
  for (int stride = THREADS / 2; stride > 0; stride >>= 1) {
    for (int tid = 0; tid < THREADS; ++tid) minmax_round<THREADS>(tid, stride, s);
  }
  for (int off = 1; off < THREADS; off <<= 1) {
    for (int tid = 0; tid < THREADS; ++tid) scan_read<THREADS>(tid, off, s, r[tid]);
    for (int tid = 0; tid < THREADS; ++tid) scan_write<THREADS>(tid, s, r[tid]);
  }
  for (int tid = 0; tid < THREADS; ++tid) emit<RATIO, THREADS>(tid, a, s, r[tid]);
}
#endif

template <int RATIO, int THREADS>
struct Kernel {
  static_assert(RATIO >= 1, "ratio must be positive");
  static_assert(THREADS >= 32 && THREADS <= 1024 && (THREADS & (THREADS - 1)) == 0,
                "threads must be a power of two in [32, 1024]");

  // run(verify_lens, prefix_lens, cu_lens, token_req, token_pos, token_out_row, num_out, uniform)
  static void run(TensorView verify_lens, TensorView prefix_lens, TensorView cu_lens, TensorView token_req,
                  TensorView token_pos, TensorView token_out_row, TensorView num_out, TensorView uniform) {
    const int32_t dev = verify_lens.device().device_id;
    Args a;
    a.lens = checked<int32_t>(verify_lens, "verify_lens", 1, dev);
    a.prefix = checked<int32_t>(prefix_lens, "prefix_lens", 1, dev);
    a.cu_lens = checked<int32_t>(cu_lens, "cu_lens", 1, dev);
    a.token_req = checked<int32_t>(token_req, "token_req", 1, dev);
    a.token_pos = checked<int32_t>(token_pos, "token_pos", 1, dev);
    a.token_out_row = checked<int32_t>(token_out_row, "token_out_row", 1, dev);
    a.num_out = checked<int32_t>(num_out, "num_out", 1, dev);
    a.uniform = checked<int32_t>(uniform, "uniform", 1, dev);
    const int64_t num_req = verify_lens.size(0);
    const int64_t num_tokens = token_req.size(0);
    TVM_FFI_CHECK(num_req >= 1 && num_req < INT_MAX, ValueError) << "verify_lens: bad length " << num_req;
    TVM_FFI_CHECK(num_tokens < INT_MAX, ValueError) << "token_req: too many tokens " << num_tokens;
    check_dim(prefix_lens, "prefix_lens", 0, num_req);
    check_dim(cu_lens, "cu_lens", 0, num_req + 1);
    check_dim(token_pos, "token_pos", 0, num_tokens);
    check_dim(token_out_row, "token_out_row", 0, num_tokens);
    check_dim(num_out, "num_out", 0, 1);
    check_dim(uniform, "uniform", 0, 1);
    a.num_req = static_cast<int32_t>(num_req);
    a.num_tokens = static_cast<int32_t>(num_tokens);
#ifdef __CUDACC__
    tvm::ffi::CUDADeviceGuard guard(dev);
    plan_kernel<RATIO, THREADS><<<1, THREADS, 0, current_stream(dev)>>>(a);
    TVM_FFI_CHECK_CUDA_ERROR(cudaGetLastError());
#else
    run_host<RATIO, THREADS>(a);
#endif
  }

  // Number of kernel instantiations forced onto the current device (0 on the host build).
  static int64_t preload() {
#ifdef __CUDACC__
    cudaFuncAttributes attr;
    TVM_FFI_CHECK_CUDA_ERROR(cudaFuncGetAttributes(&attr, plan_kernel<RATIO, THREADS>));
    return 1;
#else
    return 0;
#endif
  }
};

}  // namespace plan
}  // namespace jitwarm
