"""Attention metadata for one step: the flash-attn varlen shape, shared by every backend.

A step is a flat batch of tokens from several sequences. Each sequence contributes
`query_len` new tokens (a prefill chunk, a recompute, or a single decode token) on top of
the tokens whose K/V is already in the paged cache. Positions and slots are derived here
from O(sequences) inputs, so the scheduler never ships per-token data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Everything a backend needs to run causal paged attention for one step.

    One sequence, seen by this step::

        |<------------------ context_len (seqused_k) ------------------>|
        |<----- already in the KV cache ----->|<------ query_len ------>|
        | t0  t1  ...                         | new tokens of this step |
                                               ^ written via slot_mapping

    The query is aligned to the END of its context: query token j (of q) sits at absolute
    position context_len - q + j and attends keys 0 .. context_len - q + j. A decode token
    is just query_len == 1.

    Device tensors follow the flash-attn varlen API so a GPU backend can pass them
    straight through; `query_lens` / `context_lens` are host copies so CPU backends can
    plan their work without a device sync (`.item()`/`.tolist()` on every layer).
    """

    cu_seqlens_q: torch.Tensor  # int32 [B+1]: token offsets of each sequence in the flat batch
    seqused_k: torch.Tensor  # int32 [B]: context length INCLUDING this step's new tokens
    block_table: torch.Tensor  # int32 [B, max_blocks]: physical block ids, padded with 0
    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset for each new token
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    query_lens: list[int]  # host copy of the per-sequence query lengths
    context_lens: list[int]  # host copy of seqused_k
    # Per-step tensors a backend derives once (on the first layer) and reuses for all
    # layers: gather indices, masks, buffers. Keyed by backend name.
    scratch: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def build_metadata(
    query_lens: list[int],
    context_lens_before: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Build the step's metadata and the absolute position of every new token.

    `context_lens_before[i]` is the sequence's num_computed_tokens (K/V already cached);
    `block_tables[i]` must cover its context after this step. Positions and slots are
    computed on the host (this runs every step: in lists for small steps, with vectorized
    torch ops for large ones, see SMALL_STEP_TOKENS), then moved to `device`.
    """
    num_seqs = len(query_lens)
    if num_seqs == 0:
        raise ValueError("build_metadata needs at least one sequence; skip empty steps")
    if len(context_lens_before) != num_seqs or len(block_tables) != num_seqs:
        raise ValueError(
            f"query_lens ({num_seqs}), context_lens_before ({len(context_lens_before)}) and "
            f"block_tables ({len(block_tables)}) must have one entry per sequence"
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    context_lens = [b + q for b, q in zip(context_lens_before, query_lens)]
    for i, (q, b, table) in enumerate(zip(query_lens, context_lens_before, block_tables)):
        if q <= 0 or b < 0:
            raise ValueError(f"sequence {i}: query_len must be >= 1 and context >= 0 (got {q}, {b})")
        if len(table) * block_size < b + q:
            raise ValueError(
                f"sequence {i}: {len(table)} blocks of {block_size} cannot hold {b + q} tokens; "
                "the block table must cover the context after this step"
            )

    max_blocks = max(len(t) for t in block_tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    if sum(query_lens) <= SMALL_STEP_TOKENS:
        cu_seqlens, block_table, positions, slot_mapping = _small_step(
            query_lens, context_lens_before, padded, block_size
        )
    else:
        cu_seqlens, block_table, positions, slot_mapping = _large_step(
            query_lens, context_lens_before, padded, block_size
        )

    meta = AttentionMetadata(
        cu_seqlens_q=cu_seqlens.to(device=device),
        seqused_k=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device=device),
        slot_mapping=slot_mapping.to(device),
        max_seqlen_q=max(query_lens),
        max_seqlen_k=max(context_lens),
        block_size=block_size,
        query_lens=list(query_lens),
        context_lens=context_lens,
    )
    return meta, positions.to(device)


# Up to this many new tokens a step's positions and slots are worked out in Python lists and
# made into tensors once each (`_small_step`); above it, with vectorized torch ops
# (`_large_step`). Both give the same integers. Why: on a CPU a decode step's metadata is built
# right after the previous step's weight reads have flushed the caches, where each of the
# vectorized path's ~15 small torch ops costs far more than in a warm loop: 370 us a batch-1
# step of the default model on a 2-core Zen 4 EPYC, 95-103 us with the lists
# (benchmarks/RESULTS.md, "What a batch-1 step spends outside its weight reads"). Per token the
# lists cost more: warm, one 256-token sequence took 57 us in lists against 69, one of 512 took
# 115 against 78, 32 decodes 90 against 138; hence the bound.
SMALL_STEP_TOKENS = 256


def _small_step(
    query_lens: list[int], before: list[int], padded: list[list[int]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens int32, block_table int32, positions int64, slot_mapping int64) from lists."""
    cu, positions, slots = [0], [], []
    for q, b, table in zip(query_lens, before, padded):
        cu.append(cu[-1] + q)
        for pos in range(b, b + q):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return (
        torch.tensor(cu, dtype=torch.int32),
        torch.tensor(padded, dtype=torch.int32),
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(slots, dtype=torch.int64),
    )


def _large_step(
    query_lens: list[int], before: list[int], padded: list[list[int]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_small_step`'s tensors with vectorized ops: O(sequences) Python for any token count."""
    num_seqs = len(query_lens)
    block_table = torch.tensor(padded, dtype=torch.int64)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    cu_seqlens = torch.zeros(num_seqs + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=cu_seqlens[1:])
    num_tokens = int(cu_seqlens[-1])
    # Token t belongs to sequence seq_of[t] and is its (t - cu[seq])-th new token.
    seq_of = torch.repeat_interleave(torch.arange(num_seqs), q_lens, output_size=num_tokens)
    offset_in_query = torch.arange(num_tokens) - cu_seqlens[seq_of]
    positions = torch.tensor(before, dtype=torch.int64)[seq_of] + offset_in_query
    block_ids = block_table[seq_of, positions // block_size]
    slot_mapping = block_ids * block_size + positions % block_size
    return cu_seqlens.to(torch.int32), block_table.to(torch.int32), positions, slot_mapping
