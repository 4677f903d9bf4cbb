"""The Llama family (Llama, SmolLM, Mistral, Qwen2) on flat varlen token batches.

One decoder block serves all of them; the differences are switches read once from the HF
config into a `BlockSpec` (q/k/v bias for Qwen2, `attention_bias` / `mlp_bias` for Llama,
head_dim, RoPE). q/k/v and gate/up are fused into one matmul each: on CPU a step is
dominated by weight reads and per-op overhead, so fewer, larger GEMMs win.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from chunkserve_kernels import AttentionBackend, get_backend
from executor_svc.collectives import NO_TP, TPInfo, all_gather_last, check_divisible, shard_rows
from executor_svc.models.fused import FusedDecode, GreedyDecodes
from executor_svc.models.kernel_plan import DEFAULT_PLAN, Plan
from executor_svc.models.layers import (
    Embedding,
    Linear,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    prepack_weight,
    rope_parameters,
)
from executor_svc.models.weights import load_weights, one_buffer


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


class LlamaModel(nn.Module):
    def __init__(self, config: Any, s: BlockSpec) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, s.hidden, s.dtype, s.device, s.tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(s, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(s.hidden, s.eps, s.dtype, s.device)
        self.rotary_emb = RotaryEmbedding(s.head_dim, rope_parameters(config), s.device)
        self.plan: Plan = DEFAULT_PLAN  # the decoder linears' plan (LlamaForCausalLM.use_plan)
        self.fused: FusedDecode | None = None  # LlamaForCausalLM.use_fused_decode

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        fused = None if self.fused is None else self.fused.forward(input_ids, positions, self.rotary_emb, self.plan)
        if fused is not None:
            return fused
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)  # once per step, shared by all layers
        residual = None
        for layer in self.layers:
            x, residual = layer.forward(x, residual, cos, sin)
        return self.norm.add_forward(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Llama / SmolLM. `forward(input_ids, positions)` reads attention from the forward context.

    How it computes is set once at start-up (executor_svc/worker.py), each by one method:
    `use_native_kernels` (attention and norms on the native CPU ops), `prepack` (oneDNN's
    packed copies), `use_plan` (each linear's kernel per step size, the head's included) and
    `use_fused_decode` (small decode steps as one native call)."""

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
        """With `tp` (tensor parallelism, executor_svc/tp_group.py) this rank's shard only."""
        super().__init__()
        backend = get_backend(backend) if isinstance(backend, str) else backend
        backend.check_dtype(dtype)
        spec = self._block_spec(config, backend, dtype, device, tp)
        backend.check_head_size(spec.head_dim)
        self.config = config
        self.backend = backend
        self.model = LlamaModel(config, spec)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tp = tp
        self.vocab_size = config.vocab_size
        # The head is a linear like the others, vocab-parallel like the embedding (rows padded
        # up); a tied head shares the embedding's weight (allocated once: "meta" until then).
        rows = shard_rows(config.vocab_size, tp) if tp.enabled else config.vocab_size
        head_device = "meta" if self.tie_word_embeddings else device
        self.lm_head = Linear(config.hidden_size, rows, False, dtype, head_device, None, tp, 0)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_model_len = _max_model_len(config)
        one_buffer(self, self.linears_in_step_order())  # CPU weights: one stream a step (weights.py)

    def linears_in_step_order(self) -> list[Linear]:
        """Every Linear as a step reads them: each layer's qkv, o, gate_up and down, then the head."""
        order = [
            lin
            for layer in self.model.layers
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        ]
        return [*order, self.lm_head]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] token ids at [T] absolute positions -> final-normed hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def greedy_decode(self, batch: GreedyDecodes, steps: int, cut: torch.Tensor) -> torch.Tensor | None:
        """int64 [steps run, sequences]: the greedy tokens of a pure-decode step and of up to
        `steps` - 1 decodes after it in one native call (FusedDecode.greedy), or None, with
        nothing computed, where that does not apply: then `forward` and `compute_logits` serve
        the step."""
        fused = self.model.fused
        return None if fused is None else fused.greedy(batch, self.model.rotary_emb, self.model.plan, steps, cut)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the given rows only (the vocab projection is the
        single most expensive matmul per row, so callers pass just the rows that sample).

        Not necessarily contiguous: on CPU it is the transposed view `linear` returns, and
        copying it (6 MB at 32 rows) only to take a greedy argmax would cost more than the
        argmax; the sampler makes contiguous copies of just the rows that need more."""
        logits = self.lm_head.forward(hidden).float()
        if self.tp.enabled:  # each rank its vocabulary slice; every rank gets all of them
            return all_gather_last(logits, self.tp.size)[:, : self.vocab_size]
        return logits

    def decoder_linears(self) -> list[Linear]:
        """Every Linear of the decoder layers (not the head)."""
        return [m for m in self.model.layers.modules() if isinstance(m, Linear)]

    def use_native_kernels(self, enabled: bool = True) -> None:
        """Decode attention, K/V writes (the torch backend) and residual add + RMSNorm on the
        native float32 CPU ops (chunkserve_kernels/cpu_native.py must have loaded), or back."""
        if not enabled:  # the fused layers call the native ops
            self.use_fused_decode(False)
        self.backend.use_native(enabled)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.native = enabled

    def use_triton_norms(self, enabled: bool = True) -> bool:
        """A 16-bit model's residual add + RMSNorm as one Triton kernel each on a GPU (chunkserve_kernels/
        triton_norm.py: ~5-9 launches fewer a norm, two norms a layer), or back to torch's ops; float32
        rows keep torch's (the exact mode). Returns whether they are on: not where triton does not import."""
        kernel = None
        if enabled:
            try:
                from chunkserve_kernels import triton_norm as kernel
            except ImportError:
                enabled = False
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.triton = kernel
        return enabled

    @property
    def fused(self) -> FusedDecode | None:
        return self.model.fused

    def use_fused_decode(self, enabled: bool = True) -> None:
        """Small pure-decode steps run every decoder layer as one native call (models/fused.py).
        Needs the native kernels on (`use_native_kernels`) and no tensor parallelism (the
        fused layers have no collectives); call it after any int4 copies are made."""
        if not enabled:
            self.model.fused = None
            return
        if self.tp.enabled:
            raise ValueError("the fused decode layers have no tensor-parallel collectives")
        if not self.backend.native or not all(m.native for m in self.modules() if isinstance(m, RMSNorm)):
            raise ValueError("the fused decode layers need the native norms and attention (use_native_kernels)")
        self.model.fused = FusedDecode(self.model.embed_tokens, self.model.layers, self.model.norm, self.lm_head)

    def prepack(self) -> int:
        """Gives every float32 CPU linear, the head included, oneDNN's packed copy (the plan's
        "packed" kernel, `layers.prepack_weight`); returns the bytes added, 0 where torch has
        no oneDNN or the weights are not float32 on CPU."""
        added = 0
        for lin in [*self.decoder_linears(), self.lm_head]:
            if lin.weight.dtype == torch.float32 and lin.weight.device.type == "cpu":
                lin.packed = prepack_weight(lin.weight)
                added += 0 if lin.packed is None else lin.weight.nbytes
        return added

    def use_plan(self, body: Plan, head: Plan) -> int:
        """The one place the kernels are set: `body` for every decoder linear (and the fused
        path's rule), `head` for the vocabulary head. Drops the packed copies no bucket of
        their plan chose (float32's weights once more each); returns the bytes freed."""
        freed = 0
        for lin, plan in [*((lin, body) for lin in self.decoder_linears()), (self.lm_head, head)]:
            lin.plan = plan
            if "packed" not in plan.kernels and lin.packed is not None:
                freed += lin.weight.nbytes
                lin.packed = None
        self.model.plan = body
        return freed

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
