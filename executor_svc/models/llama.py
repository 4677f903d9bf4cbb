"""The Llama family (Llama, SmolLM, Mistral, Qwen2) on flat varlen token batches.

One decoder block serves all of them; the differences are switches read once from the HF
config into a `BlockSpec` (q/k/v bias for Qwen2, `attention_bias` / `mlp_bias` for Llama,
head_dim, RoPE). q/k/v and gate/up are fused into one matmul each: on CPU a step is
dominated by weight reads and per-op overhead, so fewer, larger GEMMs win.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from chunkserve_kernels import AttentionBackend, get_backend, get_forward_context
from torch import nn

from executor_svc.models.layers import (
    PREPACK_MIN_ROWS,
    Embedding,
    Linear,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    linear,
    native_linear,
    packed_linear,
    prepack_weight,
    rope_parameters,
)
from executor_svc.models.quant import GROUP_SIZE, Int4Weights, RowRule, half_linear
from executor_svc.models.weights import load_weights
from executor_svc.parallel import NO_TP, TPInfo, all_gather_last, check_divisible, shard_rows


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """What every sub-module needs to build itself, read once from the HF config."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    backend: AttentionBackend
    dtype: torch.dtype
    device: torch.device | str
    tp: TPInfo = NO_TP  # heads, kv_heads and intermediate are this rank's share of them


