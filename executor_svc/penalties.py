"""Allowed tokens, bad words, logit bias and presence, frequency and repetition penalties:
what a sequence holds, and the logits they change.

vLLM's allowed_token_ids leaves only the listed tokens; vLLM's bad_words (token sequences) ban
a sequence's last token where the output so far ends with the ones before it; OpenAI's
logit_bias adds a fixed value to listed tokens' logits; all after a structured-output mask and
before the penalties, in vLLM's order.

vLLM's (and OpenAI's) meaning, applied to the logits after a structured-output mask and
before temperature, so greedy rows see them too:
- presence: logit -= presence_penalty for every token the output holds;
- frequency: logit -= frequency_penalty * the token's count in the output;
- repetition (transformers' RepetitionPenaltyLogitsProcessor): for every token of the prompt
  or the output, a positive logit is divided by repetition_penalty, a negative one multiplied.

The sequence's tokens come from the scheduler once (NewSequence.prompt_token_ids and
output_token_ids: a prefix-cache hit or a recompute never sends the tokens it skips), then
the runner adds every token it accepts. A sequence keeps its distinct tokens sparse (numpy
arrays that grow, and a dict from token to slot), so a step gathers, changes and scatters
only the logits of tokens the sequences hold: O(distinct tokens), not O(vocabulary) per row
(a dense [rows, vocab] pass cost 23-56 ms per step at 32 rows of 49,152 on 2 cores). A
speculative verify row j counts the first j drafts as output too: those are the tokens plain
decoding would hold before that row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def __post_init__(self) -> None:
        for name in ("presence", "frequency", "repetition"):
            if not np.isfinite(getattr(self, name)):
                raise ValueError(f"{name}_penalty must be finite, got {getattr(self, name)}")
        if self.repetition <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition}")

    @property
    def active(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1


NO_PENALTIES = Penalties()


class _Tokens:
    """Distinct token ids in a growing int64 array, each with a float32 count."""

    __slots__ = ("ids", "counts", "slot")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.slot: dict[int, int] = {}
        for t in tokens:
            self.slot.setdefault(t, len(self.slot))
        size = max(16, 2 * len(self.slot))
        self.ids = np.zeros(size, dtype=np.int64)
        self.ids[: len(self.slot)] = list(self.slot)
        self.counts = np.zeros(size, dtype=np.float32)
        np.add.at(self.counts, [self.slot[t] for t in tokens], 1.0)

    def add(self, token: int) -> None:
        i = self.slot.get(token)
        if i is None:
            i = self.slot[token] = len(self.slot)
            if i == len(self.ids):  # full: double
                grow = max(16, len(self.ids))
                self.ids = np.concatenate([self.ids, np.zeros(grow, dtype=self.ids.dtype)])
                self.counts = np.concatenate([self.counts, np.zeros(grow, dtype=self.counts.dtype)])
            self.ids[i] = token
        self.counts[i] += 1

    def arrays(self, extra: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(ids, counts) of what it holds, plus `extra` counted on top (a copy then)."""
        n = len(self.slot)
        if not extra:
            return self.ids[:n], self.counts[:n]
        more = _Tokens([])
        more.ids, more.counts, more.slot = self.ids[:n].copy(), self.counts[:n].copy(), dict(self.slot)
        for t in extra:
            more.add(t)
        return more.arrays()


