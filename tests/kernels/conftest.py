"""Builders for paged attention test batches: random caches with shuffled block ids."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from chunkserve_kernels import AttentionMetadata, build_metadata


@dataclass
class PagedBatch:
    meta: AttentionMetadata
    positions: torch.Tensor
    cache: torch.Tensor  # one layer: [2, num_blocks, block_size, Hkv, D]
    q: torch.Tensor  # [T, Hq, D]
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor
    block_tables: list[list[int]]


def make_paged_batch(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_q_heads: int = 9,
    num_kv_heads: int = 3,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """`seqs` = [(context_before, query_len)]; blocks drawn from a shuffled pool with spares."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil((before + q) / block_size) for before, q in seqs]
    num_blocks = sum(needed) + 5
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = []
    for n in needed:
        block_tables.append(pool[:n])
        pool = pool[n:]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    meta, positions = build_metadata([q for _, q in seqs], [b for b, _ in seqs], block_tables, block_size, "cpu")
    num_tokens = sum(q for _, q in seqs)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)

    return PagedBatch(meta, positions, cache, rand(num_q_heads), rand(num_kv_heads), rand(num_kv_heads), block_tables)


@pytest.fixture
def paged_batch():
    return make_paged_batch
