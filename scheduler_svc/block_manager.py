"""The KV block pool: which physical blocks of the executor's cache each request holds.

Blocks grow with the work: after being scheduled for `n` tokens a request holds exactly
`ceil((num_computed_tokens + n) / block_size)` blocks, so a long prompt never reserves its
whole length up front. Block ids are physical indices into the executor's KV tensors; the
pool is sized from the executor's handshake.

Why a deque of free ids and not a heap: any free block is as good as another, and
reusing recently freed blocks first keeps the touched memory small.
"""
from __future__ import annotations

from collections import deque

from scheduler_svc.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens."""
    return -(-num_tokens // block_size)


class BlockPool:
    """A free list of blocks (device, or host swap space) with an owner per used block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks}x{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (the kv_cache_usage_perc gauge)."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `request` must gain to compute num_new_tokens more tokens."""
        need = blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, need - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_new_blocks(request, num_new_tokens) <= len(self._free)

    def allocate(self, request: Request, num_new_tokens: int) -> list[int]:
        """Appends the blocks request needs for num_new_tokens more tokens; returns the new ids."""
        new = self.take(request.request_id, self.num_new_blocks(request, num_new_tokens))
        request.block_ids.extend(new)
        return new

    def free(self, request: Request) -> None:
        """Returns all of request's device blocks, tail first."""
        self.release(request.request_id, request.block_ids)
        request.block_ids.clear()

    def take(self, owner: str, n: int) -> list[int]:
        """n blocks for owner. Raises RuntimeError when short: callers check first, so a
        failure here is a scheduler bug, not a user error."""
        if n > len(self._free):
            raise RuntimeError(f"allocate {n} blocks with {len(self._free)} free (check the pool first)")
        new = [self._free.popleft() for _ in range(n)]
        for block in new:
            self._owner[block] = owner
        return new

    def release(self, owner: str, blocks: list[int]) -> None:
        """Returns owner's blocks, last first (the tail is the least likely to be shared)."""
        for block in reversed(blocks):
            if self._owner.pop(block, None) != owner:
                raise RuntimeError(f"block {block} freed by {owner} which does not own it")
            self._free.append(block)

    def check_invariants(self) -> None:
        """Raises if a block is both free and owned, or lost (leak check for tests and idle)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("a block is in the free list twice")
        if free & self._owner.keys():
            raise RuntimeError("a block is both free and owned")
        if len(free) + len(self._owner) != self.num_blocks:
            raise RuntimeError(f"{self.num_blocks - len(free) - len(self._owner)} blocks lost")
