"""`--speculative-config` as vLLM spells it, parsed into one frozen value.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "suffix", "num_speculative_tokens": 16, "suffix_decoding_max_tree_depth": 24}

Defaults follow vLLM: n-gram windows 5..5 when neither bound is given (one given sets the
other), suffix drafts up to the tree depth when num_speculative_tokens is left out, and the
suffix_decoding_* defaults (depth 24, 10000 cached requests, spec factor 1.0, min token
probability 0.1). One key is chunkserve's own: `suffix_decoding_max_cached_tokens`, the token
bound of the global corpus (vLLM bounds it by requests only).

Anything the server would not honour is refused with a ValueError naming the key: unknown
keys, vLLM keys for draft models (chunkserve has only model-free methods), and keys of the
other method. Not wired yet: config.py has no --speculative-config flag until the scheduler
and executor can verify drafts (docs/speculative.md, "Wiring").
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from scheduler_svc.spec.ngram import NgramProposer
from scheduler_svc.spec.proposer import Proposer
from scheduler_svc.spec.suffix import SuffixProposer

METHODS = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 64  # one request's draft is one query chunk: keep it a small one
_NGRAM_KEYS = {"prompt_lookup_min", "prompt_lookup_max"}
_SUFFIX_KEYS = {
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
    "suffix_decoding_max_cached_tokens",
}
# vLLM keys that only mean something with a draft model, or that chunkserve does not implement.
_VLLM_UNSUPPORTED = {
    "model",
    "quantization",
    "max_model_len",
    "revision",
    "code_revision",
    "draft_tensor_parallel_size",
    "disable_by_batch_size",
    "disable_padded_drafter_batch",
    "speculative_token_tree",
    "enforce_eager",
    "parallel_drafting",
}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram only
    prompt_lookup_max: int | None = None  # ngram only
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_tokens: int = 1 << 20  # chunkserve's own (module docstring)

    def make_proposer(self) -> Proposer:
        """A fresh proposer with these settings (one per scheduler)."""
        if self.method == "ngram":
            return NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max)
        return SuffixProposer(
            max_tree_depth=self.suffix_decoding_max_tree_depth,
            max_cached_requests=self.suffix_decoding_max_cached_requests,
            max_spec_factor=self.suffix_decoding_max_spec_factor,
            min_token_prob=self.suffix_decoding_min_token_prob,
            max_cached_tokens=self.suffix_decoding_max_cached_tokens,
        )


def parse_speculative_config(value: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
    """The config from a JSON object (text or mapping); None or "" for no speculation.

    Raises ValueError naming the offending key for anything it would not honour."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative config: not JSON ({e})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative config: expected a JSON object, got {type(value).__name__}")
    raw = dict(value)
    method = raw.pop("method", None)
    if method not in METHODS:
        raise ValueError(
            f"speculative config: method must be one of {', '.join(METHODS)} (model-free drafts only), got {method!r}"
        )
    _check_keys(method, raw)
    k = raw.pop("num_speculative_tokens", None)
    if method == "ngram":
        return _ngram(k, raw)
    return _suffix(k, raw)


def _check_keys(method: str, raw: dict[str, Any]) -> None:
    known = {f.name for f in fields(SpeculativeConfig)} - {"method"}
    for key in sorted(raw):
        if key in _VLLM_UNSUPPORTED:
            raise ValueError(f"speculative config: {key!r} is not supported (chunkserve drafts without a model)")
        if key not in known:
            raise ValueError(f"speculative config: unknown key {key!r} (known: {', '.join(sorted(known))})")
        if (method == "ngram" and key in _SUFFIX_KEYS) or (method == "suffix" and key in _NGRAM_KEYS):
            raise ValueError(f"speculative config: {key!r} does not apply to method {method!r}")


def _int(key: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative config: {key} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"speculative config: {key} must be {bound}, got {value}")
    return value


def _float(key: str, value: Any, low: float, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"speculative config: {key} must be a finite number, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"speculative config: {key} must be {bound}, got {value}")
    return float(value)


def _ngram(k: Any, raw: dict[str, Any]) -> SpeculativeConfig:
    if k is None:
        raise ValueError("speculative config: num_speculative_tokens is required for method 'ngram'")
    k = _int("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS)
    lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5  # vLLM's default
    lo = _int("prompt_lookup_min", hi if lo is None else lo, 1)
    hi = _int("prompt_lookup_max", lo if hi is None else hi, 1)
    if lo > hi:
        raise ValueError(f"speculative config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    return SpeculativeConfig("ngram", k, prompt_lookup_min=lo, prompt_lookup_max=hi)


def _suffix(k: Any, raw: dict[str, Any]) -> SpeculativeConfig:
    d = SpeculativeConfig("suffix", 1)  # the defaults
    depth = _int(
        "suffix_decoding_max_tree_depth",
        raw.get("suffix_decoding_max_tree_depth", d.suffix_decoding_max_tree_depth),
        2,
        1024,
    )
    k = _int(
        "num_speculative_tokens", min(depth, MAX_SPECULATIVE_TOKENS) if k is None else k, 1, MAX_SPECULATIVE_TOKENS
    )
    return SpeculativeConfig(
        "suffix",
        k,
        suffix_decoding_max_tree_depth=depth,
        suffix_decoding_max_cached_requests=_int(
            "suffix_decoding_max_cached_requests",
            raw.get("suffix_decoding_max_cached_requests", d.suffix_decoding_max_cached_requests),
            0,
        ),
        suffix_decoding_max_spec_factor=_float(
            "suffix_decoding_max_spec_factor",
            raw.get("suffix_decoding_max_spec_factor", d.suffix_decoding_max_spec_factor),
            0.0,
        ),
        suffix_decoding_min_token_prob=_float(
            "suffix_decoding_min_token_prob",
            raw.get("suffix_decoding_min_token_prob", d.suffix_decoding_min_token_prob),
            0.0,
            1.0,
        ),
        suffix_decoding_max_cached_tokens=_int(
            "suffix_decoding_max_cached_tokens",
            raw.get("suffix_decoding_max_cached_tokens", d.suffix_decoding_max_cached_tokens),
            0,
        ),
    )
