// silu(gate) * up of a fused gate/up projection, in one pass: what the MLP's
// `F.silu(gate) * up` (executor_svc/models/llama.py) computes, bitwise the same.
//
// Why: the fused decode layers (cpu_layer.cpp) ran it as aten's silu and multiply, two
// TensorIterator ops a layer on data the step's weight reads had just pushed out of the caches:
// 6-14 us a layer of a batch-1 step of the default model on a 2-core Zen 4 EPYC, 0.2-0.4 ms of a
// 13-19 ms step (benchmarks/RESULTS.md, "The small ops between the products").
//
// Numerics: aten's float32 silu is x / (1 + exp(-x)) with Sleef's expf (1-ulp) on whole pairs of
// vectors and the C library's expf on the rest of each row (ATen/native/cpu/Loops.h's
// vectorized_loop). This file does the same with the same functions (libtorch_cpu exports
// Sleef's), compiled without reassociation, reciprocals or contraction, so the bits are aten's.
// That holds only where aten runs its kernel for this CPU (ATEN_CPU_CAPABILITY can pick
// another) and serially (a TensorIterator op of GRAIN_SIZE elements or more splits across
// threads, and each piece has its own tail), so `silu_mul_matches_aten` checks the first on
// probe values and the caller keeps aten's ops for large steps.

#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)  // x86 only: other targets build the scalar paths
#include <immintrin.h>
#endif

#include <cmath>
#include <vector>

// Sleef's vector expf as aten's Vectorized<float>::exp calls it; weak, so that a libtorch which
// does not export it still loads this library (the check below then says no).
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
#elif defined(__AVX2__)
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));
#endif

namespace chunkserve {
namespace {

#pragma GCC push_options
#pragma GCC optimize("no-associative-math", "no-reciprocal-math", "fp-contract=off")

// Whether this build has a vector path and its Sleef function is there.
bool have_vector_exp() {
#if defined(__AVX512F__)
  return Sleef_expf16_u10 != nullptr;
#elif defined(__AVX2__)
  return Sleef_expf8_u10 != nullptr;
#else
  return false;
#endif
}

// aten's scalar silu, kept out of line so the compiler cannot vectorise its expf.
__attribute__((noinline)) float scalar_silu(float x) { return x / (1.0f + std::exp(-x)); }

// out[i] = silu(gate[i]) * up[i] for one row of n: vectors on each whole pair of vectors (as
// vectorized_loop steps), the scalar silu on the rest.
void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
  for (const int64_t whole = n / 32 * 32; i < whole; i += 16) {
    const __m512 x = _mm512_loadu_ps(gate + i);
    const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_xor_ps(x, sign))));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
  }
#elif defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (const int64_t whole = n / 16 * 16; i < whole; i += 8) {
    const __m256 x = _mm256_loadu_ps(gate + i);
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(x, sign))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = scalar_silu(gate[i]) * up[i];
}

#pragma GCC pop_options

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 &&
                  gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "gate_up must be a float32 CPU [T, 2 x intermediate] tensor with contiguous rows");
  TORCH_CHECK(have_vector_exp(), "silu_mul: this build has no vector expf matching aten's");
  const int64_t T = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({T, n}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) silu_mul_row(src + t * stride, src + t * stride + n, dst + t * n, n);
  return out;
}

bool silu_mul_matches_aten() {
  if (!have_vector_exp()) return false;
  // Both signs of every binary exponent from 2^-30 (silu ~ x / 2) to 2^7 (exp(-x) overflows
  // past -88.7), four mantissas each, the special values, and a length with a vector part and a
  // tail.
  std::vector<float> values;
  for (int e = -30; e <= 7; ++e) {
    for (float m : {1.0f, 1.3f, 1.7f, 1.9f}) {
      values.push_back(std::ldexp(m, e));
      values.push_back(-values.back());
    }
  }
  for (float v : {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 88.7f, -88.7f, 103.9f, -103.9f}) values.push_back(v);
  const int64_t n = static_cast<int64_t>(values.size());
  at::Tensor gate_up = at::empty({2, 2 * n}, at::kFloat);
  for (int64_t t = 0; t < 2; ++t) {
    float* row = gate_up.data_ptr<float>() + t * 2 * n;
    for (int64_t i = 0; i < n; ++i) row[i] = values[(i + 7 * t) % n], row[n + i] = 0.5f + 0.25f * (i % 5);
  }
  const std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
  const at::Tensor want = at::silu(halves[0]) * halves[1];
  const at::Tensor got = silu_mul(gate_up);
  return at::equal(want.view(at::kInt), got.view(at::kInt));
}

}  // namespace chunkserve

TORCH_LIBRARY_FRAGMENT(chunkserve, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("silu_mul_matches_aten() -> bool", &chunkserve::silu_mul_matches_aten);
}

TORCH_LIBRARY_IMPL(chunkserve, CPU, m) { m.impl("silu_mul", &chunkserve::silu_mul); }
