"""Checkpoint -> model weight loading, driven by a name mapping.

HF checkpoints store q/k/v and gate/up as separate tensors; our model fuses them. Each
checkpoint tensor is routed by name to a parameter and, for fused ones, to a row range
(its shard) of that parameter. Loading is strict in both directions: a checkpoint tensor
with nowhere to go or a parameter shard left unfilled is an error, because either one
means the model would run on uninitialised memory or silently ignore weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

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


def _route(name: str) -> tuple[str, str | None]:
    for piece, (fused_piece, shard) in FUSED.items():
        if piece in name:
            return name.replace(piece, fused_piece), shard
    return name, None


def _expected_shards(model: nn.Module) -> set[tuple[str, str | None]]:
    expected = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            shards = getattr(module, "shards", None) or {None: None}
            expected.update((full, shard) for shard in shards)
    return expected


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy `(hf_name, tensor)` pairs into `model`, converting to the parameters' dtype."""
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
        if shard is not None:
            module = model.get_submodule(target_name.rsplit(".", 1)[0])
            target = target.narrow(0, *module.shards[shard])
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
