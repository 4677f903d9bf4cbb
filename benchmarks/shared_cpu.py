"""Decode speed on a shared CPU: batch-1 and batch-8 decode tok/s of a real server, idle vs with
other work on the same machine, as ratios measured in one run (issue 32).

    .venv/bin/python benchmarks/shared_cpu.py                      # the default settings
    .venv/bin/python benchmarks/shared_cpu.py --configs default t2-spin t1 --rounds 3

Each config is a real two-process server on the default model (float32) started with the
executor flags/environment the config names; "default" adds nothing (the executor's own thread
rule: executor_svc/threads.py moves the count by measured step times). All servers start first;
then each of `--rounds` rounds takes each condition in turn and measures every config under it,
so slow drift of the machine hits them alike (the first config is the "idle vs" baseline).
Servers wait for work without using the CPU, except with OpenMP's ACTIVE wait policy
(t2-spin), whose idle threads spin forever: measure t2-spin in a run of its own, or it is a busy
neighbour of every other config:
  idle    nothing else started by this script (the machine may still run other work: say so)
  busy    `--busy` processes spinning in pure Python (one = one core's worth of other work),
          not pinned, as a user's other services would be
  quota   the server's two processes moved into a cgroup with a CPU quota of `--quota` CPUs
          (cgroup v1 `cpu.cfs_quota_us` or v2 `cpu.max`; skipped where no writable cgroup)
A measurement: B streams (64-token prompts, --new-tokens tokens each, greedy, ignore_eos);
decode tok/s = tokens after each stream's first / time from its first to its last token,
summed over the streams. Prints medians and each condition's ratio to idle. Goal (issue 32):
busy / idle >= 0.4 at batch 1 with one busy process on a 2-core machine (a fair share is 0.5).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

CONFIGS = {  # name: (executor flags, environment, scheduler flags)
    "default": ([], {}, []),
    "t2": (["--num-threads", "2"], {}, []),  # the rule before issue 32: every CPU, OpenMP's default wait
    "t2-spin": (["--num-threads", "2"], {"OMP_WAIT_POLICY": "ACTIVE"}, []),
    "t2-passive": (["--num-threads", "2"], {"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "t2-spin10k": (["--num-threads", "2"], {"GOMP_SPINCOUNT": "10000"}, []),
    "t1": (["--num-threads", "1"], {}, []),
    "one-step": ([], {}, ["--num-scheduler-steps", "1"]),  # the default before multi-step plans were on a CPU's
    "multi4": ([], {}, ["--num-scheduler-steps", "4"]),  # multi-step decoding (scheduler_svc/multi_step.py)
    "multi8": ([], {}, ["--num-scheduler-steps", "8"]),
    "t1-multi8": (["--num-threads", "1"], {}, ["--num-scheduler-steps", "8"]),
}
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")


def spin() -> None:
    """One core's worth of other work."""
    while True:
        pass


