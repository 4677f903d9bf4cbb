"""One scheduler per executor, and no orphaned executors (issue #13, items 7 and 8).

- the executor port answers only the scheduler that holds its per-launch token: every
  Executor RPC without it, or with another, is UNAUTHENTICATED (health stays open), and a
  scheduler with the wrong token stops at start-up with one line;
- a second `chunkserve serve` on the same --executor-port stops in one line and the first
  one keeps serving; an executor whose port is taken says which in one line (exit 2), and
  `chunkserve serve` does not restart a child that exits with 2;
- the executor child dies with its parent, even on SIGKILL, whether the parent is
  `chunkserve serve` or a chunkserve.launch user that spawned it from a short-lived thread.

Real processes on the tiny random model. Nothing here measures time: deadlines only bound
a wait for a state, and a test that hits one has failed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkserve.client import Completion, build_request
from chunkserve.launch import child_pids, free_port, start_server
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_contracts.executor.v1 import executor_pb2_grpc as epb_grpc
from chunkserve_contracts.ownership import stop_on_signal
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # starts real server processes: the full tier only

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 120.0  # bound on waiting for a process to get ready or to exit (failure only)
ORPHAN_DEADLINE_S = 30.0  # bound on an orphaned executor's exit (failure only)


# ---------------------------------------------------------------------------------------
# helpers


def _clean_env(**settings: str) -> dict[str, str]:
    """Our environment without any CHUNKSERVE_* variable, plus `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSERVE_")}
    env.update(settings, PYTHONUNBUFFERED="1")
    return env


def _wait_for(predicate, what: str, deadline_s: float = DEADLINE_S, on_fail=lambda: "") -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {deadline_s:g} s\n{on_fail()}")
        time.sleep(0.1)


def _exit_code(proc: subprocess.Popen, log: Path, deadline_s: float = DEADLINE_S) -> int:
    try:
        return proc.wait(deadline_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {deadline_s:g} s:\n{log.read_text()[-4000:]}") from None


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _kill(pid: int) -> None:
    if not _gone(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _serve(tmp_path: Path, name: str, model: Path, port: int, eport: int) -> tuple[subprocess.Popen, Path]:
    """`chunkserve serve` on the tiny model, output in tmp_path/name.log."""
    log = tmp_path / f"{name}.log"
    env = _clean_env(
        CHUNKSERVE_PORT=str(port),
        CHUNKSERVE_EXECUTOR_PORT=str(eport),
        CHUNKSERVE_METRICS_PORT="0",
        CHUNKSERVE_ADMIN_PORT="0",
        CHUNKSERVE_HTTP_PORT="0",
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chunkserve.cli",
            "serve",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--host",
            "127.0.0.1",
            "--num-gpu-blocks-override",
            "64",
        ],
        env=env,
        cwd=REPO,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    return proc, log


def _wait_serving(proc: subprocess.Popen, log: Path) -> None:
    def ready() -> bool:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        return "serving on" in log.read_text()

    _wait_for(ready, "chunkserve serve ready", on_fail=lambda: log.read_text()[-4000:])


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _generates(port: int) -> None:
    """One greedy request through the public API; the pool is whole afterwards."""
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    out = Completion()
    for msg in stub.Generate(build_request([5, 6, 7], temperature=0.0, max_tokens=4, ignore_eos=True), timeout=60):
        out.add(msg)
    assert len(out.token_ids) == 4 and out.finish_reason == pb.FINISH_REASON_LENGTH

    def idle() -> bool:
        info = stub.GetInfo(pb.GetInfoRequest(), timeout=10)
        return info.num_free_device_blocks == info.num_device_blocks and not info.num_requests_running

    _wait_for(idle, "all blocks free after the request")


def _one_line_no_traceback(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if line.strip()]
    assert "Traceback" not in text, text
    return lines


# ---------------------------------------------------------------------------------------
# (d) the executor port: every call needs the token, health stays open


def test_executor_rpcs_need_the_token_and_a_wrong_scheduler_stops_in_one_line(tiny_model_path, tmp_path):
    server = start_server(tmp_path, ["--model", str(tiny_model_path), "--dtype", "float32"], [])
    try:
        eport = server.executor.args[server.executor.args.index("--executor-port") + 1]
        channel = grpc.insecure_channel(f"127.0.0.1:{eport}")
        stub = epb_grpc.ExecutorStub(channel)
        calls = {
            "Handshake": (stub.Handshake, epb.HandshakeRequest()),
            "Step": (stub.Step, epb.StepRequest(step_id=1)),
            "Reset": (stub.Reset, epb.ResetRequest()),
        }
        for metadata in ((), (("authorization", "Bearer not-the-token"),), (("authorization", "not-bearer"),)):
            for name, (call, request) in calls.items():
                with pytest.raises(grpc.RpcError) as err:
                    call(request, metadata=metadata, timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata, err.value)
        # Health stays open for probes; the pair's own token works; it never was on a command line.
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "chunkserve.executor.v1.Executor"):
            assert (
                health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        assert server.token
        hs = stub.Handshake(epb.HandshakeRequest(), metadata=(("authorization", f"Bearer {server.token}"),), timeout=10)
        assert hs.num_device_blocks > 0
        for proc in (server.executor, server.scheduler):
            assert server.token not in Path(f"/proc/{proc.pid}/cmdline").read_text()

        # A scheduler started with another token (or none) on that executor stops at start-up, in one line.
        for token in ("another-token", ""):
            log = tmp_path / f"intruder-{len(token)}.log"
            intruder = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "scheduler_svc",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(free_port()),
                    "--metrics-port",
                    "0",
                    "--admin-port",
                    "0",
                    "--executor-address",
                    f"127.0.0.1:{eport}",
                ],
                env=_clean_env(CHUNKSERVE_EXECUTOR_TOKEN=token),
                cwd=REPO,
                stdout=open(log, "w"),
                stderr=subprocess.STDOUT,
            )
            try:
                assert _exit_code(intruder, log) == 2, log.read_text()
            finally:
                _stop(intruder)
            errors = [line for line in _one_line_no_traceback(log.read_text()) if " ERROR " in line]
            assert len(errors) == 1 and "refused this scheduler (UNAUTHENTICATED)" in errors[0], log.read_text()
            assert f"127.0.0.1:{eport}" in errors[0]
        # The owner was never disturbed.
        _generates(server.port)
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------
# (a) a second `chunkserve serve` on the same executor port


def test_second_serve_on_the_same_executor_port_stops_and_the_first_keeps_serving(tiny_model_path, tmp_path):
    port, eport = free_port(), free_port()
    first, first_log = _serve(tmp_path, "first", tiny_model_path, port, eport)
    second = None
    try:
        _wait_serving(first, first_log)
        executors_before = child_pids(first.pid)
        assert len(executors_before) == 1

        second, second_log = _serve(tmp_path, "second", tiny_model_path, free_port(), eport)
        code = _exit_code(second, second_log)
        text = second_log.read_text()
        lines = _one_line_no_traceback(text)
        assert code != 0 and "serving on" not in text, text
        assert len(lines) == 1 and str(eport) in lines[0] and "in use" in lines[0], text

        # The first server: same executor child, still serving, its pool whole.
        _generates(port)
        assert child_pids(first.pid) == executors_before
        assert "restarting" not in first_log.read_text()
    finally:
        if second is not None:
            _stop(second)
        _stop(first)


# ---------------------------------------------------------------------------------------
# (b) a taken port: one line, exit 2, never restarted


def test_executor_on_a_taken_port_says_so_in_one_line(tiny_model_path, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "executor_svc", "--model", str(tiny_model_path), "--executor-port", str(port)],
            env=_clean_env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
    lines = _one_line_no_traceback(done.stdout + done.stderr)
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], lines


def test_serve_bind_failure_after_loading_is_a_value_error(tiny_model_path, tmp_path):
    """The real bind (after the model loaded) fails the same way; grpcio raises RuntimeError there."""
    from executor_svc.config import ExecutorConfig
    from executor_svc.server import serve

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = ExecutorConfig(
            model=str(tiny_model_path),
            dtype="float32",
            device="cpu",
            executor_port=port,
            num_gpu_blocks_override=8,
            swap_space=0,
            cache_dir=str(tmp_path),
        )
        with pytest.raises(ValueError, match=f"127.0.0.1:{port}: the port is in use"):
            serve(config)


def test_serve_does_not_restart_an_executor_that_exits_with_2(tiny_model_path, tmp_path):
    """The child dies (SIGKILL) and is restarted once; that restart finds its model gone and
    exits 2: `chunkserve serve` reports it and exits 2 instead of restarting it again."""
    model = shutil.copytree(tiny_model_path, tmp_path / "model")
    proc, log = _serve(tmp_path, "serve", model, free_port(), free_port())
    try:
        _wait_serving(proc, log)
        [child] = child_pids(proc.pid)
        model.rename(tmp_path / "model-moved")
        os.kill(child, signal.SIGKILL)
        code = _exit_code(proc, log)
        text = log.read_text()
        assert code == 2, text
        assert text.count("; restarting it") == 1 and "not restarting it" in text, text
        assert "cannot resolve model" in text and "Traceback" not in text, text
    finally:
        _stop(proc)


# ---------------------------------------------------------------------------------------
# (c) no orphans


def test_executor_dies_with_a_sigkilled_chunkserve_serve(tiny_model_path, tmp_path):
    eport = free_port()
    proc, log = _serve(tmp_path, "serve", tiny_model_path, free_port(), eport)
    child = None
    try:
        _wait_serving(proc, log)
        [child] = child_pids(proc.pid)
        assert not _port_free(eport)
        proc.kill()
        proc.wait()
        _wait_for(
            lambda: _gone(child),
            f"orphaned executor {child} exits",
            ORPHAN_DEADLINE_S,
            on_fail=lambda: log.read_text()[-4000:],
        )
        _wait_for(lambda: _port_free(eport), f"executor port {eport} free", ORPHAN_DEADLINE_S)
    finally:
        _stop(proc)
        if child is not None:
            _kill(child)


LAUNCHER = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    from chunkserve.launch import start_server

    box = {}
    # From a thread that ends right away: PR_SET_PDEATHSIG would fire when it ends, so the
    # executor must not rely on it here (the watchdog on the parent pid covers this case).
    spawn = threading.Thread(target=lambda: box.update(s=start_server(
        Path(sys.argv[1]), ["--model", sys.argv[2], "--dtype", "float32"], ["--metrics-port", "0"])))
    spawn.start()
    spawn.join()
    s = box["s"]
    eport = s.executor.args[s.executor.args.index("--executor-port") + 1]
    print(s.executor.pid, s.scheduler.pid, s.port, eport, flush=True)
    time.sleep(3600)
""")


def test_launched_pair_survives_its_spawning_thread_and_dies_with_the_process(tiny_model_path, tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), str(tiny_model_path)],
        env=_clean_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        line = launcher.stdout.readline()
        assert line, f"the launcher exited with {launcher.wait()}"
        executor, scheduler, port, eport = map(int, line.split())
        pids = [executor, scheduler]
        _generates(port)  # the spawning thread is long gone; the executor still serves
        assert not _gone(executor)
        launcher.kill()
        launcher.wait()
        _wait_for(lambda: _gone(executor), f"orphaned executor {executor} exits", ORPHAN_DEADLINE_S)
        _wait_for(lambda: _port_free(eport), f"executor port {eport} free", ORPHAN_DEADLINE_S)
        _wait_for(lambda: _gone(scheduler), f"orphaned scheduler {scheduler} exits", ORPHAN_DEADLINE_S)
        _wait_for(lambda: _port_free(port), f"public port {port} free", ORPHAN_DEADLINE_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in pids:
            _kill(pid)


def test_a_launched_pair_exits_0_on_sigterm(tiny_model_path, tmp_path):
    """SIGTERM (what Server.stop and a process manager send) ends both children with status
    0. The scheduler used to wait on its parent watchdog's event in the loop's default
    executor, which the loop's close joins: it never exited until killed (15 s per server at
    the end of every test session)."""
    server = start_server(tmp_path, ["--model", str(tiny_model_path), "--dtype", "float32"], [])
    try:
        _generates(server.port)
        for proc in (server.scheduler, server.executor):
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(ORPHAN_DEADLINE_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{proc.args[2]} ignored SIGTERM:\n{server.log.read_text()[-3000:]}") from None
            assert code == 0, server.log.read_text()[-3000:]
    finally:
        server.stop()


def test_the_stop_signal_handler_never_waits_on_the_event_it_sets():
    """A signal that lands while the main thread is inside `Event.set` of the same event (a
    second SIGTERM during the first one's handler) must not wait for the event's lock: that
    deadlock left an executor alive after its `chunkserve serve` was SIGKILLed. Simulated
    on a worker thread that holds the event's lock while the handler runs, twice."""
    stop = threading.Event()
    handler = stop_on_signal(stop)

    def signalled_inside_set() -> None:
        with stop._cond:  # what Event.set holds while it runs
            handler(signal.SIGTERM, None)
            handler(signal.SIGTERM, None)

    worker = threading.Thread(target=signalled_inside_set, daemon=True)
    worker.start()
    worker.join(ORPHAN_DEADLINE_S)
    assert not worker.is_alive(), "the handler blocked on the lock its own thread holds"
    assert stop.wait(ORPHAN_DEADLINE_S)
    assert sum(t.name == "stop-on-signal" for t in threading.enumerate()) <= 1


def test_watchdog_stops_then_exits_hard_when_the_parent_is_gone():
    """tie_to_parent with a parent pid that is not ours: stop is set at once, and a process
    that does not stop within the grace period is ended (exit 1)."""
    code = textwrap.dedent("""
        import os, threading, time
        from chunkserve_contracts.ownership import tie_to_parent
        os.environ["CHUNKSERVE_PARENT_PID"] = "999999999"  # above any pid_max: never our parent
        stop = threading.Event()
        assert tie_to_parent(stop, interval_s=0.05, exit_grace_s=0.2) == 999999999
        assert stop.wait(30), "stop was not set"
        assert "CHUNKSERVE_PARENT_PID" not in os.environ
        time.sleep(60)  # ignores stop: the watchdog must end the process
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], env=_clean_env(), cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert done.returncode == 1, done.stderr
    assert "parent process 999999999 is gone" in done.stderr


def test_standalone_executor_has_no_watchdog():
    code = (
        "import threading\nfrom chunkserve_contracts.ownership import tie_to_parent\n"
        "assert tie_to_parent(threading.Event()) is None\n"
        "assert not [t for t in threading.enumerate() if t.name == 'parent-watchdog']\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=_clean_env(), cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------
# the token as a setting: shared by both services, never shown


def test_token_is_a_secret_setting_of_both_services(monkeypatch):
    import argparse

    from chunkserve_contracts.flags import add_config_flags, config_from_args, config_to_argv
    from executor_svc.config import ExecutorConfig
    from scheduler_svc.config import SchedulerConfig

    monkeypatch.setenv("CHUNKSERVE_EXECUTOR_TOKEN", "t0ken-from-env")
    for cls in (ExecutorConfig, SchedulerConfig):
        parser = argparse.ArgumentParser()
        add_config_flags(parser, cls)
        config = config_from_args(cls, parser.parse_args([]))
        assert config.executor_token == "t0ken-from-env"
        assert "t0ken-from-env" not in parser.format_help()
        assert "t0ken-from-env" not in repr(config)
        assert "t0ken-from-env" not in " ".join(config_to_argv(config))


def test_grpc_fork_handlers_are_off_in_processes_that_spawn_children():
    """`chunkserve serve` and chunkserve.launch fork only to exec: gRPC's fork handlers, on,
    once crashed a restarted executor before its exec (SIGSEGV). Off unless the user says."""
    code = "import chunkserve.cli, os, sys; assert 'grpc' not in sys.modules; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])"
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "false"
    env["GRPC_ENABLE_FORK_SUPPORT"] = "true"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "true"
