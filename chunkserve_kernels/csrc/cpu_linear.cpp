// A float32 CPU product for decode-sized steps: y = x W^T (+ b) for a few rows of x, each
// weight row read from memory once and streamed straight through.
//
// Why: a batch-1 decode step of a float32 model is a stream of weight reads (the default model:
// 538 MB a step), and the step can be no faster than memory delivers them. MKL's sgemm and
// oneDNN's packed product, given one or two rows, read the default model's 121 linears at
// ~35 GB/s on a 2-core Zen 5 EPYC, where a plain sum over a 1 GiB tensor reads ~47; this loop
// (each thread a contiguous run of weight rows, each row one dot product per input row with
// 32 float lanes the compiler turns into vector FMAs) read them at ~44 (one row: 17.3 ms padded
// MKL, 15.0 oneDNN packed, 12.3 this; benchmarks/RESULTS.md, "A few-row float32 product and a
// fused decode layer"). Walking one weight row at a time beat walking 2, 4 or 8 at once: one
// sequential stream per core is what the hardware prefetcher follows best. With several rows
// of x (a speculative verify step's 1 + k) the loop does more arithmetic per weight line and
// the hardware prefetcher falls behind; asking for the line 4 weight rows ahead kept it fed
// (a 2-core Zen 5 EPYC with AVX-512, one thread, a 28 MB weight, 3 runs: 1 row 0.76-1.00 ms
// vs 0.97-1.27 without, 4 rows 1.6-2.0 vs 1.7-2.4, 8 rows 2.9-3.1 vs 3.9-4.9). On a 2-core
// AVX2 EPYC (the 8-float build) the prefetch helps from 2 rows as well (the default model's
// linears, two threads: 2 rows 9-12% shorter, 4 rows 10-11%, 8 rows 4%) but costs 4-7% at one
// row, where it only repeats what the hardware prefetcher asks for (benchmarks/RESULTS.md,
// "Batch 1: the one-row product without software prefetch"), and on a 2-core Zen 4 EPYC with
// AVX-512 it cost 1-4% at one row while the memory read ~35 GB/s and 5-14% while it read
// ~60 (the default model's linears, two threads; benchmarks/RESULTS.md, "The one-row product:
// software prefetch chosen at start-up"). So whether one row asks for lines ahead is the linear
// plan's choice, measured at start-up like the rest of it: kernel "gemv-stream" streams one
// row without the prefetch, "gemv" with it (`stream_one_row`; the same arithmetic, so the
// same bits). From ~4 rows of x on, oneDNN's blocked
// product is still faster (it reuses each weight line across more rows); which kernel serves
// which step size is measured at start-up (executor_svc/models/linear_plan.py, kernel "gemv").
//
// Numerics: float32 products and sums (fused multiply-adds), in another order than MKL's: the
// last bits differ, as they do between MKL's own blockings. A row's result does not depend on
// the other rows of x or on the thread count (each output element is one thread's one dot).

#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <vector>

