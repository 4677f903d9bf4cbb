"""Executes step plans: validation, swaps, one forward pass over the flat batch, sampling.

The runner keeps only what the plan's delta encoding needs per sequence — sampling
parameters, block table, computed-token cursor and the token it sampled last — and never
allocates blocks or reorders sequences: the scheduler decides. A plan comes from the
network, so it is checked whole before anything happens: `validate` reads the state and
returns what the step needs, `_apply` then commits it, and only then are blocks copied and
the model run. A refused plan (PlanError -> INVALID_ARGUMENT) changes nothing: no sequence
registered or dropped, no cursor moved, no KV byte copied; its finished ids and swaps
included, it did not happen.

The rules: new sequences are unknown (after this plan's finished ids), once each, with valid
sampling parameters (SamplingSpec's ranges, at most MAX_NUM_LOGPROBS) and an entry; entries
name known sequences once each, match their cursor, compute >= 1 token, stay below
max_model_len, bring token ids inside the vocabulary (or decode the token sampled last) and
in-range block ids, never one twice in a table, enough for their tokens; the tokens fit the
budget; copies stay in range, with distinct destinations.

Block ownership. `holders[b]` counts the live sequences whose block table holds device
block b. A sequence may *read* blocks others hold (a new sequence's leading prefix-cache
blocks, below its num_computed_tokens), but every block it *writes* this step must be held
by it alone, and a block appended to a running table or swapped in must be fresh. A
swap-out ends a sequence's claim on its blocks (the scheduler frees them; the sequence
comes back with replace_block_table); it is recognised as a sequence whose whole table is
swapped out. A sequence that only shares all its blocks with a swapped one loses its claim
too, and claims its table again with its next entry. Each step costs O(entries + blocks the
plan names), plus a pass over the live sequences in steps that swap out.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import torch
from chunkserve_kernels.forward_context import set_forward_context
from chunkserve_kernels.metadata import build_metadata

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.parallel import NO_TP, PlanChannel, TPInfo
from executor_svc.sampler import SamplingSpec, sample

# The scheduler never asks for more (scheduler_svc/validation.py MAX_LOGPROBS; a test keeps
# the two equal): anything larger is a bad plan, and would make the response vocab-sized.
MAX_NUM_LOGPROBS = 20


class PlanError(ValueError):
    """The plan contradicts the executor's state or limits (a scheduler bug or a bad client)."""


@dataclass(slots=True)
class SeqState:
    sampling: SamplingSpec
    block_table: list[int]
    # None until the first entry: a prefix-cache hit makes a new sequence start mid-prompt.
    num_computed_tokens: int | None = None
    last_token: int | None = None
    holds_blocks: bool = True  # counted in ModelRunner.holders (False after a swap-out)


@dataclass(slots=True)
class CheckedPlan:
    """What `validate` found: everything `_apply` and the forward pass need."""

    finished: set[int] = field(default_factory=set)  # known sequences to drop
    new: dict[int, SamplingSpec] = field(default_factory=dict)
    swapped_out: set[int] = field(default_factory=set)  # sequences whose claims end
    # Per entry: the replacing table (new sequence or replace_block_table), else None.
    tables: list[list[int] | None] = field(default_factory=list)
    holder_delta: dict[int, int] = field(default_factory=dict)  # block -> change of holders
    token_ids: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    computed: list[int] = field(default_factory=list)
    sampling: list[tuple[int, int]] = field(default_factory=list)  # (entry index, sampled position)


def spec_from_proto(p: epb.SamplingParams) -> SamplingSpec:
    """SamplingSpec of a NewSequence; ValueError on a parameter the sampler cannot honour."""
    spec = SamplingSpec(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        seed=p.seed if p.has_seed else None,
        num_logprobs=p.num_logprobs,
    )
    if spec.num_logprobs > MAX_NUM_LOGPROBS:
        raise ValueError(f"num_logprobs must be at most {MAX_NUM_LOGPROBS}, got {spec.num_logprobs}")
    return spec


def _at(step: int, seq_id: int) -> str:
    return f"step {step}, sequence {seq_id}"


def _count(delta: dict[int, int], blocks, sign: int) -> None:
    for b in blocks:
        delta[b] = delta.get(b, 0) + sign


