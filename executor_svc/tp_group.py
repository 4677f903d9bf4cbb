"""The tensor-parallel executor group: Megatron-style sharding over torch.distributed.

N ranks (`--tensor-parallel-size N`) each hold a shard of every weight and their share of the
KV heads. Rank 0 is the gRPC executor; the scheduler does not know the others exist. Per
step rank 0 broadcasts the plan as the serialized StepRequest protobuf (a header tensor
[command, length], then the bytes as a uint8 tensor: no pickle), every rank runs the same
validate-then-apply path of ModelRunner on its shard, and rank 0 samples and answers; the
sampled token ids are broadcast back so every rank can feed them into the next decode.

Per decoder layer: qkv and gate_up are column-parallel (each rank its heads, its slice of
the intermediate dim), o_proj and down_proj row-parallel with one all_reduce each. The
embedding is vocab-parallel (each rank a slice of the vocabulary, masked lookup + one
all_reduce per step); the LM head too, with an all_gather of the logits of only the rows
that sample (every rank gets them; only rank 0 samples).

Launch: started plainly, rank 0 spawns ranks 1..N-1 on this host as `python -m
executor_svc` subprocesses with the torchrun environment (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK); under torchrun (RANK in the environment) nobody spawns, so a group
can span hosts. Every collective has the group's timeout; a rank that dies ends the group:
rank 0 exits (the scheduler sees the executor gone), the other ranks exit when their next
collective fails or their parent dies.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_contracts.flags import config_to_argv
from executor_svc.collectives import NO_TP, PlanChannel, TPInfo, check_divisible
from executor_svc.config import ExecutorConfig
from executor_svc.model_loader import resolve_model
from executor_svc.plan_check import PlanError

log = logging.getLogger(__name__)

# Commands rank 0 broadcasts (the header's first element).
CMD_STOP, CMD_STEP, CMD_RESET, CMD_PING = 0, 1, 2, 3
EXIT_GROUP_LOST = 3  # rank 0's exit status when a rank died or a collective failed


def env_rank() -> TPInfo | None:
    """The torchrun-style rank from the environment, or None when not started in a group."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return TPInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class LocalGroup:
    """Ranks 1..N-1 that rank 0 started on this host, and the thread that watches them."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)

    def watch(self, on_death: Any) -> None:
        """Calls on_death(rank, returncode) from a thread when a rank exits before stop()."""

        def run(rank: int, proc: subprocess.Popen) -> None:
            code = proc.wait()
            if not self.stopping.is_set():
                on_death(rank, code)

        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=run, args=(rank, proc), name=f"tp-rank-{rank}", daemon=True).start()

    def stop(self, grace_s: float = 5.0) -> None:
        self.stopping.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def join_group(config: ExecutorConfig) -> tuple[TPInfo, LocalGroup | None]:
    """This process's tensor-parallel rank, and the local ranks it started (rank 0 started
    plainly with --tensor-parallel-size N > 1 starts ranks 1..N-1; under torchrun, the
    environment says the rank and nobody starts anything). Before `load`."""
    size = config.tensor_parallel_size
    if size == 1:
        return NO_TP, None
    path = resolve_model(config.model, Path(config.cache_dir))  # before any rank starts (converts once)
    hf = json.loads((path / "config.json").read_text())
    heads = hf.get("num_attention_heads", 0)
    check_divisible(heads, hf.get("num_key_value_heads") or heads, size)
    tp = env_rank()
    if tp is not None:
        if tp.size != size:
            raise ValueError(f"WORLD_SIZE is {tp.size} but --tensor-parallel-size is {size}: they must match")
        return tp, None
    group = spawn_local_ranks(size, config_to_argv(config))
    group.watch(lambda rank, code: end_group(f"tensor-parallel rank {rank} exited with status {code}", group))
    return TPInfo(0, size), group


def spawn_local_ranks(size: int, argv: list[str]) -> LocalGroup:
    """Starts ranks 1..size-1 as `python -m executor_svc <argv>` with the torchrun
    environment, and sets it for this process (rank 0) too."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(size))
    group = LocalGroup()
    for rank in range(1, size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size))
        env["CHUNKSERVE_PARENT_PID"] = str(os.getpid())  # die with rank 0 (see ownership.tie_to_parent)
        env["CHUNKSERVE_PARENT_DEATHSIG"] = "1"
        group.procs.append(subprocess.Popen([sys.executable, "-m", "executor_svc", *argv], env=env))
    log.info("started tensor-parallel ranks 1..%d (pids %s)", size - 1, [p.pid for p in group.procs])
    return group


def worker_loop(runner: Any, channel: PlanChannel) -> None:
    """Ranks 1..N-1: run what rank 0 broadcasts until it says stop (or a collective fails,
    which raises and ends the process)."""
    while True:
        cmd, payload = channel.recv()
        if cmd == CMD_STEP:
            try:
                runner.execute(epb.StepRequest.FromString(payload))
            except PlanError:
                pass  # rank 0 refused the same plan the same way: nothing changed anywhere
        elif cmd == CMD_RESET:
            runner.reset()
        elif cmd == CMD_STOP:
            return


def ignore_interrupts() -> None:
    """Ranks 1..N-1 leave Ctrl-C to rank 0, which ends them; SIGTERM ends them at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def end_group(message: str, group: LocalGroup | None) -> None:
    """A rank is gone or a collective failed: the group cannot go on. Ends the local ranks
    and this process at once (threads stuck in a collective would keep a clean exit waiting),
    so the scheduler sees the executor gone, as when a single executor dies."""
    log.critical("%s; ending the tensor-parallel group", message)
    logging.shutdown()
    if group is not None:
        group.stop(grace_s=2.0)
    os._exit(EXIT_GROUP_LOST)


class Leader:
    """Rank 0's side: every command reaches the other ranks before rank 0 runs it itself.

    Runs on the compute thread only (the servicer's), so commands and steps never interleave.
    Idle ranks wait in a broadcast with the group's timeout, so rank 0 pings them at a
    quarter of it when no step came."""

    def __init__(self, channel: PlanChannel, group: LocalGroup | None, timeout_s: float) -> None:
        self.channel = channel
        self.group = group
        self.interval_s = timeout_s / 4
        self.last = time.monotonic()

    def run(self, fn: Any, *args: Any, cmd: int = CMD_STEP, payload: bytes = b"") -> Any:
        try:
            self.channel.send(cmd, payload)
            self.last = time.monotonic()
            return fn(*args)
        except PlanError:
            raise  # every rank refused the same plan before changing anything: the group goes on
        except Exception as exc:  # noqa: BLE001 - a failed collective, or ranks out of step
            end_group(f"command {cmd} failed on rank 0: {exc!r}", self.group)

    def ping(self) -> None:
        if time.monotonic() - self.last >= self.interval_s:
            self.run(lambda: None, cmd=CMD_PING)

    def keepalive(self, compute: Any, stop: threading.Event) -> None:
        def loop() -> None:
            while not stop.wait(self.interval_s):
                compute.submit(self.ping).result()

        threading.Thread(target=loop, name="tp-keepalive", daemon=True).start()

    def close(self) -> None:
        """Tells the other ranks to stop (on the compute thread), then ends the local ones."""
        if self.group is not None:
            self.group.stopping.set()
        try:
            self.channel.send(CMD_STOP)
        except Exception as exc:  # noqa: BLE001 - a rank already gone: nothing left to tell
            log.warning("could not tell the tensor-parallel ranks to stop: %r", exc)
        if self.group is not None:
            self.group.stop()