class LlamaAttention(nn.Module):
    def __init__(self, s: BlockSpec, layer_idx: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        shards = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        self.qkv_proj = Linear(s.hidden, q_size + 2 * kv_size, s.qkv_bias, s.dtype, s.device, shards, s.tp, 0)
        self.o_proj = Linear(q_size, s.hidden, s.o_bias, s.dtype, s.device, None, s.tp, 1)
        self.attn = PagedAttention(layer_idx, s.backend, s.head_dim**-0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The result may be bfloat16 under the int4 path (see `Linear.forward`'s
        `same_dtype`): the decoder layer adds it to its float32 residual stream."""
        num_tokens, qk_heads = x.shape[0], self.heads + self.kv_heads
        qkv = self.qkv_proj.forward(x).view(num_tokens, qk_heads + self.kv_heads, self.head_dim)
        qk = apply_rotary(qkv[:, :qk_heads], cos, sin)  # q and k rotated in one go
        o = self.attn.forward(qk[:, : self.heads], qk[:, self.heads :], qkv[:, qk_heads:])
        return self.o_proj.forward(o.reshape(num_tokens, self.heads * self.head_dim), False)


class LlamaMLP(nn.Module):
    def __init__(self, s: BlockSpec) -> None:
        super().__init__()
        shards = {"gate": (0, s.intermediate), "up": (s.intermediate, s.intermediate)}
        self.gate_up_proj = Linear(s.hidden, 2 * s.intermediate, s.mlp_bias, s.dtype, s.device, shards, s.tp, 0)
        self.down_proj = Linear(s.intermediate, s.hidden, s.mlp_bias, s.dtype, s.device, None, s.tp, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """May return bfloat16 under the int4 path, like `LlamaAttention.forward`."""
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up, False)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, s: BlockSpec, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(s, layer_idx)
        self.mlp = LlamaMLP(s)
        self.input_layernorm = RMSNorm(s.hidden, s.eps, s.dtype, s.device)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps, s.dtype, s.device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` the previous layer's MLP output (the embeddings for the first layer, with
        `residual` None), `residual` the stream it is added to; returns this layer's MLP
        output and the stream before it is added (the next norm adds it: `add_forward`).
        The same sums in the same order as `h = h + attn(norm(h)); h + mlp(norm(h))`."""
        # Sub-modules' `forward` called directly: nn.Module.__call__ costs ~1-2 us a call and
        # a decode step makes ~10 per layer; none of these modules carries hooks.
        normed, residual = self.input_layernorm.add_forward(x, residual)
        y = self.self_attn.forward(normed, cos, sin)
        normed, residual = self.post_attention_layernorm.add_forward(y, residual)
        return self.mlp.forward(normed), residual


@dataclass(frozen=True, slots=True)
class _FusedLayer:
    """One decoder layer's arguments to the native fused decode layer (kernels/csrc/cpu_layer.cpp)."""

    weights: list[torch.Tensor]  # input norm, qkv, o, post-attention norm, gate_up, down
    biases: list[torch.Tensor | None]  # qkv, o, gate_up, down
    int4: list[torch.Tensor]  # (packed, scales_and_zeros) of qkv, o, gate_up, down; [] if no int4 copies
    eps: float
    heads: int
    kv_heads: int
    scale: float
    layer_idx: int


def _int4_tensors(lin: Linear) -> list[torch.Tensor]:
    """A linear's int4 copy as the fused decode layer takes it, or [] where it has none."""
    q = lin.reduced
    return [q.packed, q.scales_and_zeros] if isinstance(q, Int4Weights) else []


class LlamaModel(nn.Module):
    def __init__(self, config: Any, s: BlockSpec) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, s.hidden, s.dtype, s.device, s.tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(s, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(s.hidden, s.eps, s.dtype, s.device)
        self.rotary_emb = RotaryEmbedding(s.head_dim, rope_parameters(config), s.device)
        self.tp = s.tp
        # set by `use_fused_decode` (the executor's --cpu-kernels native / auto): per layer, what
        # the native fused decode layer takes; None = every step runs the Python layers
        self.fused: list[_FusedLayer] | None = None
        self._fused_linears: list[Linear] = []

    def use_fused_decode(self, enabled: bool = True) -> None:
        """Small pure-decode steps run each decoder layer as one native op (`fused_decode`
        says which). Needs the native library loaded, the attention backends and norms on
        their native ops, and no tensor parallelism (the fused layer has no collectives);
        call it after the int4 copies are made (models/quant.quantize_model), if any."""
        if not enabled:
            self.fused = None
            return
        if self.tp.enabled:
            raise ValueError("the fused decode layer has no tensor-parallel collectives")
        fused = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not all(n.native for n in norms) or not attn.attn.backend.native or norms[0].eps != norms[1].eps:
                raise ValueError("the fused decode layer needs the native norms and attention (--cpu-kernels)")
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            fused.append(
                _FusedLayer(
                    weights=[norms[0].weight, linears[0].weight, linears[1].weight]
                    + [norms[1].weight, linears[2].weight, linears[3].weight],
                    biases=[lin.bias for lin in linears],
                    int4=[t for lin in linears for t in _int4_tensors(lin)] if all(map(_int4_tensors, linears)) else [],
                    eps=norms[0].eps,
                    heads=attn.heads,
                    kv_heads=attn.kv_heads,
                    scale=attn.attn.scale,
                    layer_idx=attn.attn.layer_idx,
                )
            )
        self.fused = fused
        self._fused_linears = [lin for layer in self.layers for lin in layer.modules() if isinstance(lin, Linear)]

    def fused_decode(self, x: torch.Tensor) -> tuple[bool, torch.Tensor, torch.Tensor] | None:
        """(int4, block tables, context lengths) when this step runs the fused layers:
        switched on, float32 on CPU, a pure-decode step in sequence order, and every decoder
        linear's plan gives this step size to the native product ("gemv", 1-4 rows) or to
        the int4 copies ("reduced" under --quantization int4); else None. The fused layer
        computes exactly what the Python layers compute on those paths (a test holds them
        bitwise equal), so this is a question of speed only."""
        if self.fused is None or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        plan = self._fused_linears[0].plan
        kernel = None if plan is None else plan(x.shape[0])
        if kernel == "gemv":
            int4 = False
        elif kernel == "reduced" and self.fused[0].int4:
            int4 = True
        else:
            return None
        if any(lin.plan is not plan for lin in self._fused_linears):
            return None
        ctx = get_forward_context()
        backend = self.layers[0].self_attn.attn.backend
        inputs = backend.native_decode_inputs(ctx.meta, ctx.kv_cache[self.fused[0].layer_idx])
        return None if inputs is None else (int4, *inputs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)  # once per step, shared by all layers
        residual = None
        fused = self.fused_decode(x)
        if fused is not None:
            ctx, layer_op = get_forward_context(), torch.ops.chunkserve.decode_layer
            int4, tables, ctx_lens = fused
            for f in self.fused:
                x, residual = layer_op(
                    x,
                    residual,
                    f.weights,
                    f.biases,
                    f.int4 if int4 else [],
                    GROUP_SIZE,
                    f.eps,
                    cos,
                    sin,
                    f.heads,
                    f.kv_heads,
                    ctx.kv_cache[f.layer_idx],
                    ctx.meta.slot_mapping,
                    tables,
                    ctx_lens,
                    f.scale,
                )
            return self.norm.add_forward(x, residual)[0]
        for layer in self.layers:
            x, residual = layer.forward(x, residual, cos, sin)
        return self.norm.add_forward(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Llama / SmolLM. `forward(input_ids, positions)` reads attention from the forward context."""

    # Qwen2 always has q/k/v bias (and never o_proj bias); Llama follows `attention_bias`.
    qkv_bias_always: ClassVar[bool] = False

    def __init__(
        self,
        config: Any,
        backend: AttentionBackend | str = "torch",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: TPInfo = NO_TP,
    ) -> None:
        """With `tp` (tensor parallelism, executor_svc/parallel.py) this rank's shard only."""
        super().__init__()
        backend = get_backend(backend) if isinstance(backend, str) else backend
        backend.check_dtype(dtype)
        spec = self._block_spec(config, backend, dtype, device, tp)
        backend.check_head_size(spec.head_dim)
        self.config = config
        self.model = LlamaModel(config, spec)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None
        self.tp = tp
        self.vocab_size = config.vocab_size
        if not self.tie_word_embeddings:  # vocab-parallel like the embedding (rows padded up)
            rows = shard_rows(config.vocab_size, tp) if tp.enabled else config.vocab_size
            self.lm_head = Linear(config.hidden_size, rows, False, dtype, device, None, tp, 0)
        self.max_model_len = _max_model_len(config)
        # (16-bit head copy, its RowRule) set by models/quant under the int4 / CPU 16-bit modes
        self.head_reduced: tuple[torch.Tensor, RowRule] | None = None
        self.head_packed: torch.Tensor | None = None  # set by prepack_model (float32 on CPU)
        self.head_plan: Callable[[int], str] | None = None  # models/linear_plan, measured at start-up

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] token ids at [T] absolute positions -> final-normed hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the given rows only (the vocab projection is the
        single most expensive matmul per row, so callers pass just the rows that sample).

        Not necessarily contiguous: on CPU it is the transposed view `linear` returns, and
        copying it (6 MB at 32 rows) only to take a greedy argmax would cost more than the
        argmax; the sampler makes contiguous copies of just the rows that need more."""
        if self.head_plan is not None and not self.tp.enabled and hidden.dim() == 2:
            return self.head_kernel(hidden, self.head_plan(hidden.shape[0]))
        head = self.head_reduced  # int4 / 16-bit CPU modes: the steps its rule admits
        if head is not None and head[1](hidden.shape[0]):
            return half_linear(hidden.to(head[0].dtype), head[0]).float()
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        packed = self.head_packed  # prepack_model: oneDNN's float32 copy, from PREPACK_MIN_ROWS rows
        if packed is not None and hidden.shape[0] >= PREPACK_MIN_ROWS:
            logits = packed_linear(hidden, packed)
        else:
            logits = linear(hidden, weight)
        if self.tp.enabled:  # each rank its vocabulary slice; every rank gets all of them
            return all_gather_last(logits.float(), self.tp.size)[:, : self.vocab_size]
        return logits.float()

    def head_kernel(self, hidden: torch.Tensor, kernel: str) -> torch.Tensor:
        """float32 logits through one named kernel (models/linear_plan.KERNELS), as
        `Linear.apply_kernel` for the head: its 16-bit copy ("reduced": `half_linear`,
        "half-onednn": F.linear), the packed copy, or the float32 weights ("mm", "mm-pad",
        "gemv": `native_linear`)."""
        if kernel in ("reduced", "half-onednn"):
            w = self.head_reduced[0]
            h = hidden.to(w.dtype)
            return (half_linear(h, w) if kernel == "reduced" else F.linear(h, w)).float()
        if kernel == "packed":
            return packed_linear(hidden, self.head_packed)
        if kernel == "gemv":
            return native_linear(
                hidden, self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            )
        if kernel in ("mm", "mm-pad"):
            weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            return linear(hidden, weight, pad=kernel == "mm-pad").float()
        raise ValueError(f"unknown head kernel {kernel!r}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the (fused) parameters; see weights.py."""
        load_weights(self, weights)

    @classmethod
    def _block_spec(
        cls, config: Any, backend: AttentionBackend, dtype: torch.dtype, device: Any, tp: TPInfo = NO_TP
    ) -> BlockSpec:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        check_divisible(heads, kv_heads, tp.size)
        if config.intermediate_size % tp.size:
            raise ValueError(
                f"--tensor-parallel-size {tp.size} does not divide intermediate_size {config.intermediate_size}"
            )
        attention_bias = bool(getattr(config, "attention_bias", False))
        return BlockSpec(
            hidden=config.hidden_size,
            heads=heads // tp.size,
            kv_heads=kv_heads // tp.size,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size // tp.size,
            eps=config.rms_norm_eps,
            qkv_bias=cls.qkv_bias_always or attention_bias,
            o_bias=attention_bias and not cls.qkv_bias_always,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            backend=backend,
            dtype=dtype,
            device=device,
            tp=tp,
        )


def prepack_model(model: LlamaForCausalLM) -> int:
    """Gives every float32 CPU Linear and the vocabulary head oneDNN's packed copy
    (`prepack_weight`, used for steps of >= PREPACK_MIN_ROWS rows); returns the bytes added,
    0 where torch has no oneDNN or the weights are not float32 on CPU."""
    added = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            module.packed = prepack_weight(module.weight)
            added += 0 if module.packed is None else module.weight.nbytes
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if head.dtype == torch.float32 and head.device.type == "cpu":
        model.head_packed = model.lm_head.packed if model.lm_head is not None else prepack_weight(head)
        added += 0 if model.head_packed is None or model.lm_head is not None else head.nbytes
    return added


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama block; its sliding window only caps `max_model_len`."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_always = True


def _max_model_len(config: Any) -> int:
    """Longest context this implementation computes exactly. Attention here is full causal,
    which equals sliding-window attention only while the context fits in the window."""
    limit = int(getattr(config, "max_position_embeddings", 2**31 - 1))
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):  # Qwen2 has an explicit switch
        limit = min(limit, int(window))
    return limit
