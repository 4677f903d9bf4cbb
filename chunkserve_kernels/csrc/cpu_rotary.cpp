// Rotary embedding of a decode step's queries and keys, with the keys and values written into the
// paged cache, in one pass: what `apply_rotary` (executor_svc/models/layers.py: x.roll(hd / 2),
// times [-sin, sin], plus x * [cos, cos]) and `write_kv` do, bitwise the same.
//
// Why: the fused decode layers (cpu_layer.cpp) ran those as five calls a layer (roll, two
// multiplies, an add, the K/V write), each allocating or dispatching, on data the step's weight
// reads had just pushed out of the caches: ~12 us a layer of a batch-1 step of the default model
// on a 2-core Zen 4 EPYC, 0.35 ms of a ~19 ms step (benchmarks/RESULTS.md, "What a batch-1 step
// spends outside its weight reads"). Here it is one loop over the step's heads, reading each
// token's row of RotaryEmbedding's tables (models/layers.py) at its position: no per-step tables.
//
// Numerics: each output element is fl(fl(x[j] * cos[j]) + fl(x[j'] * sin[j])) with j' the rolled
// index, as the three aten ops round it; compiled without contraction into a fused multiply-add
// (which would round once) or reassociation, so the bits are those of the aten ops.

#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace chunkserve {
namespace {

#pragma GCC push_options
#pragma GCC optimize("no-associative-math", "fp-contract=off")

// out[j] = x[j] * cos[j] + x[(j - hd / 2) mod hd] * sin[j]: torch.roll by hd / 2, then the products.
void rotate(const float* __restrict x, const float* __restrict cos, const float* __restrict sin, float* __restrict out,
            int64_t hd) {
  const int64_t shift = hd / 2;
  for (int64_t j = 0; j < hd; ++j) {
    const float rolled = x[j >= shift ? j - shift : j - shift + hd];
    const float a = x[j] * cos[j];
    const float b = rolled * sin[j];
    out[j] = a + b;
  }
}

#pragma GCC pop_options

}  // namespace

at::Tensor rotary_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                     const at::Tensor& cache, const at::Tensor& slot_mapping, int64_t heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 3 && qkv.is_contiguous(),
              "qkv must be a contiguous float32 CPU [T, heads + 2 kv_heads, head_dim] tensor");
  TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == at::kFloat && cache.dim() == 5 &&
                  cache.size(0) == 2 && cache.is_contiguous(),
              "cache must be a contiguous float32 CPU [2, num_blocks, block_size, num_kv_heads, head_dim] layer");
  const int64_t T = qkv.size(0), hd = qkv.size(2), kv_heads = cache.size(3);
  TORCH_CHECK(heads > 0 && qkv.size(1) == heads + 2 * kv_heads && cache.size(4) == hd, "qkv is [", T, ", ",
              qkv.size(1), ", ", hd, "]; with ", heads, " heads the cache layer needs ", (qkv.size(1) - heads) / 2,
              " KV heads of ", hd, ", it has ", kv_heads, " of ", cache.size(4));
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->dim() == 2 &&
                    table->size(1) == hd && table->sizes() == cos.sizes(),
                "cos and sin must be contiguous float32 [positions, head_dim] tables of one size");
  }
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == T,
              "positions must be int64 [T]");
  const at::Tensor pos = positions.contiguous();
  const int64_t* pos_p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos_p[t] >= 0 && pos_p[t] < cos.size(0), "position ", pos_p[t], " outside the tables' ", cos.size(0));
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == T,
              "slot_mapping must be int64 [T]");
  const int64_t slots = cache.size(1) * cache.size(2);
  const at::Tensor sm = slot_mapping.contiguous();
  const int64_t* sm_p = sm.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sm_p[t] >= 0 && sm_p[t] < slots, "slot ", sm_p[t], " outside the cache's ", slots, " slots");
  }
  at::Tensor q = at::empty({T, heads, hd}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  float* q_p = q.data_ptr<float>();
  float* k_dst = cache.data_ptr<float>();
  float* v_dst = k_dst + slots * kv_heads * hd;
  const int64_t row = (heads + 2 * kv_heads) * hd;
  for (int64_t t = 0; t < T; ++t) {
    const float* x = src + t * row;
    const float* c = cos.data_ptr<float>() + pos_p[t] * hd;
    const float* s = sin.data_ptr<float>() + pos_p[t] * hd;
    for (int64_t h = 0; h < heads; ++h) rotate(x + h * hd, c, s, q_p + (t * heads + h) * hd, hd);
    for (int64_t h = 0; h < kv_heads; ++h) {
      rotate(x + (heads + h) * hd, c, s, k_dst + (sm_p[t] * kv_heads + h) * hd, hd);
      std::memcpy(v_dst + (sm_p[t] * kv_heads + h) * hd, x + (heads + kv_heads + h) * hd, hd * sizeof(float));
    }
  }
  return q;
}

}  // namespace chunkserve

TORCH_LIBRARY_FRAGMENT(chunkserve, m) {
  m.def(
      "rotary_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(a!) cache, Tensor slot_mapping, int heads) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(chunkserve, CPU, m) { m.impl("rotary_kv", &chunkserve::rotary_kv); }
