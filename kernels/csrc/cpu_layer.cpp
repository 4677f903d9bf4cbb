// One Llama decoder layer of a float32 CPU decode step in one call: the same ops, in the same
// order, as the Python layer (executor_svc/models/llama.py) runs them on the native path, so
// its results are bitwise that path's; only the Python between them is gone.
//
// Why: a batch-1 decode step of the default model makes ~25 op calls per layer, 30 layers; on
// a 2-core CPU each call from Python costs a few microseconds of argument parsing, module
// attribute lookups and glue before any arithmetic, ~1 ms a step in all, when the step's
// weight reads take ~10 ms. From C++ the ops are plain function calls (ours) or one dispatch
// (aten's). Used for pure decode steps whose linears the plan gives to the native product
// ("gemv", 1-4 rows) or to the int4 copies (--quantization int4: torch's int4 kernel on
// bfloat16 activations, as models/quant.Int4Weights calls it); every other step keeps the
// Python layer (models/llama.py, `LlamaModel.fused_decode`).

#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace {

// `apply_rotary` of models/layers.py: x rolled by half the head size, times [-sin, sin], plus
// x * [cos, cos]; the same three aten ops, so bitwise the same result.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor rotated = x.roll({x.size(-1) / 2}, {-1});
  rotated.mul_(sin);
  return (x * cos).add_(rotated);
}

// Linear `i` (0 qkv, 1 o, 2 gate_up, 3 down) as `Linear.apply_kernel` computes it: the native
// product on the float32 weight, or with `int4` given (packed, scales_and_zeros per linear) the
// int4 kernel on x in bfloat16, its result cast back to x's dtype when `same_dtype` or there is
// a bias (then added), else left bfloat16 for the caller's float32 add to promote.
at::Tensor linear(const at::Tensor& x, int i, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                  at::TensorList int4, int64_t group, bool same_dtype) {
  static constexpr int kWeight[4] = {1, 2, 4, 5};
  const std::optional<at::Tensor> bias = biases.get(i);
  if (int4.empty()) return chunkserve::gemv(x, weights[kWeight[i]], bias);
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16).contiguous(), int4[2 * i], group, int4[2 * i + 1]);
  if (same_dtype || bias.has_value()) y = y.to(x.scalar_type());
  return bias.has_value() ? y.add_(*bias) : y;
}

// x [T, hidden] (the previous layer's MLP output, or the embeddings with residual None);
// weights: input norm, qkv [(Hq + 2 Hkv) hd, hidden], o [hidden, Hq hd], post-attention norm,
// gate_up [2 I, hidden], down [hidden, I]; biases: qkv, o, gate_up, down (each may be None);
// int4: empty (float32 products) or the int4 copies' packed weight and scales_and_zeros for
// qkv, o, gate_up, down in turn, `group` weights per scale. -> (this layer's MLP output, the
// residual stream before it is added), as `LlamaDecoderLayer.forward`.
std::tuple<at::Tensor, at::Tensor> decode_layer(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                                                at::TensorList int4, int64_t group, double eps, const at::Tensor& cos,
                                                const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                                                const at::Tensor& cache, const at::Tensor& slot_mapping,
                                                const at::Tensor& block_table, const at::Tensor& context_lens,
                                                double scale) {
  TORCH_CHECK(weights.size() == 6, "weights must be [input norm, qkv, o, post-attention norm, gate_up, down]");
  TORCH_CHECK(biases.size() == 4, "biases must be [qkv, o, gate_up, down] (each may be None)");
  TORCH_CHECK(int4.empty() || int4.size() == 8, "int4 must be empty or (packed, scales_and_zeros) x 4");
  TORCH_CHECK(x.dim() == 2, "x must be [T, hidden]");
  TORCH_CHECK(heads > 0 && kv_heads > 0, "heads and kv_heads must be positive");
  const at::Tensor &ln1 = weights[0], &qkv_w = weights[1], &ln2 = weights[3];
  const int64_t T = x.size(0), qk_heads = heads + kv_heads;
  TORCH_CHECK(qkv_w.size(0) % (qk_heads + kv_heads) == 0, "qkv rows are not (heads + 2 kv_heads) x head_dim");
  const int64_t hd = qkv_w.size(0) / (qk_heads + kv_heads);

  auto [normed, res] = chunkserve::add_rms_norm(x, residual, ln1, eps);
  const at::Tensor qkv = linear(normed, 0, weights, biases, int4, group, true).view({T, qk_heads + kv_heads, hd});
  const at::Tensor qk = rotary(qkv.slice(1, 0, qk_heads), cos, sin);
  chunkserve::write_kv(cache, qk.slice(1, heads), qkv.slice(1, qk_heads), slot_mapping);
  const at::Tensor o = chunkserve::paged_decode_attention(qk.slice(1, 0, heads), cache, block_table, context_lens, scale);
  const at::Tensor y = linear(o.reshape({T, heads * hd}), 1, weights, biases, int4, group, false);
  std::tie(normed, res) = chunkserve::add_rms_norm(y, res, ln2, eps);
  const std::vector<at::Tensor> gate_up = linear(normed, 2, weights, biases, int4, group, true).chunk(2, -1);
  const at::Tensor h = at::silu(gate_up[0]) * gate_up[1];
  return {linear(h, 3, weights, biases, int4, group, false), res};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(chunkserve, m) {
  m.def(
      "decode_layer(Tensor x, Tensor? residual, Tensor[] weights, Tensor?[] biases, Tensor[] int4, int group, "
      "float eps, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor(a!) cache, Tensor slot_mapping, "
      "Tensor block_table, Tensor context_lens, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(chunkserve, CPU, m) { m.impl("decode_layer", &decode_layer); }
