"""Executes step plans: swaps, one forward pass over the flat batch, sampling.

The runner keeps only what the plan's delta encoding needs per sequence — sampling
parameters, block table, computed-token cursor and the token it sampled last — and checks
every plan against that state, so a malformed plan is rejected (PlanError) instead of
computing garbage. It never allocates blocks or reorders sequences: the scheduler decides.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from chunkserve.executor.v1 import executor_pb2 as epb
from chunkserve_kernels.forward_context import set_forward_context
from chunkserve_kernels.metadata import build_metadata
from executor_svc.sampler import SamplingSpec, sample


class PlanError(ValueError):
    """The plan contradicts the executor's state or limits (a scheduler bug or a bad client)."""


@dataclass(slots=True)
class SeqState:
    sampling: SamplingSpec
    block_table: list[int]
    # None until the first entry: a prefix-cache hit makes a new sequence start mid-prompt.
    num_computed_tokens: int | None = None
    last_token: int | None = None


def spec_from_proto(p: epb.SamplingParams) -> SamplingSpec:
    return SamplingSpec(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                        seed=p.seed if p.has_seed else None, num_logprobs=p.num_logprobs)


class ModelRunner:
    """Owns the model, the paged KV cache and per-sequence execution state."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, host_cache: torch.Tensor | None,
                 vocab_size: int, max_num_batched_tokens: int) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        self.host_cache = host_cache  # same shape with host blocks, or None
        self.block_size = kv_cache.shape[3]
        self.num_blocks = kv_cache.shape[2]
        self.num_host_blocks = 0 if host_cache is None else host_cache.shape[2]
        self.vocab_size = vocab_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = kv_cache.device
        self.seqs: dict[int, SeqState] = {}

    def reset(self) -> None:
        self.seqs.clear()

    @torch.inference_mode()
    def execute(self, plan: epb.StepRequest) -> epb.StepResponse:
        start = time.perf_counter_ns()
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            if new.seq_id in self.seqs:
                raise PlanError(f"step {plan.step_id}: sequence {new.seq_id} is already known")
            self.seqs[new.seq_id] = SeqState(spec_from_proto(new.sampling), [])
        self._swap(plan)
        swapped = time.perf_counter_ns()
        response = epb.StepResponse(step_id=plan.step_id, swap_ns=swapped - start)
        if not plan.seqs:
            response.execute_ns = time.perf_counter_ns() - start
            return response

        token_ids, query_lens, computed, tables, sampling = self._collect(plan)
        meta, positions = build_metadata(query_lens, computed, tables, self.block_size, self.device)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        with set_forward_context(meta, self.kv_cache):
            hidden = self.model(input_ids, positions)
        forwarded = time.perf_counter_ns()

        if sampling:
            ends = list(itertools.accumulate(query_lens))  # the last token of entry i is ends[i] - 1
            rows = torch.tensor([ends[i] - 1 for i, _ in sampling], device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            specs = [self.seqs[plan.seqs[i].seq_id].sampling for i, _ in sampling]
            out = sample(logits, specs, [pos for _, pos in sampling])
            for k, (i, _) in enumerate(sampling):
                seq_id = plan.seqs[i].seq_id
                self.seqs[seq_id].last_token = out.token_ids[k]
                entry = response.sampled.add(seq_id=seq_id, token_id=out.token_ids[k])
                if specs[k].num_logprobs >= 0:
                    entry.logprob = out.logprobs[k]
                    entry.top.extend(epb.TopLogprob(token_id=t, logprob=lp) for t, lp in out.top[k])
        done = time.perf_counter_ns()
        response.forward_ns = forwarded - swapped
        response.sample_ns = done - forwarded
        response.execute_ns = done - start
        response.num_tokens = len(token_ids)
        return response

    def _collect(self, plan: epb.StepRequest
                 ) -> tuple[list[int], list[int], list[int], list[list[int]], list[tuple[int, int]]]:
        """Validates the plan's entries and gathers the batch's inputs; state changes only
        when the whole plan is valid.

        Returns flat token ids, query lengths, computed lengths, block tables and, for the
        entries that sample, (entry index, position of the token to be sampled).
        """
        token_ids: list[int] = []
        query_lens: list[int] = []
        computed: list[int] = []
        tables: list[list[int]] = []
        sampling: list[tuple[int, int]] = []
        if len({s.seq_id for s in plan.seqs}) != len(plan.seqs):
            raise PlanError(f"step {plan.step_id}: a sequence appears twice")
        for i, s in enumerate(plan.seqs):
            state = self.seqs.get(s.seq_id)
            where = f"step {plan.step_id}, sequence {s.seq_id}"
            if state is None:
                raise PlanError(f"{where}: unknown sequence (never sent as new, or finished)")
            if state.num_computed_tokens is not None and s.num_computed_tokens != state.num_computed_tokens:
                raise PlanError(f"{where}: plan says {s.num_computed_tokens} computed tokens, "
                                f"executor has {state.num_computed_tokens}")
            n = s.num_new_tokens
            if n < 1:
                raise PlanError(f"{where}: num_new_tokens must be >= 1")
            if s.token_ids:
                if len(s.token_ids) != n:
                    raise PlanError(f"{where}: {len(s.token_ids)} token ids for {n} new tokens")
                if max(s.token_ids) >= self.vocab_size:
                    raise PlanError(f"{where}: token id {max(s.token_ids)} >= vocab size {self.vocab_size}")
                token_ids.extend(s.token_ids)
            elif n == 1 and state.last_token is not None:
                token_ids.append(state.last_token)
            else:
                raise PlanError(f"{where}: no token ids and no sampled token to feed back")
            if s.block_ids and max(s.block_ids) >= self.num_blocks:
                raise PlanError(f"{where}: block id {max(s.block_ids)} >= {self.num_blocks} device blocks")
            table = list(s.block_ids) if s.replace_block_table else state.block_table + list(s.block_ids)
            if len(table) * self.block_size < s.num_computed_tokens + n:
                raise PlanError(f"{where}: {len(table)} blocks cannot hold {s.num_computed_tokens + n} tokens")
            query_lens.append(n)
            computed.append(s.num_computed_tokens)
            tables.append(table)
            if s.sample:
                sampling.append((i, s.num_computed_tokens + n))
        if len(token_ids) > self.max_num_batched_tokens:
            raise PlanError(f"step {plan.step_id}: {len(token_ids)} tokens exceed the executor's "
                            f"max_num_batched_tokens {self.max_num_batched_tokens}")
        # Only a plan that passed every check changes state.
        for s, table in zip(plan.seqs, tables):
            state = self.seqs[s.seq_id]
            state.block_table = table
            state.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
        return token_ids, query_lens, computed, tables, sampling

    def _swap(self, plan: epb.StepRequest) -> None:
        """Block copies between device and host, swap-outs first (DESIGN.md)."""
        if not plan.swap_out and not plan.swap_in:
            return
        if self.host_cache is None:
            raise PlanError(f"step {plan.step_id}: swap requested but the executor has no swap space")
        for copy in plan.swap_out:
            self._check_block(copy.src, self.num_blocks, "device")
            self._check_block(copy.dst, self.num_host_blocks, "host")
            self.host_cache[:, :, copy.dst].copy_(self.kv_cache[:, :, copy.src], non_blocking=True)
        for copy in plan.swap_in:
            self._check_block(copy.src, self.num_host_blocks, "host")
            self._check_block(copy.dst, self.num_blocks, "device")
            self.kv_cache[:, :, copy.dst].copy_(self.host_cache[:, :, copy.src], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @staticmethod
    def _check_block(block: int, limit: int, kind: str) -> None:
        if block >= limit:
            raise PlanError(f"{kind} block id {block} out of range (have {limit})")
