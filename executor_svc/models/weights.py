"""Checkpoint -> model weight loading, driven by a name mapping.

HF checkpoints store q/k/v and gate/up as separate tensors; our model fuses them. Each
checkpoint tensor is routed by name to a parameter and, for fused ones, to a row range
(its shard) of that parameter. Loading is strict in both directions: a checkpoint tensor
with nowhere to go or a parameter shard left unfilled is an error, because either one
means the model would run on uninitialised memory or silently ignore weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from executor_svc import memory

# checkpoint name piece -> (our fused parameter piece, shard name in Linear.shards)
FUSED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", "gate"),
    ".up_proj.": (".gate_up_proj.", "up"),
}
# Tensors some checkpoints carry that the model recomputes or does not need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LINE_BYTES = 64  # each weight of `one_buffer` starts on a cache line


def _narrow_to_rank(name: str, src: Any, target: torch.Tensor, dim: int, tp: Any) -> torch.Tensor:
    """This rank's part of `src` along `dim`: `target.shape[dim]` wide, the last rank's part
    shorter when the dimension (the vocabulary) is padded up to a multiple of the group."""
    shape, width = _shape(src), target.shape[dim]
    if len(shape) != target.dim() or -(-shape[dim] // tp.size) != width:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {shape}, the model expects {tuple(target.shape)} "
            f"on each of {tp.size} tensor-parallel ranks: does config.json match the weights?"
        )
    start = tp.rank * width
    return _take(src, dim, start, max(0, min(width, shape[dim] - start)))


def _route(name: str) -> tuple[str, str | None]:
    for piece, (fused_piece, shard) in FUSED.items():
        if piece in name:
            return name.replace(piece, fused_piece), shard
    return name, None


def _expected_shards(model: nn.Module) -> set[tuple[str, str | None]]:
    """Every parameter (shard) the checkpoint must fill; a shared one (a tied head's weight is
    the embedding's) once, under its first name."""
    expected = set()
    for full, _ in model.named_parameters():
        module = model.get_submodule(full.rsplit(".", 1)[0]) if "." in full else model
        shards = getattr(module, "shards", None) or {None: None}
        expected.update((full, shard) for shard in shards)
    return expected


def _shape(src: Any) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def _take(src: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a tensor or of a lazy
    safetensors slice, which then reads only those bytes from the file."""
    if isinstance(src, torch.Tensor):
        return src.narrow(dim, start, length)
    return src[start : start + length] if dim == 0 else src[:, start : start + length]


def load_weights(model: nn.Module, weights: Iterable[tuple[str, Any]]) -> None:
    """Copy `(hf_name, tensor)` pairs into `model`, converting to the parameters' dtype.

    Under tensor parallelism (modules with `tp_dim` 0 or 1, see layers.Linear) each source —
    a tensor or a lazy safetensors slice — is narrowed to this rank's rows or columns before
    anything is copied, so a rank reads its shard, never the whole model."""
    params = dict(model.named_parameters())
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[tuple[str, str | None]] = set()
    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target_name, shard = _route(name)
        param = params.get(target_name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        target = param.data
        module = model.get_submodule(target_name.rsplit(".", 1)[0])
        if shard is not None:
            target = target.narrow(0, *module.shards[shard])
        tp_dim = getattr(module, "tp_dim", None)
        if tp_dim is not None and not (tp_dim == 1 and target.dim() == 1):  # a row-parallel bias is whole
            tensor = _narrow_to_rank(name, tensor, target, tp_dim, module.tp)
            target = target.narrow(0, 0, tensor.shape[0]) if tp_dim == 0 else target
        elif not isinstance(tensor, torch.Tensor):
            tensor = tensor[:]
        if target.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(target.shape)}: does config.json match the weights?"
            )
        target.copy_(tensor)
        loaded.add((target_name, shard))
    missing = sorted(f"{n}[{s}]" if s else n for n, s in _expected_shards(model) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")


def one_buffer(model: nn.Module, modules: Sequence[nn.Module]) -> torch.Tensor | None:
    """Re-homes the `weight` of each of `modules` in one buffer, in that order (each on a cache
    line; a weight shared by two modules once, where it first appears), everywhere `model`
    holds it; values are kept. Returns the buffer, or None where the weights are not all CPU
    tensors of one dtype (nothing changes then).

    Why: a decode step on the CPU reads every linear's weight once, in the decoder's order, so
    laid out that way the step's weights are one stream of memory (what the hardware prefetcher
    fetches past the end of one weight is the start of the next), and the buffer lies in 2 MiB
    pages whole (executor_svc/memory.py), where a separate weight under 2 MiB (the default
    model's o_proj, 1.3 MB) could not. The default model's 121 products at one row took
    0.98-0.99x the time from one buffer as from separate tensors in huge pages
    (benchmarks/weight_layout.py; benchmarks/RESULTS.md, "Huge pages and one weight buffer").
    Called before the checkpoint is loaded: the separate tensors were never filled (at most
    zeroed), and they are freed when this returns."""
    weights: list[torch.Tensor] = []
    for module in modules:
        if not any(module.weight is w for w in weights):
            weights.append(module.weight)
    if not weights or any(w.device.type != "cpu" or w.dtype != weights[0].dtype for w in weights):
        return None
    line = max(1, LINE_BYTES // weights[0].element_size())
    sizes = [-(-w.numel() // line) * line for w in weights]
    buffer = memory.empty(sum(sizes), weights[0].dtype)  # in 2 MiB pages
    homes: dict[int, nn.Parameter] = {}
    offset = 0
    for w, size in zip(weights, sizes, strict=True):
        view = buffer[offset : offset + w.numel()].view(w.shape).copy_(w)  # e.g. a vocab shard's zero padding
        homes[id(w)] = nn.Parameter(view, requires_grad=w.requires_grad)
        offset += size
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in homes:
                module._parameters[name] = homes[id(param)]
    return buffer