namespace chunkserve {
namespace {

constexpr int64_t kLanes = 32;     // partial sums per dot product: 2 AVX-512 / 4 AVX2 registers
constexpr int64_t kMaxGroup = 8;   // rows of x per pass over the weights
constexpr int64_t kGrainRows = 64; // weight rows per thread at the least
constexpr int64_t kTaskRows = 256;    // weight rows per task at the most
constexpr int64_t kMinTaskRows = 16;  // and at the least (the last rows excepted)
constexpr int64_t kAhead = 4;      // weight rows ahead that each pass asks the cache for

// One register of floats: 16 with AVX-512, 8 otherwise (GCC's vector extension: no intrinsics,
// so the file builds for any -march; loads through memcpy are unaligned vector loads). The width
// follows the target because GCC lowers a vector wider than the machine's registers through the
// stack: with 16-float vectors on a 2-core AVX2 EPYC every partial sum went to memory and back
// each iteration, and the default model's linears took 42-46 ms at one row where a plain sum
// over their weights takes 20-24 (34 with 8-float vectors; 8 rows: 284-302 against 84-88;
// benchmarks/RESULTS.md, "The native kernels on AVX2"). Either width keeps the same 32 lanes
// and the same sum over them, so a result does not depend on it.
#if defined(__AVX512F__)
constexpr int64_t kVec = 16;
#else
constexpr int64_t kVec = 8;
#endif
typedef float Vec __attribute__((vector_size(kVec * sizeof(float))));
constexpr int kParts = kLanes / kVec;  // vectors of partial sums per row of x
static_assert(kLanes % kVec == 0, "whole vectors of partial sums");

// The kernel below is compiled without -fassociative-math (why: above `rows`); `load` is inside
// the same region, as GCC does not inline a function built with other optimisation options.
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// y[m, n0:n1] for the M rows of x starting at x (row stride K): one pass over W's rows n0..n1.
// Written with explicit vectors: GCC kept the partial sums of 1 or 2 rows of x in registers
// from plain loops but not of 3 or 4 (3.4 GB/s, a tenth of the 2-row speed). Lane j of a row's
// sums accumulates w[k + j] * x[k + j] over k in order, then the 32 lanes are added in a fixed
// tree (j and j + 16, then + 8, ...). Compiled without -fassociative-math: with it GCC may split
// a sum into more partial sums for one group size and not another (with 8-float vectors it did),
// and a row's result would depend on the rows beside it (see the pragma above `load`).
// `Prefetch`: ask for the line kAhead weight rows ahead (the top of the file says when it pays).
template <int M, bool Prefetch>
void rows(const float* __restrict x, int64_t K, const float* __restrict w, const float* bias, float* __restrict y,
          int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* __restrict wr = w + n * K;
    Vec acc[M][kParts];
    for (int m = 0; m < M; ++m)
      for (int p = 0; p < kParts; ++p) acc[m][p] = Vec{};
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      if constexpr (Prefetch) {
        __builtin_prefetch(wr + kAhead * K + k);
        __builtin_prefetch(wr + kAhead * K + k + 16);  // the 32 lanes' second cache line
      }
      Vec wv[kParts];
      for (int p = 0; p < kParts; ++p) wv[p] = load(wr + k + p * kVec);
      for (int m = 0; m < M; ++m)
        for (int p = 0; p < kParts; ++p) acc[m][p] += wv[p] * load(x + m * K + k + p * kVec);
    }
    for (int m = 0; m < M; ++m) {
      float lanes[kLanes];
      std::memcpy(lanes, acc[m], sizeof(lanes));
      for (int64_t h = kLanes / 2; h > 0; h /= 2)
        for (int64_t j = 0; j < h; ++j) lanes[j] += lanes[j + h];
      float s = lanes[0];
      for (int64_t kk = k; kk < K; ++kk) s += wr[kk] * x[m * K + kk];
      y[m * ldy + n] = bias == nullptr ? s : s + bias[n];
    }
  }
}
#pragma GCC pop_options

// A group of M rows of x: with several, the weight lines ahead are always asked for; with one,
// unless `stream_one_row`.
void group(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* y, int64_t N, int64_t n0,
           int64_t n1, bool stream_one_row) {
  switch (M) {
    case 1:
      if (stream_one_row) {
        rows<1, false>(x, K, w, bias, y, N, n0, n1);
      } else {
        rows<1, true>(x, K, w, bias, y, N, n0, n1);
      }
      break;
    case 2: rows<2, true>(x, K, w, bias, y, N, n0, n1); break;
    case 3: rows<3, true>(x, K, w, bias, y, N, n0, n1); break;
    case 4: rows<4, true>(x, K, w, bias, y, N, n0, n1); break;
    case 5: rows<5, true>(x, K, w, bias, y, N, n0, n1); break;
    case 6: rows<6, true>(x, K, w, bias, y, N, n0, n1); break;
    case 7: rows<7, true>(x, K, w, bias, y, N, n0, n1); break;
    default: rows<8, true>(x, K, w, bias, y, N, n0, n1); break;
  }
}

