// One Llama decoder layer of a float32 CPU decode step in one call: the same ops, in the same
// order, as the Python layer (executor_svc/models/llama.py) runs them on the native path, so
// its results are bitwise that path's; only the Python between them is gone.
//
// Why: a batch-1 decode step of the default model makes ~25 op calls per layer, 30 layers; on
// a 2-core CPU each call from Python costs a few microseconds of argument parsing, module
// attribute lookups and glue before any arithmetic, ~1 ms a step in all, when the step's
// weight reads take ~10 ms. From C++ the ops are plain function calls (ours) or one dispatch
// (aten's). Used for pure decode steps whose linears the plan gives to the native product
// ("gemv", 1-4 rows); every other step keeps the Python layer (models/llama.py,
// `LlamaModel.fused_decode`).

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

// x [T, hidden] (the previous layer's MLP output, or the embeddings with residual None);
// weights: input norm, qkv [(Hq + 2 Hkv) hd, hidden], o [hidden, Hq hd], post-attention norm,
// gate_up [2 I, hidden], down [hidden, I]; biases: qkv, o, gate_up, down (each may be None).
// -> (this layer's MLP output, the residual stream before it is added), as
// `LlamaDecoderLayer.forward`.
std::tuple<at::Tensor, at::Tensor> decode_layer(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                                                double eps, const at::Tensor& cos, const at::Tensor& sin,
                                                int64_t heads, int64_t kv_heads, const at::Tensor& cache,
                                                const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                                const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(weights.size() == 6, "weights must be [input norm, qkv, o, post-attention norm, gate_up, down]");
  TORCH_CHECK(biases.size() == 4, "biases must be [qkv, o, gate_up, down] (each may be None)");
  TORCH_CHECK(x.dim() == 2, "x must be [T, hidden]");
  TORCH_CHECK(heads > 0 && kv_heads > 0, "heads and kv_heads must be positive");
  const at::Tensor &ln1 = weights[0], &qkv_w = weights[1], &o_w = weights[2];
  const at::Tensor &ln2 = weights[3], &gate_up_w = weights[4], &down_w = weights[5];
  const int64_t T = x.size(0), qk_heads = heads + kv_heads;
  TORCH_CHECK(qkv_w.size(0) % (qk_heads + kv_heads) == 0, "qkv rows are not (heads + 2 kv_heads) x head_dim");
  const int64_t hd = qkv_w.size(0) / (qk_heads + kv_heads);

  auto [normed, res] = chunkserve::add_rms_norm(x, residual, ln1, eps);
  const at::Tensor qkv = chunkserve::gemv(normed, qkv_w, biases.get(0)).view({T, qk_heads + kv_heads, hd});
  const at::Tensor qk = rotary(qkv.slice(1, 0, qk_heads), cos, sin);
  chunkserve::write_kv(cache, qk.slice(1, heads), qkv.slice(1, qk_heads), slot_mapping);
  const at::Tensor o = chunkserve::paged_decode_attention(qk.slice(1, 0, heads), cache, block_table, context_lens, scale);
  const at::Tensor y = chunkserve::gemv(o.reshape({T, heads * hd}), o_w, biases.get(1));
  std::tie(normed, res) = chunkserve::add_rms_norm(y, res, ln2, eps);
  const std::vector<at::Tensor> gate_up = chunkserve::gemv(normed, gate_up_w, biases.get(2)).chunk(2, -1);
  const at::Tensor h = at::silu(gate_up[0]) * gate_up[1];
  return {chunkserve::gemv(h, down_w, biases.get(3)), res};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(chunkserve, m) {
  m.def(
      "decode_layer(Tensor x, Tensor? residual, Tensor[] weights, Tensor?[] biases, float eps, Tensor cos, "
      "Tensor sin, int heads, int kv_heads, Tensor(a!) cache, Tensor slot_mapping, Tensor block_table, "
      "Tensor context_lens, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(chunkserve, CPU, m) { m.impl("decode_layer", &decode_layer); }
