"""Executes step plans: the plan check, swaps, one forward pass over the flat batch, sampling.

The runner keeps only what the plan's delta encoding needs per sequence — sampling
parameters, block table, computed-token cursor and the token it sampled last — and never
allocates blocks or reorders sequences: the scheduler decides. Every plan is checked whole
first (plan_check.py, the contract), then committed (`_apply`), then its blocks are copied
and the model runs, so a refused plan changes nothing.
"""

from __future__ import annotations

import itertools
import math
import time

import torch
from chunkserve_kernels.forward_context import set_forward_context
from chunkserve_kernels.metadata import build_metadata

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.collectives import NO_TP, PlanChannel, TPInfo
from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.plan_check import CheckedPlan, SeqState, check_plan
from executor_svc.sampler import sample


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
        """Under tensor parallelism (`tp`, executor_svc/tp_group.py) every rank runs the same
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
            out = sample(logits, specs, [pos for _, pos in checked.sampling], checked.masks)
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
        """Checks the whole plan against this runner's state (plan_check.py); changes nothing."""
        return check_plan(plan, self)

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
