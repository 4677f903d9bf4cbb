"""Which replica a request goes to: pure functions of what the router knows, unit-tested alone.

cache_aware (the default): each replica's predicted time to first token for this request,

    TTFT(r) = time for r to prefill (its pending prompt tokens + this prompt's uncached part)

where the uncached part is the prompt less the leading blocks r holds (the router's index of
r's KV events, plus the blocks of requests it routed to r that r has not reported yet, so a
burst of one group's requests does not scatter before the first one's prefix is cached), and
the time comes from r's step-time model (scheduler_svc/step_cost.py, from GetLoad): steps of
r's token budget less its decodes, each costing the model's fixed part (const, decodes and
their context) plus its prefill tokens. A replica with no fitted model yet is costed with
DEFAULT_STEP_COST, which only has to rank replicas, not predict seconds.

Both of the model's prefill terms cost the queue and the prompt: per token, and per query-key
pair of attention (each replica reports its queue's pairs; the router counts those of what it
sent). A fit may put most of a prefill's cost on either (they grow together with prompt
length): with the queue costed per token alone, a replica whose fit said "per token: 0" looked
free whatever it had queued, and took every request (benchmarks/router.py, 2 replicas).

Replicas that serve the same model alike (same model name, dtype and attention backend) are
costed with one model: the per-coefficient median of their fits (`pool_step_costs`). Each fit
comes from a few hundred of its own steps and its features grow together (prefill tokens and
their attention pairs), so two identical replicas' fits differ several-fold in where they put
the cost; ranked by their own fits, the replica with the cheaper-looking fit took the new
prefixes, and one that got no requests kept its stale, expensive fit and none ever again
(benchmarks/router.py, 4 replicas: two of them served nothing).

The replica with the smallest TTFT wins, where TTFTs closer than one step's fixed cost (below
what the model resolves) count as tied; ties go to the longer cached prefix, then the lighter
load, then the replica that was sent the fewest requests lately (`recent_requests`, decayed
over RECENT_TAU_S). That last one places a new prefix: no replica holds it and, between bursts,
every replica looks idle, so the TTFTs tie exactly; placed by list order, as they were, the
first replicas took most prefix groups, and each group's later requests followed it there (4
replicas: 92-127 requests on two, 18-19 on the others; P99 TTFT set by the crowded two). A
group sends its later requests where its prefix went, so recent requests predict a
replica's coming load.

Imbalance fallback (as SGLang's cache-aware balancer and Dynamo's router do): when the busiest
replica carries more than `balance_abs` requests more than the idlest and more than
`balance_rel` times as many, the least-loaded one takes the request whatever its cache.

round_robin and least_loaded are the baselines benchmarks/router.py compares against.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from scheduler_svc.step_cost import attention_pairs

# seconds per step = const + per prefill token * n + per decode + per context token + per attention pair
DEFAULT_STEP_COST = (0.005, 1e-4, 1e-3, 1e-6, 0.0)
POLICIES = ("cache_aware", "round_robin", "least_loaded")
RECENT_TAU_S = 10.0  # the decay time of ReplicaView.recent_requests


@dataclass
class ReplicaView:
    """What the router knows of one replica when it decides (a copy, so scoring is pure)."""

    name: str
    matched_blocks: int = 0  # leading blocks of this prompt it holds (or was sent)
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    pending_prefill_tokens: int = 0  # its own report
    pending_prefill_attention: int = 0  # its own report: the query-key pairs of that prefill
    router_pending_tokens: int = 0  # uncached prompt tokens the router sent that have no first token yet
    router_pending_attention: int = 0  # their query-key pairs
    router_in_flight: int = 0  # requests the router has in flight there
    num_decoding: int = 0
    decode_context_tokens: int = 0
    recent_requests: float = 0.0  # requests the router sent it lately (decayed: RECENT_TAU_S)
    token_budget: int = 2048
    step_cost: tuple[float, ...] = field(default=DEFAULT_STEP_COST)
    step_cost_fitted: bool = False  # step_cost is the replica's own fit (else DEFAULT_STEP_COST)

    @property
    def load(self) -> int:
        """Requests there: what it reported or what the router has in flight, the larger (the
        report lags; other clients may send it work the router does not see)."""
        return max(self.num_running + self.num_waiting, self.router_in_flight)


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str  # cache, ttft, imbalance, least_loaded, round_robin, only
    matched_blocks: int
    predicted_ttft_s: float


def predicted_ttft(r: ReplicaView, prompt_tokens: int, block_size: int) -> float:
    """Seconds until r would have prefilled this prompt, queue first (see the module docstring)."""
    a, b, c, d, e = (tuple(r.step_cost) + (0.0,) * 5)[:5]
    cached = min(r.matched_blocks * block_size, max(prompt_tokens - 1, 0))
    new = prompt_tokens - cached
    # The queue: the replica's report or what the router sent there, whichever is larger (the
    # report lags; other clients may send it work the router does not see).
    if r.pending_prefill_tokens >= r.router_pending_tokens:
        queued, queued_pairs = r.pending_prefill_tokens, r.pending_prefill_attention
    else:
        queued, queued_pairs = r.router_pending_tokens, r.router_pending_attention
    pending = queued + new
    per_step = max(r.token_budget - r.num_decoding, block_size)
    steps = math.ceil(pending / per_step) if pending else 0
    fixed = a + c * r.num_decoding + d * r.decode_context_tokens
    pairs = queued_pairs + attention_pairs(new, cached)  # the queue's and this prompt's own chunks
    return steps * fixed + b * pending + e * pairs


def pool_step_costs(views: list[ReplicaView], kinds: list[object]) -> None:
    """Gives every view the per-coefficient median of the fitted step costs of the views of
    its kind (replicas serving one model alike), where any is fitted (module docstring)."""
    fits: dict[object, list[tuple[float, ...]]] = {}
    for v, kind in zip(views, kinds):
        if v.step_cost_fitted:
            fits.setdefault(kind, []).append(tuple(v.step_cost))
    for v, kind in zip(views, kinds):
        if kind in fits:
            v.step_cost = tuple(statistics.median(column) for column in zip(*fits[kind]))


def imbalanced(views: list[ReplicaView], balance_abs: int, balance_rel: float) -> bool:
    loads = [v.load for v in views]
    return max(loads) - min(loads) > balance_abs and max(loads) > balance_rel * min(loads)


def least_loaded(views: list[ReplicaView]) -> ReplicaView:
    return min(views, key=lambda v: (v.load, v.router_pending_tokens, v.kv_cache_usage))


def choose(
    views: list[ReplicaView],
    prompt_tokens: int,
    block_size: int,
    policy: str = "cache_aware",
    turn: int = 0,
    balance_abs: int = 32,
    balance_rel: float = 1.5,
) -> Decision:
    """The replica for a request of prompt_tokens tokens. `views` are the routable replicas (at
    least one); `turn` is the round-robin counter."""
    if not views:
        raise ValueError("no replica to route to")
    if len(views) == 1:
        v = views[0]
        return Decision(v.name, "only", v.matched_blocks, predicted_ttft(v, prompt_tokens, block_size))
    if policy == "round_robin":
        v = views[turn % len(views)]
        return Decision(v.name, "round_robin", v.matched_blocks, predicted_ttft(v, prompt_tokens, block_size))
    if policy == "least_loaded" or imbalanced(views, balance_abs, balance_rel):
        v = least_loaded(views)
        reason = "least_loaded" if policy == "least_loaded" else "imbalance"
        return Decision(v.name, reason, v.matched_blocks, predicted_ttft(v, prompt_tokens, block_size))
    if policy != "cache_aware":
        raise ValueError(f"unknown routing policy {policy!r} (one of {', '.join(POLICIES)})")
    ttfts = [predicted_ttft(v, prompt_tokens, block_size) for v in views]
    fastest = min(range(len(views)), key=ttfts.__getitem__)
    resolution = (tuple(views[fastest].step_cost) or (0.0,))[0]  # one step's fixed cost
    tied = [i for i, t in enumerate(ttfts) if t <= ttfts[fastest] + resolution]
    i = min(tied, key=lambda i: (-views[i].matched_blocks, views[i].load, views[i].recent_requests, ttfts[i], i))
    best, ttft = views[i], ttfts[i]
    most = max(v.matched_blocks for v in views)
    reason = "cache" if best.matched_blocks and best.matched_blocks == most else "ttft"
    return Decision(best.name, reason, best.matched_blocks, ttft)


def matched_prefix(hashes: list[bytes], *indexes: object) -> int:
    """Leading hashes found in any of the given containers (a replica's event index, the
    hashes of requests routed there and not yet reported)."""
    n = 0
    for h in hashes:
        if not any(h in index for index in indexes):  # type: ignore[operator]
            break
        n += 1
    return n
