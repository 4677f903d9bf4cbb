"""The fused decode path: a small pure-decode step runs every decoder layer in one native call
(chunkserve_kernels/csrc/cpu_layer.cpp, `torch.classes.chunkserve.DecodeLayers`) instead of ~25 op calls
per layer from Python.

When a step takes it is decided in one place, `FusedDecode.forward`: a float32 CPU step whose
decoder linears the model's plan gives to the native product ("gemv", "gemv-stream") or, where the copies
exist, to oneDNN's packed copies ("packed": a speculative verify step's 1 + k rows or a batch of
decodes, where the Python between the ops cost ~15 ms of a 1 + 3-row verify step's ~65 on one
thread) or to the int4 copies ("reduced"), and whose attention backend hands over the step's decode
tables (`AttentionBackend.decode_inputs`: a pure-decode step in sequence order on the native
path). The fused layers compute exactly what the Python layers compute on those paths (a
hypothesis test holds them bitwise equal), so this is a question of speed only. Built by
`LlamaForCausalLM.use_fused_decode` after the plan and any packed or int4 copies are in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from chunkserve_kernels import get_forward_context
from executor_svc.models.kernel_plan import Plan
from executor_svc.models.quant import GROUP_SIZE, Int4Weights

if TYPE_CHECKING:
    from executor_svc.models.layers import Embedding, Linear, RMSNorm, RotaryEmbedding


def _linear_tensors(name: str, lin: Linear) -> dict[str, torch.Tensor]:
    """One linear's tensors under the names DecodeLayers.add_layer takes."""
    out = {f"{name}.weight": lin.weight}
    if lin.bias is not None:
        out[f"{name}.bias"] = lin.bias
    if lin.packed is not None:
        out[f"{name}.packed"] = lin.packed
    if isinstance(lin.reduced, Int4Weights):
        out[f"{name}.int4"], out[f"{name}.int4_scales"] = lin.reduced.packed, lin.reduced.scales_and_zeros
    return out


@dataclass(slots=True)
class GreedyDecodes:
    """A pure-decode step's inputs for `FusedDecode.greedy`, one token per sequence in sequence
    order: what the native loop reads instead of the step's AttentionMetadata (which it would
    not use, and which costs ~0.1 ms to build after a batch-1 step's weight reads)."""

    input_ids: torch.Tensor  # int64 [S]
    positions: torch.Tensor  # int64 [S]: each token's position, its sequence's cached tokens
    block_tables: torch.Tensor  # int32 [S, blocks], padded with 0, covering every step to run
    context_lens: torch.Tensor  # int32 [S]: positions + 1
    max_context: int  # the largest context length, for the rotary tables
    kv_cache: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads, head_dim]

    @classmethod
    def of(
        cls, token_ids: list[int], computed: list[int], tables: list[list[int]], kv_cache: torch.Tensor
    ) -> GreedyDecodes:
        """From host lists: each sequence's token, cached-token count and block table."""
        width = max(map(len, tables))
        return cls(
            torch.tensor(token_ids),
            torch.tensor(computed),
            torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            torch.tensor([c + 1 for c in computed], dtype=torch.int32),
            max(computed) + 1,
            kv_cache,
        )


class FusedDecode:
    """The decoder layers' weights in one native object, and the rule for which steps use it."""

    def __init__(self, embedding: Embedding, layers: torch.nn.ModuleList, norm: RMSNorm, head: Linear) -> None:
        """`layers` are LlamaDecoderLayers whose norms and attention run the native ops; the
        native call also looks up the step's ids in `embedding` and applies the final `norm`
        (a batch-1 step's embedding lookup and final norm cost ~65 us each as op calls from
        Python, where the step's weight reads have just pushed everything out of the caches),
        and `greedy` goes on through the `head` to each row's greedy token."""
        first = layers[0]
        attn, norms = first.self_attn, (first.input_layernorm, first.post_attention_layernorm)
        self.backend = attn.attn.backend
        self.native = torch.classes.chunkserve.DecodeLayers(
            norms[0].eps, attn.heads, attn.kv_heads, attn.attn.scale, GROUP_SIZE
        )
        for i, layer in enumerate(layers):
            if layer.input_layernorm.eps != norms[0].eps or layer.post_attention_layernorm.eps != norms[0].eps:
                raise ValueError("the fused decode layers need one norm eps for every layer")
            if layer.self_attn.attn.layer_idx != i:
                raise ValueError("the fused decode layers need layer i at index i of the KV cache")
            tensors = {
                "input_norm": layer.input_layernorm.weight,
                "post_attention_norm": layer.post_attention_layernorm.weight,
            }
            for name, lin in (
                ("qkv", layer.self_attn.qkv_proj),
                ("o", layer.self_attn.o_proj),
                ("gate_up", layer.mlp.gate_up_proj),
                ("down", layer.mlp.down_proj),
            ):
                tensors |= _linear_tensors(name, lin)
            self.native.add_layer(tensors)
        self.native.set_ends(embedding.weight, norm.weight, norm.eps)
        self.head = head
        self.native.set_head({"weight": head.weight} | ({} if head.packed is None else {"packed": head.packed}))
        self.head_kernels = {"gemv", "gemv-stream"} | ({"packed"} if head.packed is not None else set())
        # the kernels of the plan's that the fused layers can run
        self.kernels = {"gemv", "gemv-stream"} | ({"packed"} if self.native.has_packed() else set())
        self.kernels |= {"reduced"} if self.native.has_int4() else set()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, plan: Plan
    ) -> torch.Tensor | None:
        """The final-normed hidden states [T, hidden] (what `LlamaModel.forward` returns) when
        this step runs fused (module doc), else None and nothing was computed. The layers read
        each token's cos / sin from `rotary`'s tables at its position: no per-step tables."""
        if input_ids.device.type != "cpu":
            return None
        kernel = plan(input_ids.shape[0])
        if kernel not in self.kernels:
            return None
        ctx = get_forward_context()
        inputs = self.backend.decode_inputs(ctx.meta, ctx.kv_cache[0])
        if inputs is None:
            return None
        tables, context_lens = inputs
        # a decode's position is its context length less one: the tables' length from host ints
        cos, sin = rotary.tables(ctx.meta.max_seqlen_k)
        return self.native.forward(
            input_ids, positions, cos, sin, ctx.kv_cache, ctx.meta.slot_mapping, tables, context_lens, kernel
        )

    def greedy(
        self, batch: GreedyDecodes, rotary: RotaryEmbedding, plan: Plan, steps: int, cut: torch.Tensor
    ) -> torch.Tensor | None:
        """int64 [steps run, sequences]: each sequence's greedy token of this step and of up to
        `steps` - 1 decodes after it, each fed the token before (`DecodeLayers.greedy`: what
        `forward`, the head and the sampler's argmax give step by step, with no Python between
        the steps; `cut` [1] nonzero ends it after the step under way). None, and nothing
        computed, when the plan's kernels for this many rows have no fused path or the cache
        is not the native attention's (float32, contiguous, on the CPU)."""
        rows, cache = batch.input_ids.shape[0], batch.kv_cache
        kernel, head_kernel = plan(rows), self.head.plan(rows)
        if kernel not in self.kernels or head_kernel not in self.head_kernels:
            return None
        if cache.device.type != "cpu" or cache.dtype != torch.float32 or not cache.is_contiguous():
            return None
        cos, sin = rotary.tables(batch.max_context + steps - 1)
        return self.native.greedy(
            batch.input_ids,
            batch.positions,
            cos,
            sin,
            cache,
            batch.block_tables,
            batch.context_lens,
            steps,
            kernel,
            head_kernel,
            cut,
        )
