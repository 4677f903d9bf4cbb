// The decoder layers of a float32 CPU decode step in one call: the same ops, in the same order,
// as the Python layers (executor_svc/models/llama.py) run them on the native path, so the results
// are bitwise those; only the Python between the ops is gone.
//
// Why: a batch-1 decode step of the default model makes ~25 op calls per layer, 30 layers; on a
// 2-core CPU each call from Python costs a few microseconds of argument parsing, module attribute
// lookups and glue before any arithmetic, ~1 ms a step in all, when the step's weight reads take
// ~10 ms. From C++ the ops are plain function calls (ours) or one dispatch (aten's). Used for pure
// decode steps whose linears the plan gives to the native product ("gemv", "gemv-stream"), to
// oneDNN's packed float32 copies ("packed": a speculative verify step's 1 + k rows, a batch of
// decodes) or to the int4 copies (--quantization int4: torch's int4 kernel on bfloat16
// activations, as models/quant.Int4Weights calls it); every other step keeps the Python layers
// (models/llama.py, `FusedDecode`).
//
// The weights live in one registered object, torch.classes.chunkserve.DecodeLayers, filled once
// at start-up layer by layer from named tensors (no positional convention to keep in step).

#include "cpu_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace chunkserve {
namespace {

// One linear of a layer: the float32 weight (the native product's) and, where they were made,
// oneDNN's packed copy of it and torch's int4 layout of it.
struct LayerLinear {
  at::Tensor weight;  // float32 [out, in]
  std::optional<at::Tensor> bias;
  at::Tensor packed;             // undefined without a packed copy
  at::Tensor int4, int4_scales;  // undefined without int4 copies
};

// The plan's kernel for every linear of a step (models/kernel_plan.py names them).
enum class Kernel { kGemv, kGemvStream, kPacked, kInt4 };

Kernel kernel_named(const std::string& name) {
  if (name == "gemv") return Kernel::kGemv;
  if (name == "gemv-stream") return Kernel::kGemvStream;
  if (name == "packed") return Kernel::kPacked;
  if (name == "reduced") return Kernel::kInt4;
  TORCH_CHECK(false, "DecodeLayers: no fused path for the linear kernel ", name);
}

// `layers.packed_linear`: oneDNN's product on the packed copy, the same op Python calls.
at::Tensor packed_linear(const at::Tensor& x, const LayerLinear& lin) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, lin.packed, lin.bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

struct Layer {
  at::Tensor input_norm, post_norm;
  LayerLinear qkv, o, gate_up, down;
};

const char* const kLinears[] = {"qkv", "o", "gate_up", "down"};

// `Linear.apply_kernel` of the plan's "gemv" / "gemv-stream" (the native product on the float32
// weight), "packed" (oneDNN's on its packed copy) or "reduced" with the int4 copies (the int4 kernel on x
// in bfloat16, the result cast back to x's dtype when `same_dtype` or there is a bias, then
// added; else left bfloat16 for the caller's float32 add).
at::Tensor linear(const at::Tensor& x, const LayerLinear& lin, Kernel kernel, int64_t group, bool same_dtype) {
  if (kernel == Kernel::kGemv || kernel == Kernel::kGemvStream)
    return gemv(x, lin.weight, lin.bias, kernel == Kernel::kGemvStream);
  if (kernel == Kernel::kPacked) return packed_linear(x, lin);
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16).contiguous(), lin.int4, group, lin.int4_scales);
  if (same_dtype || lin.bias.has_value()) y = y.to(x.scalar_type());
  return lin.bias.has_value() ? y.add_(*lin.bias) : y;
}

at::Tensor take(c10::Dict<std::string, at::Tensor>& tensors, const std::string& name) {
  TORCH_CHECK(tensors.contains(name), "DecodeLayers.add_layer: no tensor named ", name);
  at::Tensor t = tensors.at(name);
  tensors.erase(name);
  return t;
}

}  // namespace