class TokenHistory:
    """What one sequence holds, as the sampler reads it: the distinct tokens of its prompt and
    output (the repetition penalty's), each output token's count (presence, frequency), and the
    output in order (bad words)."""

    __slots__ = ("seen", "output", "ordered")

    def __init__(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.seen = _Tokens(list(prompt) + list(output))  # counts unused: membership
        self.output = _Tokens(output)
        self.ordered = list(output)

    def add(self, tokens: Sequence[int]) -> None:
        """Counts output tokens (the ones a step accepted)."""
        for t in tokens:
            self.seen.add(t)
            self.output.add(t)
        self.ordered.extend(tokens)

    def ends_with(self, tokens: Sequence[int], extra: Sequence[int] = ()) -> bool:
        """Whether the output, with `extra` after it, ends with `tokens` (an empty one: always)."""
        n = len(tokens)
        if n == 0:
            return True
        tail = self.ordered[max(0, len(self.ordered) - n) :] + list(extra)
        return len(tail) >= n and tail[-n:] == list(tokens)


@dataclass(frozen=True, slots=True)
class LogitBias:
    """Token ids and the float32 values added to their logits."""

    ids: np.ndarray  # int64, distinct
    values: np.ndarray  # float32

    @staticmethod
    def of(bias: dict[int, float]) -> LogitBias | None:
        if not bias:
            return None
        return LogitBias(np.fromiter(bias, dtype=np.int64), np.fromiter(bias.values(), dtype=np.float32))


def apply_allowed(out: torch.Tensor, rows: dict[int, np.ndarray]) -> None:
    """Leaves each listed row of `out` [N, V] only its allowed token ids (the rest -inf), in place."""
    for r, ids in rows.items():
        index = torch.from_numpy(ids).to(out.device)
        keep = out[r].index_select(0, index)
        out[r].fill_(float("-inf"))
        out[r].index_copy_(0, index, keep)


def apply_bad_words(
    out: torch.Tensor, rows: dict[int, tuple[tuple[tuple[int, ...], ...], TokenHistory, Sequence[int]]]
) -> None:
    """Bans, in each listed row of `out` [N, V] (contiguous), the last token of every bad word
    whose other tokens end the output (with the row's `extra` drafts after it), in place.
    `rows`: row -> (its bad words as token sequences, its history, drafts before the row)."""
    vocab, index = out.shape[1], []
    for r, (words, history, extra) in rows.items():
        index += [r * vocab + w[-1] for w in words if history.ends_with(w[:-1], extra)]
    if index:
        out.view(-1)[torch.tensor(index, device=out.device)] = float("-inf")


def apply_logit_bias(out: torch.Tensor, rows: dict[int, LogitBias]) -> None:
    """Adds each listed row's bias to `out` [N, V] (contiguous), in place."""
    vocab = out.shape[1]
    index = _flat_index([(r, b.ids) for r, b in rows.items()], vocab, out.device)
    values = torch.from_numpy(np.concatenate([b.values for b in rows.values()])).to(out.device)
    flat = out.view(-1)
    flat[index] = flat[index] + values


def apply_penalties(out: torch.Tensor, rows: dict[int, tuple[Penalties, TokenHistory, Sequence[int]]]) -> None:
    """Penalizes each listed row of `out` [N, V] (contiguous), in place. `rows`: row -> (its
    penalties, its sequence's history, output tokens to count on top of the history: a verify
    row's drafts before it)."""
    flat, vocab = out.view(-1), out.shape[1]
    rep = [(r, p, h.seen.arrays(extra)[0]) for r, (p, h, extra) in rows.items() if p.repetition != 1]
    if rep:
        index = _flat_index([(r, ids) for r, _, ids in rep], vocab, out.device)
        factor = _per_token([(p.repetition, ids) for _, p, ids in rep], out.device)
        v = flat[index]
        flat[index] = torch.where(v > 0, v / factor, v * factor)
    counted = [(r, p, *h.output.arrays(extra)) for r, (p, h, extra) in rows.items() if p.frequency or p.presence]
    if counted:
        index = _flat_index([(r, ids) for r, _, ids, _ in counted], vocab, out.device)
        freq = _per_token([(p.frequency, ids) for _, p, ids, _ in counted], out.device)
        presence = _per_token([(p.presence, ids) for _, p, ids, _ in counted], out.device)
        counts = torch.from_numpy(np.concatenate([c for *_, c in counted])).to(out.device)
        flat[index] = flat[index] - freq * counts - presence * (counts > 0).to(counts.dtype)


def _flat_index(rows: list[tuple[int, np.ndarray]], vocab: int, device: torch.device) -> torch.Tensor:
    """The flat logits index of every (row, token id)."""
    return torch.from_numpy(np.concatenate([ids + r * vocab for r, ids in rows])).to(device)


def _per_token(rows: list[tuple[float, np.ndarray]], device: torch.device) -> torch.Tensor:
    """Each row's value once per token id it lists (float32, as the logits)."""
    values = np.asarray([v for v, _ in rows], dtype=np.float32)
    return torch.from_numpy(np.repeat(values, [len(ids) for _, ids in rows])).to(device)