// One thread's contiguous run of weight rows [front, back), both in one atomic word so that its
// owner (taking tasks from the front) and a thread that has finished its own run (taking them
// from the back) never both take a row.
//
// Why runs and not one shared counter: with tasks handed out in turn from one counter (as
// before), each core read a task, then jumped past the other core's next one: every task began a
// new stream for the hardware prefetcher. A core reading its own run front to back is one
// stream from the product's start to its end. While memory read ~60 GB/s on a 2-core Zen 4 EPYC,
// one product over the default model's 425 MB of decoder weights read at 56-66 GB/s this way
// against 48-56 with the shared counter, and its 121 products one after another at 45-56 GB/s
// against 40-47 (two runs; benchmarks/RESULTS.md, "One run of weight rows per thread"). Taking from the
// back of another's run keeps what the shared counter was for: when the OS takes a core from one
// thread mid-product (a busy neighbour, the scheduler process), the other does the rest of that
// thread's rows instead of waiting for them. Tasks are half the rows left in the run, between
// kMinTaskRows and kTaskRows, so a preempted thread holds at most kTaskRows rows and the threads
// finish within a small task of each other.
struct alignas(64) Run {  // a cache line each: the owners' claims do not contend
  std::atomic<uint64_t> span{0};

  void set(int64_t front, int64_t back) { span.store(pack(front, back), std::memory_order_relaxed); }

  // Takes a task from the front (the owner) or the back: [n0, n1); false when the run is empty.
  bool claim(bool front, int64_t& n0, int64_t& n1) {
    uint64_t s = span.load(std::memory_order_relaxed);
    while (true) {
      const int64_t f = static_cast<int64_t>(s >> 32), b = static_cast<int64_t>(s & 0xffffffffu);
      if (f >= b) return false;
      const int64_t size = std::min(b - f, std::clamp((b - f) / 2, kMinTaskRows, kTaskRows));
      n0 = front ? f : b - size;
      n1 = n0 + size;
      // on failure s is the word another thread left: try again from it
      if (span.compare_exchange_weak(s, front ? pack(n1, b) : pack(f, n0), std::memory_order_relaxed)) return true;
    }
  }

  static uint64_t pack(int64_t front, int64_t back) {
    return (static_cast<uint64_t>(front) << 32) | static_cast<uint64_t>(back);
  }
};

}  // namespace

at::Tensor gemv(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                bool stream_one_row) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "x must be a float32 CPU [M, K] tensor");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous(),
              "weight must be a contiguous float32 CPU [N, K] tensor");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "x has ", K, " columns, weight ", weight.size(1));
  TORCH_CHECK(N < (int64_t{1} << 31), "weight has ", N, " rows; at most 2^31 - 1");  // Run packs two row numbers
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                "bias must be a contiguous float32 [N] tensor");
    b = bias->data_ptr<float>();
  }
  const at::Tensor x = x_in.contiguous();  // a transposed view of one row copies K floats
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Work sharing (`claim` above): each thread one contiguous run of weight rows, read front to
  // back in tasks; a thread whose run is done takes tasks from the back of another's.
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (N + kGrainRows - 1) / kGrainRows);
  std::vector<Run> runs(threads);
  for (int64_t t = 0; t < threads; ++t) runs[t].set(N * t / threads, N * (t + 1) / threads);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      for (int64_t r = 0; r < threads; ++r) {
        int64_t n0, n1;
        while (runs[(t + r) % threads].claim(r == 0, n0, n1)) {
          for (int64_t m = 0; m < M; m += kMaxGroup)
            group(xp + m * K, std::min(kMaxGroup, M - m), K, wp, b, yp + m * N, N, n0, n1, stream_one_row);
        }
      }
    }
  });
  return y;
}

}  // namespace chunkserve

TORCH_LIBRARY_FRAGMENT(chunkserve, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias=None, bool stream_one_row=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(chunkserve, CPU, m) { m.impl("gemv", &chunkserve::gemv); }