class DecodeLayers : public torch::CustomClassHolder {
 public:
  // eps of both norms, this model's query and KV heads, the attention scale, and the int4 copies'
  // weights per scale (models/quant.GROUP_SIZE).
  DecodeLayers(double eps, int64_t heads, int64_t kv_heads, double scale, int64_t int4_group)
      : eps_(eps), heads_(heads), kv_heads_(kv_heads), scale_(scale), group_(int4_group),
        native_silu_(silu_mul_matches_aten()) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads must be a positive multiple of kv_heads");
  }

  // Appends the next layer from its named tensors: input_norm, post_attention_norm, and for each
  // linear L of qkv, o, gate_up, down: L.weight, L.bias where it has one, L.packed where the
  // packed copies exist, and L.int4 with L.int4_scales where the int4 copies exist (each kind
  // for every linear of every layer, or none). Refuses a missing or unknown name.
  void add_layer(c10::Dict<std::string, at::Tensor> tensors) {
    Layer layer;
    layer.input_norm = take(tensors, "input_norm");
    layer.post_norm = take(tensors, "post_attention_norm");
    LayerLinear* linears[] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    int with_int4 = 0, with_packed = 0;
    for (int i = 0; i < 4; ++i) {
      const std::string name = kLinears[i];
      LayerLinear& lin = *linears[i];
      lin.weight = take(tensors, name + ".weight");
      if (tensors.contains(name + ".bias")) lin.bias = take(tensors, name + ".bias");
      if (tensors.contains(name + ".packed")) {
        lin.packed = take(tensors, name + ".packed");
        ++with_packed;
      }
      if (tensors.contains(name + ".int4")) {
        lin.int4 = take(tensors, name + ".int4");
        lin.int4_scales = take(tensors, name + ".int4_scales");
        ++with_int4;
      }
    }
    std::string unknown;
    for (const auto& item : tensors) unknown += " " + item.key();
    TORCH_CHECK(unknown.empty(), "DecodeLayers.add_layer: unknown tensor names:", unknown);
    TORCH_CHECK(with_int4 == 0 || with_int4 == 4, "DecodeLayers.add_layer: int4 copies for all four linears or none");
    TORCH_CHECK(layers_.empty() || (with_int4 == 4) == has_int4(), "DecodeLayers: int4 copies for every layer or none");
    TORCH_CHECK(with_packed == 0 || with_packed == 4, "DecodeLayers.add_layer: packed copies for all four linears or none");
    TORCH_CHECK(layers_.empty() || (with_packed == 4) == has_packed(),
                "DecodeLayers: packed copies for every layer or none");
    const int64_t rows = layer.qkv.weight.size(0);
    TORCH_CHECK(rows % (heads_ + 2 * kv_heads_) == 0, "qkv.weight rows are not (heads + 2 kv_heads) x head_dim");
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool has_int4() const { return !layers_.empty() && layers_[0].qkv.int4.defined(); }
  bool has_packed() const { return !layers_.empty() && layers_[0].qkv.packed.defined(); }
  bool native_silu() const { return native_silu_; }

  // The model's two ends around the layers: the embedding table [vocab, hidden] the step's ids
  // are looked up in, and the final norm's weight and eps (what `LlamaModel.forward` does before
  // and after its layers), so that a step is one call from ids to the normed hidden states.
  void set_ends(at::Tensor embedding, at::Tensor final_norm, double final_eps) {
    TORCH_CHECK(embedding.scalar_type() == at::kFloat && embedding.dim() == 2 && embedding.is_contiguous(),
                "the embedding must be a contiguous float32 [vocab, hidden] table");
    TORCH_CHECK(final_norm.dim() == 1 && final_norm.size(0) == embedding.size(1),
                "the final norm's weight must be [hidden] of the embedding's hidden ", embedding.size(1));
    embedding_ = std::move(embedding), final_norm_ = std::move(final_norm), final_eps_ = final_eps;
  }

  // input_ids int64 [T], positions int64 [T], cos / sin RotaryEmbedding's full-width tables
  // [positions, head_dim] (rows read at each token's position), kv_cache the whole cache [layers,
  // 2, blocks, block_size, kv_heads, head_dim], slot_mapping / block_table / context_lens the
  // step's decodes (int32 tables and lengths, sequence order); `kernel` the plan's for every
  // linear: "gemv", "gemv-stream", "packed" or "reduced" (the int4 copies). -> the final-normed
  // hidden states [T, hidden], what `LlamaModel.forward` returns.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& block_table, const at::Tensor& context_lens, const std::string& kernel_name) const {
    TORCH_CHECK(embedding_.defined(), "DecodeLayers: set_ends (the embedding and the final norm) before forward");
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == num_layers(), "kv_cache must be [layers, 2, ...] for ",
                num_layers(), " layers");
    const Kernel kernel = kernel_named(kernel_name);
    TORCH_CHECK(kernel != Kernel::kInt4 || has_int4(), "int4 asked for but the layers have no int4 copies");
    TORCH_CHECK(kernel != Kernel::kPacked || has_packed(), "packed asked for but the layers have no packed copies");
    at::Tensor x = embed(input_ids);
    std::optional<at::Tensor> residual;
    for (int64_t i = 0; i < num_layers(); ++i) {
      std::tie(x, residual) = layer_forward(layers_[i], x, residual, positions, cos, sin, kv_cache.select(0, i), slot_mapping,
                                            block_table, context_lens, kernel);
    }
    return std::get<0>(add_rms_norm(x, residual, final_norm_, final_eps_));
  }

  // The vocabulary projection for `greedy`: `weight` float32 [vocab, hidden] (the embedding's
  // when they are tied), with `bias` and `packed` (oneDNN's copy) where the head has them.
  void set_head(c10::Dict<std::string, at::Tensor> tensors) {
    LayerLinear head;
    head.weight = take(tensors, "weight");
    if (tensors.contains("bias")) head.bias = take(tensors, "bias");
    if (tensors.contains("packed")) head.packed = take(tensors, "packed");
    std::string unknown;
    for (const auto& item : tensors) unknown += " " + item.key();
    TORCH_CHECK(unknown.empty(), "DecodeLayers.set_head: unknown tensor names:", unknown);
    TORCH_CHECK(head.weight.scalar_type() == at::kFloat && head.weight.dim() == 2 &&
                    (!embedding_.defined() || head.weight.size(1) == embedding_.size(1)),
                "the head's weight must be float32 [vocab, hidden]");
    head_ = std::move(head);
  }

  // `steps` greedy decode steps of the step's sequences, one token each in sequence order: each
  // is `forward`, the head through `head_kernel` ("gemv", "gemv-stream" or "packed") and the
  // first index of each row's largest logit (greedy_argmax, cpu_argmax.cpp), and each step
  // after the first feeds back the tokens the one before chose, one position on, its K/V
  // written at that position's slot of the sequence's block table (which must cover every
  // step). The same ops as one Python step each (`LlamaModel.forward`, `compute_logits`, the
  // sampler's argmax), so the same tokens. `cut` int32 [1]: read before each step after the
  // first, nonzero ends the loop there (the executor's CutSteps, set from another thread).
  // -> int64 [steps run, sequences] token ids.
  at::Tensor greedy(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& block_table,
                    const at::Tensor& context_lens, int64_t steps, const std::string& kernel_name,
                    const std::string& head_kernel_name, const at::Tensor& cut) const {
    TORCH_CHECK(head_.weight.defined(), "DecodeLayers: set_head before greedy");
    const Kernel head_kernel = kernel_named(head_kernel_name);
    TORCH_CHECK(head_kernel == Kernel::kGemv || head_kernel == Kernel::kGemvStream ||
                    (head_kernel == Kernel::kPacked && head_.packed.defined()),
                "no fused head for the kernel ", head_kernel_name);
    const int64_t S = input_ids.size(0);
    TORCH_CHECK(steps >= 1 && positions.scalar_type() == at::kLong && positions.sizes() == input_ids.sizes() &&
                    context_lens.scalar_type() == at::kInt && context_lens.sizes() == input_ids.sizes() &&
                    block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.size(0) == S &&
                    cut.device().is_cpu() && cut.scalar_type() == at::kInt && cut.numel() == 1,
                "greedy takes steps >= 1, int64 positions and int32 context lengths [S], int32 block tables [S, "
                "blocks] and an int32 cut flag [1]");
    const int64_t bs = kv_cache.size(3), slots = kv_cache.size(2) * bs;
    const at::Tensor tables = block_table.contiguous();
    at::Tensor ids = input_ids, pos = positions.clone(at::MemoryFormat::Contiguous);
    at::Tensor ctx = context_lens.clone(at::MemoryFormat::Contiguous);
    at::Tensor out = at::empty({steps, S}, input_ids.options().dtype(at::kLong));
    for (int64_t s = 0; s < S; ++s) {  // every step's position inside its table, before any is run
      const int64_t last = pos.data_ptr<int64_t>()[s] + steps - 1;
      TORCH_CHECK(last / bs < tables.size(1), "position ", last, " outside the block table's ", tables.size(1), " blocks");
    }
    const int32_t* cut_flag = cut.data_ptr<int32_t>();  // written by another thread: read atomically
    int64_t done = 0;
    for (; done < steps && (done == 0 || __atomic_load_n(cut_flag, __ATOMIC_RELAXED) == 0); ++done) {
      const at::Tensor slot_mapping = decode_slots(tables, pos, bs, slots);
      const at::Tensor hidden = forward(ids, pos, cos, sin, kv_cache, slot_mapping, tables, ctx, kernel_name);
      ids = greedy_argmax(linear(hidden, head_, head_kernel, group_, true));
      out[done].copy_(ids);
      pos.add_(1), ctx.add_(1);
    }
    return out.narrow(0, 0, done);
  }

 private:
  // Each sequence's slot for its token at `pos`: its block table's block at pos / bs, offset
  // pos % bs (build_metadata's slot_mapping), checked against the table and the cache.
  static at::Tensor decode_slots(const at::Tensor& tables, const at::Tensor& pos, int64_t bs, int64_t slots) {
    const int64_t S = pos.size(0), width = tables.size(1);
    at::Tensor slot_mapping = at::empty({S}, pos.options());
    for (int64_t s = 0; s < S; ++s) {
      const int64_t p = pos.data_ptr<int64_t>()[s];
      TORCH_CHECK(p >= 0 && p / bs < width, "position ", p, " outside the block table's ", width, " blocks");
      const int64_t slot = int64_t{tables.data_ptr<int32_t>()[s * width + p / bs]} * bs + p % bs;
      TORCH_CHECK(slot >= 0 && slot < slots, "slot ", slot, " outside the cache's ", slots, " slots");
      slot_mapping.data_ptr<int64_t>()[s] = slot;
    }
    return slot_mapping;
  }

  // The embedding rows of `ids` (F.embedding's result, copied row by row).
  at::Tensor embed(const at::Tensor& ids) const {
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "input_ids must be int64 [T]");
    const at::Tensor id = ids.contiguous();
    const int64_t T = id.size(0), vocab = embedding_.size(0), hidden = embedding_.size(1);
    at::Tensor x = at::empty({T, hidden}, embedding_.options());
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = id.data_ptr<int64_t>()[t];
      TORCH_CHECK(row >= 0 && row < vocab, "token id ", row, " outside the embedding's ", vocab, " rows");
      std::memcpy(x.data_ptr<float>() + t * hidden, embedding_.data_ptr<float>() + row * hidden, hidden * sizeof(float));
    }
    return x;
  }

  // `LlamaDecoderLayer.forward`: (this layer's MLP output, the residual stream before it is added).
  std::tuple<at::Tensor, at::Tensor> layer_forward(const Layer& L, const at::Tensor& x,
                                                   const std::optional<at::Tensor>& residual,
                                                   const at::Tensor& positions, const at::Tensor& cos,
                                                   const at::Tensor& sin, const at::Tensor& cache,
                                                   const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                                   const at::Tensor& context_lens, Kernel kernel) const {
    const int64_t T = x.size(0), qk_heads = heads_ + kv_heads_;
    const int64_t hd = L.qkv.weight.size(0) / (qk_heads + kv_heads_);
    auto [normed, res] = add_rms_norm(x, residual, L.input_norm, eps_);
    const at::Tensor qkv = linear(normed, L.qkv, kernel, group_, true).view({T, qk_heads + kv_heads_, hd});
    const at::Tensor q = rotary_kv(qkv, cos, sin, positions, cache, slot_mapping, heads_);
    const at::Tensor o = paged_decode_attention(q, cache, block_table, context_lens, scale_);
    const at::Tensor y = linear(o.reshape({T, heads_ * hd}), L.o, kernel, group_, false);
    std::tie(normed, res) = add_rms_norm(y, res, L.post_norm, eps_);
    const at::Tensor gate_up = linear(normed, L.gate_up, kernel, group_, true);
    return {linear(activation(gate_up), L.down, kernel, group_, false), res};
  }

  // silu(gate) * up: one native pass where it gives aten's bits (cpu_silu.cpp), else aten's ops.
  at::Tensor activation(const at::Tensor& gate_up) const {
    if (native_silu_ && gate_up.numel() / 2 < at::internal::GRAIN_SIZE) return silu_mul(gate_up);
    const std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
    return at::silu(halves[0]) * halves[1];
  }

  double eps_;
  int64_t heads_, kv_heads_;
  double scale_;
  int64_t group_;
  bool native_silu_;  // silu_mul_matches_aten(), asked once
  std::vector<Layer> layers_;
  at::Tensor embedding_, final_norm_;  // set_ends
  LayerLinear head_;                   // set_head
  double final_eps_ = 0;
};

}  // namespace chunkserve

TORCH_LIBRARY_FRAGMENT(chunkserve, m) {
  m.class_<chunkserve::DecodeLayers>("DecodeLayers")
      .def(torch::init<double, int64_t, int64_t, double, int64_t>())
      .def("add_layer", &chunkserve::DecodeLayers::add_layer)
      .def("num_layers", &chunkserve::DecodeLayers::num_layers)
      .def("has_int4", &chunkserve::DecodeLayers::has_int4)
      .def("has_packed", &chunkserve::DecodeLayers::has_packed)
      .def("native_silu", &chunkserve::DecodeLayers::native_silu)
      .def("set_ends", &chunkserve::DecodeLayers::set_ends)
      .def("set_head", &chunkserve::DecodeLayers::set_head)
      .def("greedy", &chunkserve::DecodeLayers::greedy)
      .def("forward", &chunkserve::DecodeLayers::forward);
}
