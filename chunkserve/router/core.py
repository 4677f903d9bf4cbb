"""The routing decision and the bookkeeping around it, shared by the gRPC and HTTP fronts.

A request's prompt is tokenized here exactly as the replicas do it (scheduler_svc's Tokenizer
and tokenize_prompt, off the event loop) and hashed with the scheduler's own block hash
(chunkserve_contracts/block_hash.py), so "replica r holds this prompt's first n blocks" is a
lookup in r's event index. The router forwards the request unchanged: routing only decides
where it runs, never what it computes; a prompt the router cannot tokenize (bad input, a chat
template the replicas override) is routed by load and the replica answers it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from chunkserve.router.metrics import RouterMetrics
from chunkserve.router.replicas import Replica, ReplicaSet
from chunkserve.router.scoring import Decision, ReplicaView, choose, matched_prefix, pool_step_costs
from chunkserve_contracts.block_hash import prompt_block_hashes
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from scheduler_svc.step_cost import attention_pairs


class NoReplicaError(Exception):
    """No replica can take the request now (all down or draining)."""


@dataclass
class Ticket:
    """One request placed on a replica: released when it ends or moves (a retry)."""

    replica: Replica
    decision: Decision
    hashes: list[bytes]
    uncached_tokens: int
    uncached_attention: int
    first_token: bool = False
    released: bool = field(default=False, repr=False)

    def got_first_token(self) -> None:
        if not self.first_token:
            self.first_token = True
            self.replica.pending_tokens -= self.uncached_tokens
            self.replica.pending_attention -= self.uncached_attention

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.got_first_token()
        r = self.replica
        r.in_flight -= 1
        r.routed.subtract(self.hashes)
        for h in self.hashes:
            if r.routed[h] <= 0:
                del r.routed[h]


class Router:
    """Tokenizes, scores and places requests; counts what is in flight where."""

    def __init__(
        self,
        replicas: ReplicaSet,
        metrics: RouterMetrics,
        tokenizer_path: str | None,
        policy: str = "cache_aware",
        balance_abs: int = 32,
        balance_rel: float = 1.5,
    ) -> None:
        self.replicas = replicas
        self.metrics = metrics
        self.policy = policy
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._turn = itertools.count()
        self._tokenizer = None
        self._tokenizer_path = tokenizer_path
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-tokenize")
        self._costs_key: list[tuple[str, object, object]] = []
        self._costs: list[tuple[float, ...]] = []

    def tokenizer(self):  # scheduler_svc.tokenizer.Tokenizer, loaded on first use
        if self._tokenizer is None and self._tokenizer_path:
            from scheduler_svc.tokenizer import Tokenizer

            self._tokenizer = Tokenizer(self._tokenizer_path)
        return self._tokenizer

    def _token_ids(self, request: pb.GenerateRequest) -> list[int] | None:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        tokenizer = self.tokenizer()
        if tokenizer is None or kind is None:
            return None
        from scheduler_svc.errors import ServingError
        from scheduler_svc.validation import Limits, tokenize_prompt

        info = next((r.info for r in self.replicas.routable() if r.info is not None), None)
        if info is None:
            return None
        limits = Limits.for_tokenizer(info.max_model_len, info.vocab_size, tokenizer.max_bytes_per_token)
        try:
            return tokenize_prompt(request, tokenizer, limits)
        except ServingError:
            return None  # the replica refuses it with the right status

    async def token_ids(self, request: pb.GenerateRequest) -> list[int] | None:
        """The prompt's token ids as the replicas will see them (None: unknown, route by load)."""
        if request.WhichOneof("prompt") == "token_ids":
            return list(request.token_ids.ids)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._token_ids, request)

    def place(
        self, token_ids: list[int] | None, salt: str | None, exclude: set[str] = frozenset(), cacheable: bool = True
    ) -> Ticket:
        """Chooses a replica (not in `exclude`: those a retry already failed on) and counts the
        request there. `cacheable` False: the request computes its whole prompt wherever it goes
        (prompt logprobs need every prompt row), so no replica's cache counts for it; the blocks
        it leaves are still recorded where it goes. Raises NoReplicaError."""
        started = time.perf_counter()
        candidates = [r for r in self.replicas.routable() if r.name not in exclude]
        if not candidates:
            raise NoReplicaError("no replica is serving" + (" (the others failed this request)" if exclude else ""))
        block_size = next((r.info.block_size for r in candidates if r.info is not None), 16)
        hashes = prompt_block_hashes(token_ids, block_size, salt) if token_ids else []
        match = hashes if cacheable else []
        views = [self._view(r, match, cost) for r, cost in zip(candidates, self._step_costs(candidates))]
        decision = choose(
            views,
            len(token_ids) if token_ids else 0,
            block_size,
            self.policy,
            next(self._turn),
            self.balance_abs,
            self.balance_rel,
        )
        replica = self.replicas.replicas[decision.replica]
        cached = min(decision.matched_blocks * block_size, len(token_ids) if token_ids else 0)
        uncached = (len(token_ids) if token_ids else 0) - cached
        attention = attention_pairs(uncached, cached)
        replica.in_flight += 1
        replica.pending_tokens += uncached
        replica.pending_attention += attention
        replica.routed.update(hashes)
        replica.sent(time.monotonic())
        self.metrics.decided(decision, len(token_ids) if token_ids else 0, block_size, time.perf_counter() - started)
        return Ticket(replica, decision, hashes, uncached, attention)

    def _step_costs(self, candidates: list[Replica]) -> list[tuple[float, ...]]:
        """Each candidate's step-time model, pooled per kind of replica (scoring.pool_step_costs),
        computed again only when a load report or replica info changed (~10 times a second,
        not per request: pooling costs ~15 us)."""
        key = [(r.name, r.load, r.info) for r in candidates]
        old = self._costs_key
        if len(key) != len(old) or any(a[0] != b[0] or a[1] is not b[1] or a[2] is not b[2] for a, b in zip(key, old)):
            views = [
                ReplicaView(r.name, step_cost=tuple(r.load.step_cost), step_cost_fitted=True)
                if r.load.step_cost_fitted
                else ReplicaView(r.name)
                for r in candidates
            ]
            kinds = [
                (r.info.model_name, r.info.dtype, r.info.attention_backend) if r.info else r.name for r in candidates
            ]
            pool_step_costs(views, kinds)
            self._costs_key, self._costs = key, [v.step_cost for v in views]  # the key holds the objects it names
        return self._costs

    @staticmethod
    def _view(r: Replica, hashes: list[bytes], step_cost: tuple[float, ...]) -> ReplicaView:
        load = r.load
        return ReplicaView(
            name=r.name,
            matched_blocks=matched_prefix(hashes, r.index, r.routed),
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            kv_cache_usage=load.kv_cache_usage,
            pending_prefill_tokens=load.pending_prefill_tokens,
            pending_prefill_attention=load.pending_prefill_attention,
            router_pending_tokens=r.pending_tokens,
            router_pending_attention=r.pending_attention,
            router_in_flight=r.in_flight,
            num_decoding=load.num_decoding,
            decode_context_tokens=load.decode_context_tokens,
            recent_requests=r.recent_requests(time.monotonic()),
            token_budget=load.token_budget or 2048,
            step_cost=step_cost,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