class ModelRunner:
    """Owns the model, the paged KV cache and per-sequence execution state."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        host_cache: torch.Tensor | None,
        vocab_size: int,
        max_num_batched_tokens: int,
        max_model_len: int | None = None,
        tp: TPInfo = NO_TP,
        channel: PlanChannel | None = None,
        reserved_blocks: int = 0,
    ) -> None:
        """Under tensor parallelism (`tp`, executor_svc/parallel.py) every rank runs the same
        plans on its shard; rank 0 samples and shares the token ids over `channel`. The last
        `reserved_blocks` blocks of `kv_cache` are the executor's own (the CUDA graphs'
        scratch block): no plan may name them."""
        self.model = model
        self.tp = tp
        self.channel = channel
        self.kv_cache = kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        self.host_cache = host_cache  # same shape with host blocks, or None
        self.block_size = kv_cache.shape[3]
        self.num_blocks = kv_cache.shape[2] - reserved_blocks
        self.num_host_blocks = 0 if host_cache is None else host_cache.shape[2]
        self.vocab_size = vocab_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len if max_model_len is not None else getattr(model, "max_model_len", math.inf)
        self.device = kv_cache.device
        self.seqs: dict[int, SeqState] = {}
        self.holders = [0] * self.num_blocks
        # Decode-only steps of up to its largest bucket run through it (executor_svc/cuda_graphs.py).
        self.graphs: DecodeGraphs | None = None

    def reset(self) -> None:
        self.seqs.clear()
        self.holders = [0] * self.num_blocks

    @torch.inference_mode()
    def execute(self, plan: epb.StepRequest) -> epb.StepResponse:
        start, start_unix = time.perf_counter_ns(), time.time_ns()
        checked = self.validate(plan)
        self._apply(plan, checked)
        validated = time.perf_counter_ns()
        self._swap(plan)
        swapped = time.perf_counter_ns()
        response = epb.StepResponse(step_id=plan.step_id, swap_ns=swapped - validated, start_unix_ns=start_unix)
        if not plan.seqs:
            response.execute_ns = time.perf_counter_ns() - start
            return response

        states = [self.seqs[s.seq_id] for s in plan.seqs]
        query_lens = checked.query_lens
        graphs = self.graphs
        if graphs is not None and len(query_lens) == len(checked.token_ids) and graphs.bucket(len(query_lens)):
            hidden = graphs.run(checked.token_ids, checked.computed, [st.block_table for st in states])
        else:
            meta, positions = build_metadata(
                query_lens, checked.computed, [st.block_table for st in states], self.block_size, self.device
            )
            input_ids = torch.tensor(checked.token_ids, dtype=torch.long, device=self.device)
            with set_forward_context(meta, self.kv_cache):
                hidden = self.model(input_ids, positions)
        forwarded = time.perf_counter_ns()

        if checked.sampling:
            if len(checked.sampling) == len(checked.token_ids):  # all decodes, all sample: every row, in order
                logits = self.model.compute_logits(hidden)
            else:
                ends = list(itertools.accumulate(query_lens))  # the last token of entry i is ends[i] - 1
                rows = torch.tensor([ends[i] - 1 for i, _ in checked.sampling], device=self.device)
                logits = self.model.compute_logits(hidden.index_select(0, rows))
            if self.tp.rank != 0:  # rank 0 samples; the others only need the token ids back
                tokens = self.channel.share_tokens(None, len(checked.sampling), self.tp.rank)
                for k, (i, _) in enumerate(checked.sampling):
                    states[i].last_token = tokens[k]
                return response
            specs = [states[i].sampling for i, _ in checked.sampling]
            out = sample(logits, specs, [pos for _, pos in checked.sampling])
            if self.tp.enabled:
                self.channel.share_tokens(out.token_ids, len(checked.sampling), 0)
            for k, (i, _) in enumerate(checked.sampling):
                states[i].last_token = out.token_ids[k]
                entry = response.sampled.add(seq_id=plan.seqs[i].seq_id, token_id=out.token_ids[k])
                if specs[k].num_logprobs >= 0:
                    entry.logprob = out.logprobs[k]
                    entry.top.extend(epb.TopLogprob(token_id=t, logprob=lp) for t, lp in out.top[k])
        done = time.perf_counter_ns()
        response.forward_ns = forwarded - swapped
        response.sample_ns = done - forwarded
        response.execute_ns = done - start
        response.num_tokens = len(checked.token_ids)
        return response

    def validate(self, plan: epb.StepRequest) -> CheckedPlan:
        """Checks the whole plan against the state as the plan leaves it; changes nothing.

        Raises PlanError naming the step, the sequence and the rule.
        """
        step, seqs, bs = plan.step_id, self.seqs, self.block_size
        c = CheckedPlan()
        delta = c.holder_delta
        for seq_id in plan.finished_seq_ids:  # unknown ids are fine: finishing is idempotent
            state = seqs.get(seq_id)
            if state is not None and seq_id not in c.finished:
                c.finished.add(seq_id)
                if state.holds_blocks:
                    _count(delta, state.block_table, -1)
        for new in plan.new_seqs:
            if new.seq_id in c.new or (new.seq_id in seqs and new.seq_id not in c.finished):
                raise PlanError(f"step {step}: sequence {new.seq_id} is already known")
            try:
                c.new[new.seq_id] = spec_from_proto(new.sampling)
            except ValueError as exc:
                raise PlanError(f"step {step}, new sequence {new.seq_id}: {exc}") from None
        swap_in_dst = self._check_swaps(plan, c)

        holders, num_blocks = self.holders, self.num_blocks
        budget, total, num_new_entries = self.max_num_batched_tokens, 0, 0
        seen: set[int] = set()
        writes: list[tuple[int, int, int, list[int]]] = []  # seq id, first and last written block index, table
        replaced: set[int] = set()  # blocks of the tables replace_block_table installs
        for i, s in enumerate(plan.seqs):
            seq_id, computed, n = s.seq_id, s.num_computed_tokens, s.num_new_tokens
            if seq_id in seen:
                raise PlanError(f"{_at(step, seq_id)}: appears twice")
            seen.add(seq_id)
            is_new = seq_id in c.new
            state = None if is_new else seqs.get(seq_id)
            if not is_new and (state is None or seq_id in c.finished):
                raise PlanError(f"{_at(step, seq_id)}: unknown sequence (never sent as new, or finished)")
            num_new_entries += is_new
            if state is not None and state.num_computed_tokens is not None and computed != state.num_computed_tokens:
                raise PlanError(
                    f"{_at(step, seq_id)}: plan says {computed} computed tokens, executor has "
                    f"{state.num_computed_tokens}"
                )
            if n < 1:
                raise PlanError(f"{_at(step, seq_id)}: num_new_tokens must be >= 1")
            total += n
            if total > budget:
                raise PlanError(f"step {step}: more than the executor's max_num_batched_tokens {budget} tokens")
            end = computed + n
            if end > self.max_model_len:
                raise PlanError(
                    f"{_at(step, seq_id)}: positions up to {end - 1} exceed max_model_len {self.max_model_len}"
                )
            tokens = s.token_ids
            if tokens:
                if len(tokens) != n:
                    raise PlanError(f"{_at(step, seq_id)}: {len(tokens)} token ids for {n} new tokens")
                if max(tokens) >= self.vocab_size:
                    raise PlanError(f"{_at(step, seq_id)}: token id {max(tokens)} >= vocab size {self.vocab_size}")
                c.token_ids.extend(tokens)
            elif n == 1 and state is not None and state.last_token is not None:
                c.token_ids.append(state.last_token)
            else:
                raise PlanError(f"{_at(step, seq_id)}: no token ids and no sampled token to feed back")

            blocks = s.block_ids
            if blocks and max(blocks) >= num_blocks:
                raise PlanError(f"{_at(step, seq_id)}: block id {max(blocks)} >= {num_blocks} device blocks")
            claimed = state is not None and state.holds_blocks and seq_id not in c.swapped_out
            if is_new or s.replace_block_table:
                table = list(blocks)
                if len(set(table)) != len(table):
                    raise PlanError(f"{_at(step, seq_id)}: a block id appears twice in the block table")
                if claimed:
                    _count(delta, state.block_table, -1)
                _count(delta, table, 1)
                if not is_new:
                    replaced.update(table)
                c.tables.append(table)
            else:
                old = state.block_table
                if not claimed:  # its blocks were swapped out and it continues: claim them again
                    _count(delta, old, 1)
                for b in blocks:  # appended blocks are fresh: nobody holds them, not even twice
                    if holders[b] + delta.get(b, 0):
                        raise PlanError(f"{_at(step, seq_id)}: appends block {b}, which a sequence already holds")
                    delta[b] = delta.get(b, 0) + 1
                table = old + list(blocks) if blocks else old
                c.tables.append(None)
            if len(table) * bs < end:
                raise PlanError(f"{_at(step, seq_id)}: {len(table)} blocks cannot hold {end} tokens")
            writes.append((seq_id, computed // bs, (end - 1) // bs, table))
            c.query_lens.append(n)
            c.computed.append(computed)
            if s.sample:
                c.sampling.append((i, end))

        if num_new_entries != len(c.new):
            missing = sorted(c.new.keys() - seen)[0]
            raise PlanError(f"step {step}: new sequence {missing} has no entry in the plan")
        for seq_id, first, last, table in writes:
            for k in range(first, last + 1):
                if holders[table[k]] + delta.get(table[k], 0) != 1:
                    raise PlanError(
                        f"{_at(step, seq_id)}: writes into block {table[k]}, which another "
                        "sequence holds (or its own table holds twice)"
                    )
        for dst in swap_in_dst:
            if dst not in replaced or holders[dst] + delta.get(dst, 0) != 1:
                raise PlanError(
                    f"step {step}: swap-in destination {dst} is not a block of a table this "
                    "plan installs (replace_block_table), held by that sequence alone"
                )
        return c

    def _check_swaps(self, plan: epb.StepRequest, c: CheckedPlan) -> set[int]:
        """Checks the block copies and ends the claims of swapped-out sequences (in `c`);
        returns the swap-in destinations, checked against the tables once the entries are."""
        if not plan.swap_out and not plan.swap_in:
            return set()
        step = plan.step_id
        if self.host_cache is None:
            raise PlanError(f"step {step}: swap requested but the executor has no swap space")
        sources: set[int] = set()
        for kind, copies, src_limit, dst_limit in (
            ("swap-out", plan.swap_out, self.num_blocks, self.num_host_blocks),
            ("swap-in", plan.swap_in, self.num_host_blocks, self.num_blocks),
        ):
            destinations: set[int] = set()
            for copy in copies:
                if copy.src >= src_limit or copy.dst >= dst_limit:
                    raise PlanError(
                        f"step {step}: {kind} {copy.src} -> {copy.dst} out of range "
                        f"(source blocks {src_limit}, destination blocks {dst_limit})"
                    )
                if copy.dst in destinations:
                    raise PlanError(f"step {step}: {kind} destination {copy.dst} appears twice")
                destinations.add(copy.dst)
                if kind == "swap-out":
                    sources.add(copy.src)
        if sources:
            for seq_id, state in self.seqs.items():
                table = state.block_table
                if (
                    state.holds_blocks
                    and table
                    and table[-1] in sources
                    and seq_id not in c.finished
                    and sources.issuperset(table)
                ):
                    c.swapped_out.add(seq_id)
                    _count(c.holder_delta, table, -1)
        return destinations

    def _apply(self, plan: epb.StepRequest, c: CheckedPlan) -> None:
        """Commits a validated plan's state changes (before its copies and forward pass)."""
        seqs = self.seqs
        for seq_id in c.finished:
            del seqs[seq_id]
        for seq_id, spec in c.new.items():
            seqs[seq_id] = SeqState(spec, [])
        for seq_id in c.swapped_out:
            seqs[seq_id].holds_blocks = False
        for s, table in zip(plan.seqs, c.tables):
            state = seqs[s.seq_id]
            if table is not None:
                state.block_table = table
            elif s.block_ids:
                state.block_table.extend(s.block_ids)
            state.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
            state.holds_blocks = True
        holders = self.holders
        for b, d in c.holder_delta.items():
            holders[b] += d

    def _swap(self, plan: epb.StepRequest) -> None:
        """Block copies between device and host, swap-outs first (docs/architecture.md); validated already."""
        if not plan.swap_out and not plan.swap_in:
            return
        for copy in plan.swap_out:
            self.host_cache[:, :, copy.dst].copy_(self.kv_cache[:, :, copy.src], non_blocking=True)
        for copy in plan.swap_in:
            self.kv_cache[:, :, copy.dst].copy_(self.host_cache[:, :, copy.src], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