async def decode_rate(address: str, batch: int, new_tokens: int) -> float:
    """Summed per-stream decode tok/s of `batch` concurrent greedy streams."""
    import grpc

    from chunkserve.client import build_request
    from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(i: int) -> float:
            prompt = [(17 * i + 31 * j) % 5000 + 100 for j in range(64)]
            req = build_request(prompt, temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
            first = last = None
            n = 0
            async for msg in stub.Generate(req):
                if msg.token_ids:
                    last = time.perf_counter()
                    first = first or last
                    n += len(msg.token_ids)
            if n != new_tokens or first is None or last is None or last <= first:
                raise RuntimeError(f"stream {i}: {n} tokens of {new_tokens}")
            return (n - 1) / (last - first)

        return sum(await asyncio.gather(*(one(i) for i in range(batch))))


class Quota:
    """A cgroup with a CPU quota that the server's processes can be moved into and out of."""

    def __init__(self, cpus: float) -> None:
        self.cpus = cpus
        self.path: Path | None = None
        self.parent: Path | None = None
        period = 100_000
        try:
            if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
                path = CGROUP_V1 / "chunkserve-bench"
                path.mkdir(exist_ok=True)
                (path / "cpu.cfs_period_us").write_text(str(period))
                (path / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
                self.path, self.parent = path, CGROUP_V1
            elif (CGROUP_V2 / "cgroup.controllers").exists():
                path = CGROUP_V2 / "chunkserve-bench"
                path.mkdir(exist_ok=True)
                (path / "cpu.max").write_text(f"{int(cpus * period)} {period}")
                self.path, self.parent = path, CGROUP_V2
        except OSError as exc:
            print(f"no cgroup quota condition: {exc}")
            self.path = None

    def move(self, pids: list[int], inside: bool) -> None:
        target = self.path if inside else self.parent
        assert target is not None  # only called when self.path is set
        for pid in pids:
            (target / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        if self.path is not None:
            try:
                self.path.rmdir()
            except OSError:
                pass


def start(config: str, model: Path):
    """A real two-process server started with the config's executor flags and environment."""
    from chunkserve.launch import start_server

    flags, env, scheduler_flags = CONFIGS[config]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return start_server(
            Path(tempfile.mkdtemp()), ["--model", str(model), *flags], ["--max-num-seqs", "8", *scheduler_flags]
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure(servers: dict, args: argparse.Namespace, quota: Quota) -> dict[str, dict[str, dict[int, list[float]]]]:
    """Every config under every condition, interleaved: round by round, condition by condition,
    config by config (the busy processes run while each config in turn is measured)."""
    conditions = ["idle", "busy"] + (["quota"] if quota.path else [])
    out = {c: {cond: {b: [] for b in args.batch} for cond in conditions} for c in servers}
    for server in servers.values():
        asyncio.run(decode_rate(server.address, 1, 8))  # warm-up
    for r in range(args.rounds):
        for cond in conditions:
            busy = []
            if cond == "busy":
                busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
                for p in busy:
                    p.start()
            try:
                for config, server in servers.items():
                    if cond == "quota":
                        quota.move([server.executor.pid, server.scheduler.pid], inside=True)
                    try:
                        for b in args.batch:
                            rate = asyncio.run(decode_rate(server.address, b, args.new_tokens))
                            out[config][cond][b].append(rate)
                            print(f"  {config:10s} round {r} {cond:5s} B{b}: {rate:6.1f} tok/s", flush=True)
                    finally:
                        if cond == "quota":
                            quota.move([server.executor.pid, server.scheduler.pid], inside=False)
            finally:
                for p in busy:
                    p.kill()
                    p.join()
    return out


def report_threads(config: str, server) -> None:
    """The executor's thread choice, and the thread governor's moves (executor_svc/threads.py)."""
    log = server.log.read_text()
    chosen = [line.split("executor: ", 1)[-1] for line in log.splitlines() if "threads" in line and "executor:" in line]
    if chosen:
        print(f"  {config}: {chosen[0][:200]}")
    moves = [line for line in chosen if line.startswith("torch threads")]
    if moves:
        shown = moves if len(moves) <= 5 else [*moves[:3], "...", *moves[-2:]]
        print(f"  {config}: {len(moves)} thread-count moves: " + " | ".join(shown))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["default"], choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--busy", type=int, default=1, help="spinning processes in the busy condition")
    ap.add_argument("--quota", type=float, default=1.0, help="CPUs of the quota condition (0 = skip it)")
    args = ap.parse_args()

    from executor_svc.config import default_cache_dir
    from executor_svc.model_loader import resolve_model

    model = resolve_model("default", Path(default_cache_dir()))
    quota = Quota(args.quota) if args.quota > 0 else Quota.__new__(Quota)
    if args.quota <= 0:
        quota.path = None
    print(f"{os.cpu_count()} CPUs, {args.busy} busy process(es), quota {args.quota:g} CPUs, {args.rounds} rounds")
    servers = {}
    try:
        for config in args.configs:
            servers[config] = start(config, model)
        results = measure(servers, args, quota)
        for config, server in servers.items():
            report_threads(config, server)
    finally:
        quota.remove()
        for server in servers.values():
            server.stop()
    base = args.configs[0]
    print(f"\n| config | batch | idle tok/s | idle vs {base} | busy tok/s | busy/idle | quota tok/s | quota/idle |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for config, res in results.items():
        for b in args.batch:
            idle = statistics.median(res["idle"][b])
            busy = statistics.median(res["busy"][b])
            vs = idle / statistics.median(results[base]["idle"][b])
            q = f"{statistics.median(res['quota'][b]):.1f}" if "quota" in res else "-"
            qr = f"{statistics.median(res['quota'][b]) / idle:.2f}" if "quota" in res else "-"
            print(f"| {config} | {b} | {idle:.1f} | {vs:.2f} | {busy:.1f} | {busy / idle:.2f} | {q} | {qr} |")


if __name__ == "__main__":
    main()
