"""Calls on the scheduler's Admin service that keep runs independent of each other."""

from __future__ import annotations

import logging

import grpc

from chunkserve_contracts.auth import admin_metadata
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


async def reset_prefix_cache(admin_address: str, timeout: float = 10.0) -> int | None:
    """Empties the server's prefix cache; the number of blocks dropped, None if not possible.

    Without it a second run of the same workload (a --compare round on a reused server, a
    --capacity probe, a repeated command) would find the previous run's prompts cached.
    """
    try:
        async with grpc.aio.insecure_channel(admin_address) as channel:
            reply = await pb_grpc.AdminStub(channel).ResetPrefixCache(
                pb.ResetPrefixCacheRequest(), metadata=admin_metadata(), timeout=timeout
            )
        return reply.num_blocks_dropped
    except grpc.aio.AioRpcError as exc:
        log.warning(
            "could not reset the prefix cache at %s (%s): this run may hit prompts cached by an earlier one",
            admin_address,
            exc.code().name,
        )
        return None
