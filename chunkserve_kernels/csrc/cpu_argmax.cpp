// The greedy token of each row of float32 logits: what `logits.argmax(dim=-1)` returns (the first
// index of the largest value; a row with a NaN, its first NaN), in two vector passes.
//
// Why: aten's argmax walks the 49K-token vocabulary of the default model at ~1 ns an element
// (43 us warm on a 2-core Zen 4 EPYC, ~80-100 us inside a batch-1 step, whose weight reads have
// just pushed everything out of the caches), where the whole step's sampling is otherwise a few
// microseconds; here one pass finds the largest value (and whether there is a NaN) 16 lanes at
// a time and a second finds its first index (benchmarks/RESULTS.md, "The small ops between the
// products"). Comparisons only, so the result is exact: the same index as aten's, never a
// rounding away.

#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)  // x86 only: other targets build the scalar paths
#include <immintrin.h>
#endif

#include <cmath>
#include <limits>

namespace chunkserve {
namespace {

#pragma GCC push_options
#pragma GCC optimize("no-finite-math-only", "signed-zeros")

// Lanes of one register, and the bit mask of a register's lanes that are NaN or equal `want`.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
inline unsigned hits(const float* x, bool nan, __m512 want) {
  const __m512 v = _mm512_loadu_ps(x);
  return nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, want, _CMP_EQ_OQ);
}
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
inline unsigned hits(const float* x, bool nan, __m256 want) {
  const __m256 v = _mm256_loadu_ps(x);
  return _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, want, _CMP_EQ_OQ));
}
#else
constexpr int64_t kLanes = 1;
#endif

int64_t row_argmax(const float* x, int64_t n) {
  const int64_t whole = kLanes > 1 ? n / kLanes * kLanes : 0;
  bool nan = false;
  float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(best);
  __mmask16 bad = 0;
  for (int64_t i = 0; i < whole; i += kLanes) {
    const __m512 v = _mm512_loadu_ps(x + i);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(v, top);  // a NaN lane keeps `top`: the NaN is in `bad`
  }
  nan = bad != 0;
  best = _mm512_reduce_max_ps(top);
#elif defined(__AVX2__)
  __m256 top = _mm256_set1_ps(best), bad = _mm256_setzero_ps();
  for (int64_t i = 0; i < whole; i += kLanes) {
    const __m256 v = _mm256_loadu_ps(x + i);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_max_ps(v, top);
  }
  nan = _mm256_movemask_ps(bad) != 0;
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, top);
  for (float f : lanes) best = f > best ? f : best;
#endif
  for (int64_t i = whole; i < n; ++i) {
    nan |= std::isnan(x[i]);
    best = x[i] > best ? x[i] : best;
  }
  // The first register holding a hit, then the hit's lane; then the tail.
#if defined(__AVX512F__)
  const __m512 want = _mm512_set1_ps(best);
#elif defined(__AVX2__)
  const __m256 want = _mm256_set1_ps(best);
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
  for (int64_t i = 0; i < whole; i += kLanes) {
    if (const unsigned h = hits(x + i, nan, want)) return i + __builtin_ctz(h);
  }
#endif
  for (int64_t i = whole; i < n; ++i) {
    if (nan ? std::isnan(x[i]) : x[i] == best) return i;
  }
  return 0;  // unreachable: some element is the maximum or a NaN
}

#pragma GCC pop_options

}  // namespace

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.size(1) > 0 && logits.stride(1) == 1,
              "logits must be a float32 CPU [N, V > 0] tensor with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* ids = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) ids[r] = row_argmax(x + r * stride, n);
  return out;
}

}  // namespace chunkserve

TORCH_LIBRARY_FRAGMENT(chunkserve, m) { m.def("greedy_argmax(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(chunkserve, CPU, m) { m.impl("greedy_argmax", &chunkserve::greedy_argmax); }
