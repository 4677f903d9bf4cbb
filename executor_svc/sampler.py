"""Token sampling for the rows of a step that sample.

Two properties drive the design:
- Seeded requests are reproducible whatever else shares the batch and across preemption:
  each seeded row draws from its own generator, seeded from (request seed, position of
  the token being sampled), and uses exactly one uniform draw (inverse-CDF sampling), so
  the stream never depends on how many numbers other rows consumed.
- The common case is cheap: an all-greedy batch is one argmax, and log_softmax / top-k
  over the 49K vocab run only when some row asked for logprobs. (A CPU step whose rows are all
  plainly greedy and that runs fused never gets here: the native call ends in the argmax,
  runner.py `_greedy_steps`.)
Logprobs describe the model, not the sampler: they come from the raw logits, before
temperature and filtering (what OpenAI-style APIs report) — but after a structured-output
token mask, which comes before everything: a token the grammar forbids has probability 0 for
greedy, temperature, top-k/p, min-p and logprobs alike (-inf logprob, never among the top).
Allowed tokens, bad words, a logit bias, then presence, frequency and repetition penalties
(penalties.py), come after the mask and before temperature, greedy included; logprobs stay the
model's own, before them (vLLM's default, "raw" logprobs). Rows without any of these cost
nothing extra.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from chunkserve_kernels import cpu_native
from executor_svc.penalties import (
    NO_PENALTIES,
    LogitBias,
    Penalties,
    TokenHistory,
    apply_allowed,
    apply_bad_words,
    apply_logit_bias,
    apply_penalties,
)

_MASK64 = (1 << 64) - 1
_GREEDY_BELOW = 1e-5


@dataclass(slots=True)
class SamplingSpec:
    temperature: float = 1.0  # 0 (or < 1e-5) -> greedy argmax
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0  # 1.0 -> off
    min_p: float = 0.0  # 0 -> off; drop tokens with prob < min_p * max prob
    seed: int | None = None  # None -> the sampler's own (unseeded) generator
    num_logprobs: int = -1  # -1 none; 0 sampled token only; k also the top k
    num_prompt_logprobs: int = -1  # prompt logprobs: -1 none; k: each one's top k too (runner.py)
    penalties: Penalties = NO_PENALTIES  # presence / frequency / repetition (penalties.py)
    logit_bias: LogitBias | None = None  # OpenAI's logit_bias: added to these tokens' logits
    allowed: np.ndarray | None = None  # vLLM's allowed_token_ids (int64): only these may be sampled
    bad_words: tuple[tuple[int, ...], ...] = ()  # vLLM's bad_words as token sequences (penalties.py)

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if self.num_logprobs < -1:
            raise ValueError(f"num_logprobs must be >= -1 (-1 disables it), got {self.num_logprobs}")

    @property
    def greedy(self) -> bool:
        # Below ~1e-5, logits / temperature overflows float32; such a request means greedy.
        return self.temperature < _GREEDY_BELOW

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that reads or changes the logits first: no logprobs, penalties,
        bias, allowed or bad words. Its token is the raw logits' argmax alone."""
        return (
            self.greedy
            and self.num_logprobs < 0
            and not self.penalties.active
            and self.logit_bias is None
            and self.allowed is None
            and not self.bad_words
        )


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]  # of the sampled token; NaN for rows with num_logprobs == -1
    top: list[list[tuple[int, float]]]  # (token id, logprob), best first; [] unless num_logprobs > 0


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): neighbouring seeds/positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _filtered_probs(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (each row independently)."""
    temps = torch.tensor([s.temperature for s in specs], dtype=logits.dtype, device=logits.device)
    x = logits / temps[:, None]
    k_rows = [i for i, s in enumerate(specs) if s.top_k > 0]
    if k_rows:
        rows = torch.tensor(k_rows, device=x.device)
        sub = x.index_select(0, rows)
        k = torch.tensor([specs[i].top_k for i in k_rows], device=x.device).clamp_(max=x.shape[1])
        kth = sub.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        x = x.index_copy(0, rows, sub.masked_fill(sub < kth, float("-inf")))
    probs = x.softmax(dim=-1)
    if any(s.top_p < 1 for s in specs):
        # Rows without top-p get an infinite threshold: cumsum rounding must not cut their tail.
        top_p = torch.tensor([s.top_p if s.top_p < 1 else math.inf for s in specs], device=x.device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p[:, None]  # never drops the top token
        drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    min_p = [s.min_p for s in specs]
    if any(min_p):
        floor = torch.tensor(min_p, device=x.device)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _draw(probs: torch.Tensor, specs: list[SamplingSpec], positions: list[int]) -> torch.Tensor:
    """One uniform per row, inverse CDF; seeded rows use their own (seed, position) stream."""
    uniforms = torch.rand(len(specs), dtype=torch.float64)
    for i, (spec, pos) in enumerate(zip(specs, positions)):
        if spec.seed is not None:
            gen = torch.Generator().manual_seed(_mix(spec.seed, pos))
            uniforms[i] = torch.rand(1, generator=gen, dtype=torch.float64)
    cdf = probs.double().cumsum(dim=-1)
    target = (uniforms.to(cdf.device) * cdf[:, -1])[:, None]
    ids = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1).squeeze(1)
    # Rounding can only push past the last non-zero token; fall back to the likeliest one.
    dead = probs.gather(1, ids[:, None]).squeeze(1) == 0
    return torch.where(dead, probs.argmax(dim=-1), ids)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`, the same indices; on the native op (csrc/cpu_argmax.cpp, ~9x
    faster over a 49K vocabulary) where it loaded and the rows are contiguous float32 on the CPU
    (a batch-1 step's; a batch's logits are the head's transposed view and keep aten's)."""
    if logits.dtype == torch.float32 and logits.stride(-1) == 1 and logits.device.type == "cpu" and cpu_native.loaded():
        return torch.ops.chunkserve.greedy_argmax(logits)
    return logits.argmax(dim=-1)


def apply_token_masks(logits: torch.Tensor, masks: dict[int, bytes]) -> torch.Tensor:
    """`logits` with -inf at every token t a row's packed mask does not allow (a new tensor;
    rows without a mask copied as they are). A mask is ceil(V / 32) little-endian 32-bit
    words, bit t = word t // 32, bit t % 32 (byte t // 8, bit t % 8); bits past V are
    ignored (plan_check.py refuses plans that set them). Unpacked by numpy (one C pass, 5x
    torch's shifts), then one torch.where over the masked rows."""
    rows = sorted(masks)
    vocab = logits.shape[1]
    packed = np.frombuffer(b"".join(masks[r] for r in rows), dtype=np.uint8).reshape(len(rows), -1)
    bits = np.unpackbits(packed, axis=1, count=vocab, bitorder="little").view(np.bool_)
    allowed = torch.from_numpy(bits).to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:
        return torch.where(allowed, logits, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    return logits.index_copy(0, index, torch.where(allowed, logits.index_select(0, index), float("-inf")))


def sample(
    logits: torch.Tensor,
    params: list[SamplingSpec],
    positions: list[int],
    masks: dict[int, bytes] | None = None,
    histories: dict[int, tuple[TokenHistory, list[int]]] | None = None,
) -> SampleOutput:
    """Pick one token per row of float32 `logits` [N, V] (any strides: greedy rows take the
    argmax in place; rows that sample or report logprobs are copied out contiguous first).

    `positions[i]` is the absolute position the sampled token will occupy in its sequence;
    with the request seed it keys the row's random stream. `masks` (structured output): row
    -> packed allowed-token bits (apply_token_masks), applied before anything else.
    `histories`: row -> (its sequence's TokenHistory, output tokens to count on top of it),
    for every row whose spec has active penalties or bad words.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(positions):
        raise ValueError(
            f"need logits [N, V] with one SamplingSpec and one position per row; got logits "
            f"{tuple(logits.shape)}, {len(params)} specs, {len(positions)} positions"
        )
    if masks:
        logits = apply_token_masks(logits, masks)
    raw = logits  # logprobs describe the model: before the bias and the penalties
    biased = {r: s.logit_bias for r, s in enumerate(params) if s.logit_bias is not None}
    allowed = {r: s.allowed for r, s in enumerate(params) if s.allowed is not None}
    if biased or histories or allowed:
        logits = logits.clone(memory_format=torch.contiguous_format)
        if allowed:
            apply_allowed(logits, allowed)
        if histories and (
            banned := {r: (params[r].bad_words, *h) for r, h in histories.items() if params[r].bad_words}
        ):
            apply_bad_words(logits, banned)
        if biased:
            apply_logit_bias(logits, biased)
        if histories:
            apply_penalties(logits, {r: (params[r].penalties, *histories[r]) for r in histories})
    token_ids = greedy_ids(logits)
    random_rows = [i for i, s in enumerate(params) if not s.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        specs = [params[i] for i in random_rows]
        probs = _filtered_probs(logits.index_select(0, rows).contiguous(), specs)
        drawn = _draw(probs, specs, [positions[i] for i in random_rows])
        token_ids = token_ids.index_copy(0, rows, drawn)
    ids = token_ids.tolist()

    logprobs, top = [math.nan] * len(params), [[] for _ in params]
    wanted = [i for i, s in enumerate(params) if s.num_logprobs >= 0]
    if wanted:
        rows = torch.tensor(wanted, device=logits.device)
        lp = torch.log_softmax(raw.index_select(0, rows).float().contiguous(), dim=-1)
        chosen = lp.gather(1, token_ids.index_select(0, rows)[:, None]).squeeze(1).tolist()
        k = min(max(params[i].num_logprobs for i in wanted), lp.shape[1])
        top_vals = top_ids = [[] for _ in wanted]
        if k > 0:
            vals, idx = lp.topk(k, dim=-1)
            top_vals, top_ids = vals.tolist(), idx.tolist()
        for j, i in enumerate(wanted):
            logprobs[i] = chosen[j]
            n = params[i].num_logprobs
            top[i] = list(zip(top_ids[j][:n], top_vals[j][:n]))
            if masks and i in masks:  # fewer allowed tokens than asked: no forbidden ones
                top[i] = [(t, v) for t, v in top[i] if v != float("-inf")]
    return SampleOutput(ids, logprobs, top)
