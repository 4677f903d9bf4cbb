"""The KV block pool: block tables, reference counts and the prefix cache.

Blocks grow with the work: after being scheduled for `n` tokens a request holds exactly
`ceil((num_computed_tokens + n) / block_size)` blocks, so a long prompt never reserves its
whole length up front. Block ids are physical indices into the executor's KV tensors.

Prefix caching: a block whose `block_size` tokens are all computed gets a chained SHA-256
hash of (parent block's hash, the request's cache salt, its token ids) and is registered, so
a later request with the same prefix takes it instead of recomputing it (its reference count
goes up). A freed block keeps its hash and joins the free queue; it is evicted — its hash
dropped — only when a block is needed and it is at the front.

Why SHA-256 and not Python's `hash()`: blocks are shared across requests and, through the
salt, across tenants, so a collision would hand one request another's KV. `hash()` is 64
bits and built for dicts, not adversaries; SHA-256 makes a collision infeasible (vLLM moved
to it for the same reason). On top of that a hit is verified against everything the hash
covers (parent hash, salt and token ids), so even a broken hash function costs a miss,
never wrong output. Cost: ~2.6 us per 16-token block (0.34 ms for a 2048-token prompt,
against ~0.03 ms with `hash()`), measured by benchmarks/prefix_hash_cost.py; figures in
benchmarks/RESULTS.md.

Why an OrderedDict for the free queue and not a deque: a cache hit must take a block out
of the *middle* of the queue in O(1). The order is the eviction order: blocks are appended
as they are freed, and a request frees its blocks tail first, so the end of a prompt
(least likely to be shared) is evicted before its beginning.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from chunkserve_contracts.block_hash import hash_block  # shared with the router
from scheduler_svc.request import Request

__all__ = ["Block", "BlockPool", "KVEventSink", "blocks_needed", "hash_block"]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens."""
    return -(-num_tokens // block_size)


class KVEventSink(Protocol):
    """Who hears the prefix cache change (scheduler_svc/kv_events.py): blocks registered (one
    chain: each block's parent is the one before it, the first's is `parent`), blocks evicted,
    everything forgotten. Called synchronously from the pool; None (the default) costs one
    attribute check per registration run, eviction batch and reset."""

    def stored(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int) -> None: ...
    def removed(self, hashes: list[bytes]) -> None: ...
    def cleared(self) -> None: ...


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # Set while registered in the prefix cache, with everything the hash covers, so that a
    # hit is verified against the content and not only the hash.
    block_hash: bytes | None = None
    parent_hash: bytes | None = None
    salt: str | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Free queue, reference counts and (optionally) the prefix cache of one block space."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks}x{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.events: KVEventSink | None = None  # KV cache events (off unless set)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-free ones included: evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (the kv_cache_usage_perc gauge)."""
        return 1.0 - len(self._free) / self.num_blocks

    # ---- per request -------------------------------------------------------------------

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `request` must gain to compute num_new_tokens more tokens."""
        need = blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, need - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_new_blocks(request, num_new_tokens) <= len(self._free)

    def allocate(self, request: Request, num_new_tokens: int) -> list[int]:
        """Appends the blocks request needs for num_new_tokens more tokens; returns the new ids."""
        new = self.take(self.num_new_blocks(request, num_new_tokens))
        request.block_ids.extend(new)
        return new

    def free(self, request: Request) -> None:
        """Drops request's references to its device blocks, tail first."""
        self.release(request.block_ids)
        request.block_ids.clear()
        request.block_hashes.clear()

    def match_prefix(self, request: Request, salt: str | None) -> int:
        """Takes the cached blocks that hold request's leading tokens; returns how many tokens.

        The whole known sequence is matched before any chunking, but never its last token:
        at least one token is always computed, so the step that reaches it can sample.
        """
        if not self.enable_caching or request.block_ids or request.needs_prompt_logprobs:
            return 0  # prompt logprobs need every prompt row computed
        tokens = request.token_ids(0, request.num_tokens)
        parent: bytes | None = None
        bs = self.block_size
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            block_hash = hash_block(parent, salt, chunk)
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != chunk or block.parent_hash != parent or block.salt != salt:
                break  # a hash collision: a miss, never another prefix's KV
            self._ref(block_id)
            request.block_ids.append(block_id)
            request.block_hashes.append(block_hash)
            parent = block_hash
        return len(request.block_ids) * bs

    def cache_full_blocks(self, request: Request, salt: str | None, num_computed: int) -> None:
        """Registers request's blocks that became full once its first num_computed tokens are
        in the KV (a step's result applied: its cursor may already be ahead, planned on)."""
        if not self.enable_caching:
            return
        bs = self.block_size
        full = num_computed // bs
        run: list[Block] = []  # the blocks registered by this call, for the events
        for i in range(len(request.block_hashes), full):
            parent = request.block_hashes[-1] if request.block_hashes else None
            chunk = tuple(request.token_ids(i * bs, (i + 1) * bs))
            block_hash = hash_block(parent, salt, chunk)
            request.block_hashes.append(block_hash)
            block = self.blocks[request.block_ids[i]]
            if block_hash not in self._cached and block.block_hash is None:
                block.block_hash, block.parent_hash, block.salt, block.token_ids = block_hash, parent, salt, chunk
                self._cached[block_hash] = block.block_id
                if self.events is not None:
                    run.append(block)
        if run:
            self._tell_stored(run)

    def _tell_stored(self, registered: list[Block]) -> None:
        """One stored event per chain of consecutive blocks (a block already cached by another
        request's identical prefix breaks a chain: it is not stored again)."""
        start = 0
        for i in range(1, len(registered) + 1):
            if i == len(registered) or registered[i].parent_hash != registered[i - 1].block_hash:
                chain = registered[start:i]
                tokens = [t for b in chain for t in b.token_ids]
                self.events.stored([b.block_hash for b in chain], chain[0].parent_hash, tokens, self.block_size)  # type: ignore[union-attr,misc]
                start = i

    def reset_cache(self) -> int:
        """Forgets every cached block (an operator's reset); returns how many were dropped."""
        dropped = len(self._cached)
        for block_id in self._cached.values():
            self._forget(self.blocks[block_id])
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        return dropped

    def cached_blocks(self) -> Iterator[Block]:
        """Every registered block, each after its parent when the parent is cached too (the
        order a subscriber that joins late is told them in: some build a tree)."""
        children: dict[bytes | None, list[Block]] = {}
        for block_id in self._cached.values():
            block = self.blocks[block_id]
            parent = block.parent_hash if block.parent_hash in self._cached else None
            children.setdefault(parent, []).append(block)
        stack = list(reversed(children.get(None, [])))
        while stack:
            block = stack.pop()
            yield block
            stack.extend(reversed(children.get(block.block_hash, [])))

    # ---- raw blocks (also used for host swap space) --------------------------------------

    def take(self, n: int) -> list[int]:
        """n fresh blocks, evicting cached ones from the front of the free queue. Raises
        RuntimeError when short: callers check first, so that is a scheduler bug."""
        if n > len(self._free):
            raise RuntimeError(f"allocate {n} blocks with {len(self._free)} free (check the pool first)")
        new = []
        evicted: list[bytes] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict
                del self._cached[block.block_hash]
                if self.events is not None:
                    evicted.append(block.block_hash)
                self._forget(block)
            block.ref_count = 1
            new.append(block_id)
        if evicted:
            self.events.removed(evicted)  # type: ignore[union-attr]
        return new

    def release(self, block_ids: list[int]) -> None:
        """Drops one reference to each block, last first; unreferenced ones become free."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed with ref count {block.ref_count} (double free)")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    @staticmethod
    def _forget(block: Block) -> None:
        block.block_hash, block.parent_hash, block.salt, block.token_ids = None, None, None, ()

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def check_invariants(self) -> None:
        """Raises on a broken invariant (the tests call it after every step)."""
        for block in self.blocks:
            if block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id} has ref count {block.ref_count}")
            if (block.ref_count == 0) != (block.block_id in self._free):
                raise RuntimeError(
                    f"block {block.block_id}: ref count {block.ref_count} but "
                    f"{'in' if block.block_id in self._free else 'not in'} the free queue"
                )
        for block_hash, block_id in self._cached.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise RuntimeError(f"cached hash points at block {block_id} which has another hash")

    def num_used_references(self) -> int:
        return sum(b.ref_count for b in self.blocks)
