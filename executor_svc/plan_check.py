"""The plan contract: a step plan comes from the network, so it is checked whole before anything
happens. `check_plan` reads the runner's state and returns what the step needs; the runner
then commits it (runner.py `_apply`), and only then are blocks copied and the model run. A
refused plan (PlanError -> INVALID_ARGUMENT) changes nothing: no sequence registered or
dropped, no cursor moved, no KV byte copied; its finished ids and swaps included, it did not
happen.

The rules: new sequences are unknown (after this plan's finished ids), once each, with valid
sampling parameters (sequence_spec.py: SamplingSpec's ranges, a bounded number of logprobs,
logit bias, allowed tokens and bad words of the vocabulary), their token ids when and only
when they have a penalty or bad words, and an entry; entries name known sequences once each, match their cursor, compute >= 1 token, stay below
max_model_len, bring token ids inside the vocabulary (or decode the token sampled last) and
in-range block ids, never one twice in a table, enough for their tokens; the tokens fit the
budget; copies stay in range, with distinct destinations; draft tokens (speculative
decoding) follow a chunk that samples, inside the vocabulary, and every row from the last
known token on samples; token masks (structured output) are rows of ceil(vocab / 32) words
at increasing positions that sample (the entry's last, and its drafts'), allow some token
and no id past the vocabulary; a multi-step plan (num_steps > 1) has only entries that sample,
without drafts, masks or prompt logprob rows, and its tables, the claims on the blocks it
writes and max_model_len cover the num_steps - 1 decodes after it as well (so none of those
steps can be refused once the first ran).

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

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from executor_svc.penalties import TokenHistory
from executor_svc.sampler import SamplingSpec
from executor_svc.sequence_spec import check_token_ids, spec_from_proto


class PlanError(ValueError):
    """The plan contradicts the executor's state or limits (a scheduler bug or a bad client)."""


@dataclass(slots=True)
class SeqState:
    sampling: SamplingSpec
    block_table: list[int]
    # None until the first entry: a prefix-cache hit makes a new sequence start mid-prompt.
    num_computed_tokens: int | None = None
    last_token: int | None = None
    holds_blocks: bool = True  # counted in the runner's holders (False after a swap-out)
    history: TokenHistory | None = None  # what the penalties read (penalties.py); None without one


class ExecutorState(Protocol):
    """What the check reads (the ModelRunner's state and limits)."""

    seqs: dict[int, SeqState]
    holders: list[int]
    num_blocks: int
    num_host_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_model_len: float
    vocab_size: int


