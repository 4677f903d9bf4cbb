"""Tensor-parallel collectives and the shapes they split: what the model and the runner call
inside a step (all_reduce, all_gather, the plan broadcast), with no knowledge of how the group
was started. executor_svc/tp_group.py starts, watches and stops the group; the group design
(Megatron sharding, rank 0 serving gRPC) is described there.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TPInfo:
    """This process's place in the group; size 1 = no group (every collective is skipped)."""

    rank: int = 0
    size: int = 1

    @property
    def enabled(self) -> bool:
        return self.size > 1


NO_TP = TPInfo()


def check_divisible(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Refuse a group size that does not split the heads evenly (no KV-head replication)."""
    if tp_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp_size}")
    if num_kv_heads % tp_size or num_heads % tp_size:
        raise ValueError(
            f"--tensor-parallel-size {tp_size} does not divide the model's heads: num_attention_heads "
            f"{num_heads}, num_key_value_heads {num_kv_heads} (each rank holds whole KV heads); use a "
            f"size that divides {num_kv_heads}"
        )


def shard_rows(total: int, tp: TPInfo) -> int:
    """Rows per rank of a dimension split `tp.size` ways (the vocabulary is padded up)."""
    return -(-total // tp.size)


class CommClock:
    """Nanoseconds this process spent inside collectives (waiting for slower ranks
    included), for the step-time benchmark's communication share; two clock reads per call."""

    ns = 0

    def __enter__(self) -> None:
        self.start = time.perf_counter_ns()

    def __exit__(self, *exc: object) -> None:
        CommClock.ns += time.perf_counter_ns() - self.start


def all_reduce_(x: torch.Tensor) -> torch.Tensor:
    """Sum over the group, in place on a contiguous copy when needed; returns the sum."""
    x = x.contiguous()
    with CommClock():
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension (rank order)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    with CommClock():
        dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def init_group(tp: TPInfo, device: torch.device, timeout_s: float) -> None:
    """Joins the group (env rendezvous) with a timeout on every collective; pins a CUDA rank
    to its local device."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", tp.rank)))
    dist.init_process_group(
        backend, init_method="env://", rank=tp.rank, world_size=tp.size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    log.info("rank %d of %d joined the tensor-parallel group (%s)", tp.rank, tp.size, backend)


def local_device(device: torch.device) -> torch.device:
    """A rank's device: cuda -> cuda:LOCAL_RANK once init_group has pinned it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def min_over_group(values: list[int], device: torch.device) -> list[int]:
    """Element-wise minimum over the ranks (KV block counts every rank can hold)."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [int(v) for v in t.tolist()]


class PlanChannel:
    """Rank 0 -> every rank: commands and serialized plans; rank 0's sampled tokens back."""

    def __init__(self, device: torch.device) -> None:
        # NCCL moves only device tensors; gloo host ones.
        self.device = device if device.type == "cuda" else torch.device("cpu")

    def send(self, cmd: int, payload: bytes = b"") -> None:
        header = torch.tensor([cmd, len(payload)], dtype=torch.int64, device=self.device)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device) if payload else None
        with CommClock():
            dist.broadcast(header, src=0)
            if data is not None:
                dist.broadcast(data, src=0)

    def recv(self) -> tuple[int, bytes]:
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        cmd, length = (int(v) for v in header.tolist())
        if not length:
            return cmd, b""
        data = torch.empty(length, dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=0)
        return cmd, data.cpu().numpy().tobytes()

    def share_tokens(self, tokens: list[int] | None, count: int, rank: int) -> list[int]:
        """Rank 0 passes its sampled token ids, the others `None`; every rank gets them."""
        t = (
            torch.tensor(tokens, dtype=torch.int64, device=self.device)
            if rank == 0
            else torch.empty(count, dtype=torch.int64, device=self.device)
        )
        with CommClock():
            dist.broadcast(t, src=0)
        return t.tolist()
