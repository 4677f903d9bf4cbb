"""Executes step plans: the plan check, swaps, one forward pass over the flat batch, sampling.

The runner keeps only what the plan's delta encoding needs per sequence — sampling
parameters, block table, computed-token cursor and the token it sampled last — and never
allocates blocks or reorders sequences: the scheduler decides. Every plan is checked whole
first (plan_check.py, the contract), then committed (`_apply`), then its blocks are copied
and the model runs, so a refused plan changes nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_kernels.forward_context import set_forward_context
from chunkserve_kernels.metadata import build_metadata
from executor_svc.collectives import NO_TP, PlanChannel, TPInfo
from executor_svc.cuda_graphs import DecodeGraphs
from executor_svc.models.fused import GreedyDecodes
from executor_svc.penalties import TokenHistory
from executor_svc.plan_check import CheckedPlan, SeqState, check_plan, verify_as_decodes
from executor_svc.sampler import SampleOutput, sample
from executor_svc.threads import ThreadGovernor

PROMPT_LOGPROB_SLICE = 128  # rows of prompt logprobs through the head at a time
Emit = Callable[[epb.StepResponse], None]  # takes a streamed plan's steps before its last (`execute`)


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
        threads: ThreadGovernor | None = None,
    ) -> None:
        """Under tensor parallelism (`tp`, executor_svc/tp_group.py) every rank runs the same
        plans on its shard; rank 0 samples and shares the token ids over `channel`. The last
        `reserved_blocks` blocks of `kv_cache` are the executor's own (the CUDA graphs'
        scratch block): no plan may name them. `threads` moves the torch thread count by the
        steps' measured times (executor_svc/threads.py); None keeps it as it is."""
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
        self.threads = threads
        # CutSteps: the multi-step plan to end after the step under way (set by a gRPC thread,
        # `cut_steps`); `_cut` says the same to a fused greedy loop running that plan natively.
        self.cut_step_id: int | None = None
        self._cut = torch.zeros(1, dtype=torch.int32)
        self._running_step_id: int | None = None

    def reset(self) -> None:
        self.cut_step_id = None  # a new scheduler numbers its steps from 0 again
        self.seqs.clear()
        self.holders = [0] * self.num_blocks

    def cut_steps(self, step_id: int) -> None:
        """CutSteps: the multi-step plan `step_id` ends after the step under way (from a gRPC
        thread, while `execute` runs). The runner sets `_running_step_id` before it reads
        `cut_step_id`, and this sets `cut_step_id` before it reads `_running_step_id`, so a
        running fused loop (`_greedy_steps`) sees the cut whichever thread comes first."""
        self.cut_step_id = step_id
        if self._running_step_id == step_id:
            self._cut.fill_(1)

    def execute(self, plan: epb.StepRequest, emit: Emit | None = None) -> epb.StepResponse:
        """Runs one plan (each step with the thread count the governor gives its size,
        threads.py), and a multi-step plan's decodes after it (in the plan's first step's
        native call where that step is a fused greedy one, `_greedy_steps`). With `emit` (a
        streamed plan: StepRequest.stream_steps) each of those steps but the last is handed to
        emit as it ends, and the answer holds the last step's tokens (`_more_steps`)."""
        response = self._execute_timed(plan, 1 if emit is not None else plan.num_steps)
        if plan.num_steps > 1 and (not response.num_steps or emit is not None):
            return self._more_steps(plan, response, emit)
        response.num_steps = response.num_steps or 1
        return response

    def _execute_timed(self, plan: epb.StepRequest, native_steps: int = 1) -> epb.StepResponse:
        response = self._execute(plan, native_steps)
        response.num_threads = torch.get_num_threads()
        if self.threads is not None and response.num_tokens:
            steps = max(response.num_steps, 1)  # the governor takes steps, of this many tokens each
            self.threads.observe(response.num_tokens // steps, response.execute_ns / 1e9 / steps, time.monotonic())
        return response

    def _more_steps(self, plan: epb.StepRequest, first: epb.StepResponse, emit: Emit | None) -> epb.StepResponse:
        """The num_steps - 1 decodes after a multi-step plan's step (StepRequest.num_steps), each
        an ordinary plan of one decode per sequence that feeds back the token sampled last: the
        same computation, so the same tokens, as num_steps plans from the scheduler. The check
        of the first covered theirs (plan_check.py). Every TP rank derives the same plans. The
        answer holds each sequence's tokens together in step order, and the steps' summed times.
        CutSteps ends the plan after the step under way; never under tensor parallelism, whose
        ranks would have to agree on where. With `emit`, a step's answer goes to it once another
        step follows, and the plan's answer holds only the last step's tokens."""
        decode = epb.StepRequest(step_id=plan.step_id)
        for s in plan.seqs:
            decode.seqs.add(
                seq_id=s.seq_id,
                num_computed_tokens=s.num_computed_tokens + s.num_new_tokens - 1,
                num_new_tokens=1,
                sample=True,
            )
        steps = [first]
        for _ in range(plan.num_steps - 1):
            if self.cut_step_id == plan.step_id and not self.tp.enabled:
                break
            if emit is not None:
                emit(steps[-1])
            for s in decode.seqs:
                s.num_computed_tokens += 1
            steps.append(self._execute_timed(decode))
        out = epb.StepResponse(
            step_id=plan.step_id,
            start_unix_ns=first.start_unix_ns,
            num_threads=steps[-1].num_threads,
            num_steps=len(steps),
        )
        for r in steps:
            out.execute_ns += r.execute_ns
            out.swap_ns += r.swap_ns
            out.forward_ns += r.forward_ns
            out.sample_ns += r.sample_ns
            out.num_tokens += r.num_tokens
        if emit is not None:
            out.sampled.extend(steps[-1].sampled)
        elif first.sampled:  # rank 0: one token per sequence and step, in batch order
            for i in range(len(plan.seqs)):
                out.sampled.extend(r.sampled[i] for r in steps)
        return out

    @torch.inference_mode()
    def _execute(self, plan: epb.StepRequest, native_steps: int = 1) -> epb.StepResponse:
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

        if self.threads is not None:  # this step's size decides its thread count
            self.threads.prepare(len(checked.token_ids), time.monotonic())
        states = [self.seqs[s.seq_id] for s in plan.seqs]
        query_lens, computed, tables = checked.query_lens, checked.computed, [st.block_table for st in states]
        if checked.drafts:
            query_lens, computed, tables = verify_as_decodes(checked, tables)
        graphs = self.graphs
        if graphs is not None and len(query_lens) == len(checked.token_ids) and graphs.bucket(len(query_lens)):
            hidden = graphs.run(checked.token_ids, computed, tables)
        else:
            greedy = self._greedy_steps(plan, checked, tables, native_steps)
            if greedy is not None:
                return self._greedy_response(plan, greedy, response, start, swapped)
            meta, positions = build_metadata(query_lens, computed, tables, self.block_size, self.device)
            input_ids = torch.tensor(checked.token_ids, dtype=torch.long, device=self.device)
            with set_forward_context(meta, self.kv_cache):
                hidden = self.model(input_ids, positions)
        forwarded = time.perf_counter_ns()
        if checked.prompt_rows:  # every rank: the head is collective under tensor parallelism
            response.prompt_logprobs.extend(self._prompt_logprobs(hidden, checked))

        if checked.sampling:
            if len(checked.rows) == len(checked.token_ids):  # every row samples, in order
                logits = self.model.compute_logits(hidden)
            else:
                logits = self.model.compute_logits(
                    hidden.index_select(0, torch.tensor(checked.rows, device=self.device))
                )
            if self.tp.rank != 0:  # rank 0 samples; the others only need the token ids back
                tokens = self.channel.share_tokens(None, len(checked.sampling), self.tp.rank)
                self._accept(plan, checked, states, tokens, None, None)
                return response
            specs = [states[i].sampling for i, _ in checked.sampling]
            histories = _histories(checked, states)
            out = sample(logits, specs, [pos for _, pos in checked.sampling], checked.masks, histories)
            if self.tp.enabled:
                self.channel.share_tokens(out.token_ids, len(checked.sampling), 0)
            self._accept(plan, checked, states, out.token_ids, out, response)
        done = time.perf_counter_ns()
        response.forward_ns = forwarded - swapped
        response.sample_ns = done - forwarded
        response.execute_ns = done - start
        response.num_tokens = len(checked.token_ids)
        return response

    def _greedy_steps(
        self, plan: epb.StepRequest, checked: CheckedPlan, tables: list[list[int]], steps: int
    ) -> list[list[int]] | None:
        """Each step's greedy tokens ([steps][sequences]) where the plan is one decode per
        sequence, every row samples plainly greedy (no logprobs, masks, penalties, bias or
        allowed tokens) and the step runs fused: forward, head, argmax and a multi-step plan's
        decodes after it in one native call (`greedy_decode`, from the block tables and cursors
        alone), the tokens of step by step. Else None, nothing computed."""
        if checked.prompt_rows or checked.drafts or checked.masks or len(checked.rows) != len(checked.token_ids):
            return None
        seqs = self.seqs
        if any(n != 1 for n in checked.query_lens) or not all(seqs[s.seq_id].sampling.plain_greedy for s in plan.seqs):
            return None
        if getattr(self.model, "fused", None) is None or self.device.type != "cpu":  # no fused path at all
            return None
        batch = GreedyDecodes.of(checked.token_ids, checked.computed, tables, self.kv_cache)
        self._running_step_id = plan.step_id
        self._cut.fill_(int(self.cut_step_id == plan.step_id))
        try:
            tokens = self.model.greedy_decode(batch, max(steps, 1), self._cut)
        finally:
            self._running_step_id = None
        return None if tokens is None else tokens.tolist()

    def _greedy_response(
        self, plan: epb.StepRequest, tokens: list[list[int]], response: epb.StepResponse, start: int, swapped: int
    ) -> epb.StepResponse:
        """Keeps `_greedy_steps`' tokens as `_accept` and `_more_steps` keep theirs: cursors past
        the steps after the first, the last token fed to the next plan, the answer holding each
        sequence's tokens together in step order."""
        forwarded = time.perf_counter_ns()
        for i, s in enumerate(plan.seqs):
            state = self.seqs[s.seq_id]
            state.num_computed_tokens += len(tokens) - 1
            state.last_token = tokens[-1][i]
            response.sampled.extend(epb.SampledToken(seq_id=s.seq_id, token_id=step[i]) for step in tokens)
        done = time.perf_counter_ns()
        response.forward_ns, response.sample_ns, response.execute_ns = (
            forwarded - swapped,
            done - forwarded,
            done - start,
        )
        response.num_tokens, response.num_steps = len(plan.seqs) * len(tokens), len(tokens)
        return response

    @staticmethod
    def _accept(
        plan: epb.StepRequest,
        checked: CheckedPlan,
        states: list[SeqState],
        token_ids: list[int],
        out: SampleOutput | None,
        response: epb.StepResponse | None,
    ) -> None:
        """Keeps each entry's sampled tokens: one for a plain entry; for a verify entry (drafts)
        the longest prefix of drafts equal to what its rows sampled plus the token after it,
        moving the cursor back over the rejected drafts (their KV is overwritten later). Every
        TP rank runs this on the same ids, so every rank moves its cursor the same way.

        Greedy: row j's argmax is what plain decoding samples after the j accepted drafts, so
        the kept tokens are plain decoding's. Temperature > 0: a draft is a point mass, and
        accepting it iff the row's draw equals it is rejection sampling with acceptance
        min(1, p/q) = p(draft); a rejected row keeps its own draw, which is the residual's
        draw; each row's uniform is keyed by (seed, position) as in plain decoding, so a
        seeded request gets the very tokens it gets without drafts (docs/speculative.md)."""
        k = 0
        while k < len(checked.sampling):
            i = checked.sampling[k][0]
            draft = checked.drafts.get(i, ())
            accepted = 0
            while accepted < len(draft) and token_ids[k + accepted] == draft[accepted]:
                accepted += 1
            state = states[i]
            state.last_token = token_ids[k + accepted]
            state.num_computed_tokens -= len(draft) - accepted
            if state.history is not None:
                state.history.add(token_ids[k : k + accepted + 1])
            if response is not None:
                for j in range(k, k + accepted + 1):
                    entry = response.sampled.add(seq_id=plan.seqs[i].seq_id, token_id=token_ids[j])
                    if state.sampling.num_logprobs >= 0:
                        entry.logprob = out.logprobs[j]
                        entry.top.extend(epb.TopLogprob(token_id=t, logprob=lp) for t, lp in out.top[j])
            k += len(draft) + 1

    def _prompt_logprobs(self, hidden: torch.Tensor, checked: CheckedPlan) -> list[epb.PromptLogprob]:
        """The logprob of each prompt token a plan's prompt logprob rows name, from the model's
        raw distribution at the row before it, its rank and the sequence's top alternatives. Rows go
        through the head PROMPT_LOGPROB_SLICE at a time: a 2K-token chunk's whole [rows,
        vocabulary] logprobs would be ~400 MB at a 49K vocabulary."""
        items = [
            (seq_id, pos + j, row, token, self.seqs[seq_id].sampling.num_prompt_logprobs)
            for seq_id, rows, targets, pos in checked.prompt_rows
            for j, (row, token) in enumerate(zip(rows, targets))
        ]
        k = max(n for *_, n in items)
        out = []
        for start in range(0, len(items), PROMPT_LOGPROB_SLICE):
            part = items[start : start + PROMPT_LOGPROB_SLICE]
            index = torch.tensor([row for _, _, row, _, _ in part], device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, index))  # collective under TP
            if self.tp.rank != 0:  # rank 0 reports them
                continue
            lp = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor([token for *_, token, _ in part], device=self.device)
            chosen = lp.gather(1, targets[:, None])
            ranks = (lp > chosen).sum(dim=-1).add_(1).tolist()
            top_vals, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
            for (seq_id, position, _, token, n), logprob, rank, vals, ids in zip(
                part, chosen.squeeze(1).tolist(), ranks, top_vals.tolist(), top_ids.tolist()
            ):
                entry = epb.PromptLogprob(seq_id=seq_id, position=position, token_id=token, logprob=logprob, rank=rank)
                entry.top.extend(epb.TopLogprob(token_id=t, logprob=v) for t, v in zip(ids[:n], vals[:n]))
                out.append(entry)
        return out

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
            if seq_id in c.histories:
                seqs[seq_id].history = TokenHistory(*c.histories[seq_id])
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


def _histories(checked: CheckedPlan, states: list[SeqState]) -> dict[int, tuple[TokenHistory, list[int]]] | None:
    """Sampled row -> (its sequence's TokenHistory, drafts before it) for rows with a penalty
    or bad words: a verify entry's row j counts its first j drafts as output, the tokens plain
    decoding would hold at that row's position (penalties.py)."""
    rows: dict[int, tuple[TokenHistory, list[int]]] = {}
    first: dict[int, int] = {}  # entry -> position its first sampled row takes
    for row, (i, pos) in enumerate(checked.sampling):
        history = states[i].history
        if history is not None:
            start = first.setdefault(i, pos)
            rows[row] = (history, checked.drafts.get(i, [])[: pos - start])
    return rows or None