@dataclass(slots=True)
class CheckedPlan:
    """What `check_plan` found: everything the runner's `_apply` and the forward pass need."""

    finished: set[int] = field(default_factory=set)  # known sequences to drop
    new: dict[int, SamplingSpec] = field(default_factory=dict)
    # New sequences with a penalty or bad words: (prompt token ids, output token ids so far).
    histories: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    swapped_out: set[int] = field(default_factory=set)  # sequences whose claims end
    # Per entry: the replacing table (new sequence or replace_block_table), else None.
    tables: list[list[int] | None] = field(default_factory=list)
    holder_delta: dict[int, int] = field(default_factory=dict)  # block -> change of holders
    token_ids: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    computed: list[int] = field(default_factory=list)
    # One per row that samples, in batch order: (entry index, position the sampled token takes).
    sampling: list[tuple[int, int]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # the flat batch row of each `sampling` item
    masks: dict[int, bytes] = field(default_factory=dict)  # index into `sampling` -> packed allowed tokens
    drafts: dict[int, list[int]] = field(default_factory=dict)  # entry index -> its draft tokens (verify)
    # Prompt logprobs: (sequence, its flat batch rows, the token each row's logprob is of, that
    # token's position for the first row).
    prompt_rows: list[tuple[int, list[int], list[int], int]] = field(default_factory=list)


@dataclass(slots=True)
class _EntryPass:
    """Running totals of the pass over a plan's entries."""

    more: int = 0  # decodes after the plan's step (multi-step plan: num_steps - 1)
    total: int = 0  # tokens so far
    num_new_entries: int = 0
    seen: set[int] = field(default_factory=set)
    writes: list[tuple[int, int, int, list[int]]] = field(default_factory=list)  # seq, first/last block written, table
    replaced: set[int] = field(default_factory=set)  # blocks of the tables replace_block_table installs


def _at(step: int, seq_id: int) -> str:
    return f"step {step}, sequence {seq_id}"


def _count(delta: dict[int, int], blocks: Iterable[int], sign: int) -> None:
    for b in blocks:
        delta[b] = delta.get(b, 0) + sign


def check_plan(plan: epb.StepRequest, st: ExecutorState) -> CheckedPlan:
    """Checks the whole plan against the state as the plan leaves it; changes nothing.

    Raises PlanError naming the step, the sequence and the rule.
    """
    c = CheckedPlan()
    _check_finished_and_new(plan, st, c)
    swap_in_dst = _check_swaps(plan, st, c)
    entries = _EntryPass(more=max(plan.num_steps, 1) - 1)
    for i, s in enumerate(plan.seqs):
        _check_entry(plan.step_id, i, s, st, c, entries)
    _check_claims(plan, st, c, entries, swap_in_dst)
    return c


def _check_finished_and_new(plan: epb.StepRequest, st: ExecutorState, c: CheckedPlan) -> None:
    step, seqs = plan.step_id, st.seqs
    for seq_id in plan.finished_seq_ids:  # unknown ids are fine: finishing is idempotent
        state = seqs.get(seq_id)
        if state is not None and seq_id not in c.finished:
            c.finished.add(seq_id)
            if state.holds_blocks:
                _count(c.holder_delta, state.block_table, -1)
    for new in plan.new_seqs:
        if new.seq_id in c.new or (new.seq_id in seqs and new.seq_id not in c.finished):
            raise PlanError(f"step {step}: sequence {new.seq_id} is already known")
        try:
            c.new[new.seq_id] = spec = spec_from_proto(new.sampling)
            c.histories.update(check_token_ids(new, spec, st.vocab_size))
        except ValueError as exc:
            raise PlanError(f"step {step}, new sequence {new.seq_id}: {exc}") from None


def _check_entry(step: int, i: int, s: epb.ScheduledSequence, st: ExecutorState, c: CheckedPlan, e: _EntryPass) -> None:
    """One entry: its sequence, cursor, token count and ids, then its blocks."""
    seq_id, computed, n = s.seq_id, s.num_computed_tokens, s.num_new_tokens
    if seq_id in e.seen:
        raise PlanError(f"{_at(step, seq_id)}: appears twice")
    e.seen.add(seq_id)
    is_new = seq_id in c.new
    state = None if is_new else st.seqs.get(seq_id)
    if not is_new and (state is None or seq_id in c.finished):
        raise PlanError(f"{_at(step, seq_id)}: unknown sequence (never sent as new, or finished)")
    e.num_new_entries += is_new
    if state is not None and state.num_computed_tokens is not None and computed != state.num_computed_tokens:
        raise PlanError(
            f"{_at(step, seq_id)}: plan says {computed} computed tokens, executor has {state.num_computed_tokens}"
        )
    if n < 1:
        raise PlanError(f"{_at(step, seq_id)}: num_new_tokens must be >= 1")
    e.total += n
    if e.total > st.max_num_batched_tokens:
        raise PlanError(
            f"step {step}: more than the executor's max_num_batched_tokens {st.max_num_batched_tokens} tokens"
        )
    end = computed + n
    if e.more and (not s.sample or s.draft_token_ids or s.token_masks or s.prompt_logprob_rows):
        raise PlanError(
            f"{_at(step, seq_id)}: a multi-step plan takes only entries that sample, without draft "
            "tokens, token masks or prompt logprob rows"
        )
    last = end + e.more  # the multi-step decodes' positions too
    if last > st.max_model_len:
        raise PlanError(f"{_at(step, seq_id)}: positions up to {last - 1} exceed max_model_len {st.max_model_len}")
    tokens, draft = s.token_ids, s.draft_token_ids
    known = n - len(draft)  # the chunk's tokens before its drafts
    if draft and (not s.sample or known < 1):
        raise PlanError(f"{_at(step, seq_id)}: {len(draft)} draft tokens need a chunk that samples before them")
    if tokens:
        if len(tokens) != known:
            raise PlanError(f"{_at(step, seq_id)}: {len(tokens)} token ids for {known} new tokens")
        if max(tokens) >= st.vocab_size:
            raise PlanError(f"{_at(step, seq_id)}: token id {max(tokens)} >= vocab size {st.vocab_size}")
        c.token_ids.extend(tokens)
    elif known == 1 and state is not None and state.last_token is not None:
        c.token_ids.append(state.last_token)
    else:
        raise PlanError(f"{_at(step, seq_id)}: no token ids and no sampled token to feed back")
    if draft:
        if max(draft) >= st.vocab_size:
            raise PlanError(f"{_at(step, seq_id)}: draft token id {max(draft)} >= vocab size {st.vocab_size}")
        c.token_ids.extend(draft)
        c.drafts[i] = list(draft)
    table = _check_blocks(step, s, state, is_new, st, c, e)
    if len(table) * st.block_size < last:
        raise PlanError(f"{_at(step, seq_id)}: {len(table)} blocks cannot hold {last} tokens")
    e.writes.append((seq_id, computed // st.block_size, (last - 1) // st.block_size, table))
    c.query_lens.append(n)
    c.computed.append(computed)
    if s.sample:  # the last known token's row, then one row per draft
        first = len(c.sampling)
        for j in range(len(draft) + 1):
            c.sampling.append((i, end - len(draft) + j))
            c.rows.append(e.total - 1 - len(draft) + j)
        for offset, bits in _check_masks(step, s, st.vocab_size):
            c.masks[first + offset - (n - 1 - len(draft))] = bits
    elif s.token_masks:
        raise PlanError(f"{_at(step, seq_id)}: token masks on an entry that does not sample")
    if s.prompt_logprob_rows:
        spec = c.new[seq_id] if is_new else state.sampling
        _check_prompt_rows(step, s, spec, e.total - n, st.vocab_size, c)


def _check_prompt_rows(
    step: int, s: epb.ScheduledSequence, spec: SamplingSpec, row0: int, vocab_size: int, c: CheckedPlan
) -> None:
    """Prompt logprob rows: a sequence that asked for them, rows inside a chunk of known
    tokens, and the token after the chunk when its last row is one of them."""
    first, count, n = s.prompt_logprob_first, s.prompt_logprob_rows, s.num_new_tokens
    at = _at(step, s.seq_id)
    if spec.num_prompt_logprobs < 0:
        raise PlanError(f"{at}: prompt logprob rows for a sequence without num_prompt_logprobs")
    if s.draft_token_ids or not s.token_ids or first + count > n:
        raise PlanError(f"{at}: prompt logprob rows {first}..{first + count - 1} are not rows of its chunk of tokens")
    targets = list(s.token_ids[first + 1 : first + count + 1])
    if len(targets) < count:
        if not s.HasField("next_token_id") or s.next_token_id >= vocab_size:
            raise PlanError(f"{at}: its last row's prompt logprob needs next_token_id inside the vocabulary")
        targets.append(s.next_token_id)
    rows = list(range(row0 + first, row0 + first + count))
    c.prompt_rows.append((s.seq_id, rows, targets, s.num_computed_tokens + first + 1))


def _check_masks(step: int, s: epb.ScheduledSequence, vocab_size: int) -> list[tuple[int, bytes]]:
    """An entry's token masks as (position in the chunk, bits): at most one row per position
    that samples (the last known token's and each draft's), by increasing position."""
    where = _at(step, s.seq_id)
    sampled = range(s.num_new_tokens - 1 - len(s.draft_token_ids), s.num_new_tokens)
    positions = [m.position for m in s.token_masks]
    if any(p not in sampled for p in positions) or positions != sorted(set(positions)):
        raise PlanError(
            f"{where}: token mask positions {positions}; the positions that sample are "
            f"{sampled.start}..{sampled.stop - 1}, each at most once, increasing"
        )
    words = (vocab_size + 31) // 32
    for m in s.token_masks:
        bits = m.bits
        if len(bits) != 4 * words:
            raise PlanError(f"{where}: token mask of {len(bits)} bytes; vocab size {vocab_size} needs {4 * words}")
        if bits.count(0) == len(bits):
            raise PlanError(f"{where}: token mask allows no token")
        if vocab_size % 32 and int.from_bytes(bits[-4:], "little") >> (vocab_size % 32):
            raise PlanError(f"{where}: token mask allows ids at or past vocab size {vocab_size}")
    return [(m.position, m.bits) for m in s.token_masks]


def _check_blocks(
    step: int,
    s: epb.ScheduledSequence,
    state: SeqState | None,
    is_new: bool,
    st: ExecutorState,
    c: CheckedPlan,
    e: _EntryPass,
) -> list[int]:
    """An entry's block ids: in range; a new or replaced table without repeats, appended blocks
    fresh. Records the change of holders; returns the table the entry computes with."""
    seq_id, blocks, delta = s.seq_id, s.block_ids, c.holder_delta
    if blocks and max(blocks) >= st.num_blocks:
        raise PlanError(f"{_at(step, seq_id)}: block id {max(blocks)} >= {st.num_blocks} device blocks")
    claimed = state is not None and state.holds_blocks and seq_id not in c.swapped_out
    if is_new or s.replace_block_table:
        table = list(blocks)
        if len(set(table)) != len(table):
            raise PlanError(f"{_at(step, seq_id)}: a block id appears twice in the block table")
        if claimed:
            _count(delta, state.block_table, -1)
        _count(delta, table, 1)
        if not is_new:
            e.replaced.update(table)
        c.tables.append(table)
        return table
    old = state.block_table
    if not claimed:  # its blocks were swapped out and it continues: claim them again
        _count(delta, old, 1)
    for b in blocks:  # appended blocks are fresh: nobody holds them, not even twice
        if st.holders[b] + delta.get(b, 0):
            raise PlanError(f"{_at(step, seq_id)}: appends block {b}, which a sequence already holds")
        delta[b] = delta.get(b, 0) + 1
    c.tables.append(None)
    return old + list(blocks) if blocks else old


def _check_claims(
    plan: epb.StepRequest, st: ExecutorState, c: CheckedPlan, e: _EntryPass, swap_in_dst: set[int]
) -> None:
    """After every entry: each new sequence had one, every written block is held by its
    writer alone, every swap-in lands in a table this plan installs."""
    step, holders, delta = plan.step_id, st.holders, c.holder_delta
    if e.num_new_entries != len(c.new):
        missing = sorted(c.new.keys() - e.seen)[0]
        raise PlanError(f"step {step}: new sequence {missing} has no entry in the plan")
    for seq_id, first, last, table in e.writes:
        for k in range(first, last + 1):
            if holders[table[k]] + delta.get(table[k], 0) != 1:
                raise PlanError(
                    f"{_at(step, seq_id)}: writes into block {table[k]}, which another "
                    "sequence holds (or its own table holds twice)"
                )
    for dst in swap_in_dst:
        if dst not in e.replaced or holders[dst] + delta.get(dst, 0) != 1:
            raise PlanError(
                f"step {step}: swap-in destination {dst} is not a block of a table this "
                "plan installs (replace_block_table), held by that sequence alone"
            )


def _check_swaps(plan: epb.StepRequest, st: ExecutorState, c: CheckedPlan) -> set[int]:
    """Checks the block copies and ends the claims of swapped-out sequences (in `c`);
    returns the swap-in destinations, checked against the tables once the entries are."""
    if not plan.swap_out and not plan.swap_in:
        return set()
    step = plan.step_id
    if not st.num_host_blocks:
        raise PlanError(f"step {step}: swap requested but the executor has no swap space")
    sources: set[int] = set()
    destinations: set[int] = set()
    for kind, copies, src_limit, dst_limit in (
        ("swap-out", plan.swap_out, st.num_blocks, st.num_host_blocks),
        ("swap-in", plan.swap_in, st.num_host_blocks, st.num_blocks),
    ):
        destinations = set()
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
        for seq_id, state in st.seqs.items():
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


def verify_as_decodes(checked: CheckedPlan, tables: list[list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """(query lengths, cached lengths, block tables) with each verify entry (one with drafts) cut
    into one decode row per token, all on its block table: row j attends to the cache up to
    its own position, which is causal attention over the chunk because every layer writes the
    step's K/V before it attends. So a verify step is a decode step of 1 + k rows per
    drafting sequence: each row is computed by the kernels plain decoding uses for that token
    (decode attention, which reads such a run's KV once; CUDA graphs' decode buckets; the
    CPU's fused layers where the plan gives that row count to them), so greedy equality
    rests on batch invariance, not on prefill and decode kernels agreeing. On the 2-core CPU
    it costs about what the varlen path costs (both 2-3x a fused 1-row decode at 1 + 3..8
    rows, docs/speculative.md)."""
    query_lens: list[int] = []
    computed: list[int] = []
    out: list[list[int]] = []
    for i, (n, start, table) in enumerate(zip(checked.query_lens, checked.computed, tables)):
        if i in checked.drafts:
            query_lens += [1] * n
            computed += range(start, start + n)
            out += [table] * n
        else:
            query_lens.append(n)
            computed.append(start)
            out.append(table)
    return query_lens, computed, out
