"""The prefix-cache block hash: what the scheduler keys its cached KV blocks by and what a
router computes for a prompt to know which replica holds it. One definition, imported by
both (scheduler_svc/block_pool.py and chunkserve/router/), so the two can never disagree.

Why SHA-256 and the encoding: see scheduler_svc/block_pool.py's docstring.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def hash_block(parent: bytes | None, salt: str | None, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: SHA-256 over (parent hash, salt, token ids).

    Every part is length-delimited (the parent is 32 bytes or a 0 flag, the salt a flag plus
    its length, token ids 8 bytes each), so two different inputs never encode to the same
    bytes.
    """
    h = hashlib.sha256(b"\x01" + parent if parent is not None else b"\x00")
    if salt is None:
        h.update(b"\x00")
    else:
        encoded = salt.encode()
        h.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None) -> list[bytes]:
    """The chained hashes of the prompt's blocks that the prefix cache can hold for it: every
    full block except one that would end on the prompt's last token (the scheduler always
    computes that token, BlockPool.match_prefix)."""
    hashes: list[bytes] = []
    parent: bytes | None = None
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, salt, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def external_hash(block_hash: bytes) -> int:
    """A block hash as vLLM's KV events carry it by default: the last 8 bytes as an unsigned
    big-endian integer (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES; llm-d reads bytes the same
    way, vllm-router only reads integers)."""
    return int.from_bytes(block_hash[-8:], "big")
