"""Benchmark workloads: prompts of exact token lengths cut from real English text.

The text is `corpus.txt` (public-domain openings: Dickens, Austen, Melville, Lincoln,
Carroll), tokenized once with the server's tokenizer. A prompt of n tokens is n
consecutive ids of that stream starting at a seeded offset, wrapping around as often as
needed, so every length is exact and prompts read like prose rather than random ids.
Offsets are drawn without replacement, so two requests never share a prefix by accident
(only the shared-prefix workload shares prefixes, on purpose).

Every request carries a class label (`short` / `long`, `fixed`, `prefix-<g>`) that the
report breaks metrics down by.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

WORKLOADS = ("fixed", "mixed", "shared-prefix")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: exact prompt ids, exact output length, a class label, and
    for the shared-prefix workload which system prompt it starts with and how long that is
    (recorded in the report so `chunkserve tune` can replay the prefix-cache hits)."""

    index: int
    prompt_ids: tuple[int, ...]
    output_len: int
    cls: str
    prefix_group: int | None = None
    prefix_len: int = 0


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate; lengths are (low, high) inclusive ranges in tokens."""

    kind: str = "mixed"
    num_prompts: int | None = None  # None: 100, or N x M for shared-prefix
    output_len: tuple[int, int] = (128, 128)
    input_len: int = 512  # fixed
    long_fraction: float = 0.3  # mixed
    long_len: tuple[int, int] = (2048, 4096)
    short_len: tuple[int, int] = (16, 128)
    num_prefixes: int = 4  # shared-prefix: N system prompts
    users_per_prefix: int = 8  # ... x M users
    prefix_len: int = 1024
    suffix_len: tuple[int, int] = (16, 64)

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {self.kind!r}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"--long-fraction must be in [0, 1], got {self.long_fraction}")
        for name in ("output_len", "long_len", "short_len", "suffix_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be N or LOW:HIGH with 1 <= LOW <= HIGH, got {low}:{high}")
        if self.input_len < 1 or self.prefix_len < 1:
            raise ValueError("--input-len and --prefix-len must be >= 1")
        if self.num_prefixes < 1 or self.users_per_prefix < 1:
            raise ValueError("--num-prefixes and --users-per-prefix must be >= 1")


def parse_range(text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '16:128' -> (16, 128)."""
    low, _, high = text.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise ValueError(f"expected N or LOW:HIGH, got {text!r}") from None


def corpus_text() -> str:
    """The public-domain English text prompts are cut from."""
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


def corpus_ids(tokenizer_dir: str | Path) -> list[int]:
    """The corpus as token ids of the tokenizer in `tokenizer_dir` (no special tokens)."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer.json in {tokenizer_dir} (pass --tokenizer with the served model's folder)")
    return Tokenizer.from_file(str(path)).encode(corpus_text(), add_special_tokens=False).ids


class _TokenStream:
    """Endless prose as token ids: the corpus repeated, read from any offset."""

    def __init__(self, ids: Sequence[int]) -> None:
        if not ids:
            raise ValueError("the corpus tokenized to no ids")
        self.ids = list(ids)

    def take(self, offset: int, n: int) -> tuple[int, ...]:
        size = len(self.ids)
        return tuple(self.ids[(offset + k) % size] for k in range(n))


def _offsets(rng: random.Random, stream: _TokenStream, n: int) -> list[int]:
    size = len(stream.ids)
    return rng.sample(range(size), n) if n <= size else [rng.randrange(size) for _ in range(n)]


def _length(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(*bounds)


def build_workload(spec: WorkloadSpec, corpus_ids: Sequence[int], seed: int) -> list[BenchRequest]:
    """The requests of `spec`, in arrival order; the same seed gives the same requests."""
    rng = random.Random(f"workload-{seed}")
    stream = _TokenStream(corpus_ids)
    if spec.kind == "shared-prefix":
        return _shared_prefix(spec, stream, rng)
    n = spec.num_prompts or 100
    if spec.kind == "fixed":
        classes = ["fixed"] * n
    else:  # mixed: an exact count of long prompts, in seeded random positions
        num_long = round(spec.long_fraction * n)
        classes = ["long"] * num_long + ["short"] * (n - num_long)
        rng.shuffle(classes)
    lengths = {"fixed": (spec.input_len, spec.input_len), "long": spec.long_len, "short": spec.short_len}
    offsets = _offsets(rng, stream, n)
    return [
        BenchRequest(i, stream.take(offsets[i], _length(rng, lengths[c])), _length(rng, spec.output_len), c)
        for i, c in enumerate(classes)
    ]


def _shared_prefix(spec: WorkloadSpec, stream: _TokenStream, rng: random.Random) -> list[BenchRequest]:
    """N system prompts x M users: each prompt = its group's long prefix + a distinct suffix.

    The requests of all groups are interleaved in a seeded random order; --num-prompts other
    than N x M repeats (or truncates) the N x M prompts.
    """
    groups, users = spec.num_prefixes, spec.users_per_prefix
    offsets = _offsets(rng, stream, groups + groups * users)
    prefixes = [stream.take(offsets[g], spec.prefix_len) for g in range(groups)]
    pairs = [(g, u) for g in range(groups) for u in range(users)]
    suffixes = {p: stream.take(offsets[groups + k], _length(rng, spec.suffix_len)) for k, p in enumerate(pairs)}
    n = spec.num_prompts or len(pairs)
    chosen = (pairs * (n // len(pairs) + 1))[:n]
    rng.shuffle(chosen)
    return [
        BenchRequest(
            i, prefixes[g] + suffixes[(g, u)], _length(rng, spec.output_len), f"prefix-{g}", g, spec.prefix_len
        )
        for i, (g, u) in enumerate(chosen)
    ]
