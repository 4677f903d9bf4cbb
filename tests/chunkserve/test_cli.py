"""The `chunkserve` command's rough edges (issue 19): one-line errors instead of tracebacks,
the positional model, one address flag for every client, `--version`, and the scripts.

No model and no server process: ports are held by plain sockets, "servers" at the wrong port
are bare gRPC servers, and the scripts run in a temp copy against fake executables."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from chunkserve.cli import check_model, main
from chunkserve.launch import free_port
from chunkserve_contracts import __version__
from chunkserve_contracts.auth import SyncBearerTokenInterceptor
from executor_svc.config import DEFAULT_MODEL_HUB_ID

REPO = Path(__file__).resolve().parents[2]
SERVE_PORT_FLAGS = ("--port", "--http-port", "--metrics-port", "--admin-port")


@contextlib.contextmanager
def held_port():
    """A loopback port something listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def closed_port() -> int:
    """A loopback port nothing listens on (bound, never listened, so nothing can take it)."""
    return free_port()


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    code = exit_info.value.code
    return (code if isinstance(code, int) else 1), out, err


def serve_argv(**ports: int) -> list[str]:
    """`serve` on loopback with every port off (0) but those given, and a free executor port."""
    argv = ["serve", "--host", "127.0.0.1", "--http-host", "127.0.0.1", "--metrics-host", "127.0.0.1"]
    for flag in SERVE_PORT_FLAGS:
        argv += [flag, str(ports.get(flag, 0))]
    return argv + ["--executor-port", str(free_port())]


def no_server(monkeypatch) -> list[tuple[object, object]]:
    """`serve` up to the point it would start the servers: the configs it would start them with."""
    import uvloop

    import chunkserve.cli

    started: list[tuple[object, object]] = []
    monkeypatch.setattr(
        chunkserve.cli, "_serve_async", lambda scheduler, executor, access=None: started.append((scheduler, executor))
    )
    monkeypatch.setattr(uvloop, "run", lambda _: 0)
    return started


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------------------
# serve: ports checked before the executor starts, one line, exit 2


@pytest.mark.parametrize("flag", SERVE_PORT_FLAGS)
def test_serve_on_a_busy_port_says_which_flag_in_one_line(flag, capsys, monkeypatch):
    started = no_server(monkeypatch)
    with held_port() as port:
        code, out, err = run_main(serve_argv(**{flag: port}), capsys)
    line = one_line(err)
    assert code == 2 and not started and not out
    assert line.startswith(f"chunkserve serve: {flag} {port} is in use"), line


def test_serve_refuses_one_port_for_two_flags(capsys):
    port = free_port()
    code, _, err = run_main(serve_argv(**{"--port": port, "--http-port": port}), capsys)
    assert code == 2 and "--http-port" in one_line(err) and "--port" in err


def test_a_late_bind_failure_is_one_value_error_naming_the_flag():
    """A port taken between the check and the real bind (a race): ValueError, which
    `chunkserve serve` and `python -m scheduler_svc` print as one line and exit 2."""
    from scheduler_svc.app import SchedulerApp
    from scheduler_svc.config import SchedulerConfig

    async def start(**ports: int) -> None:
        app = SchedulerApp(SchedulerConfig(host="127.0.0.1", metrics_port=0, http_port=0, **ports))
        try:
            await app.start()
        finally:
            await app.stop(grace=0)

    with held_port() as port:
        with pytest.raises(ValueError, match=f"^--port {port}: cannot listen on 127.0.0.1:{port}"):
            asyncio.run(start(port=port, admin_port=0))
        with pytest.raises(ValueError, match=f"^--admin-port {port}: cannot listen on 127.0.0.1:{port}"):
            asyncio.run(start(port=0, admin_port=port))


# ---------------------------------------------------------------------------------------
# serve: the positional model


def test_positional_model_is_the_model_and_the_default_hub_id_is_the_default_model(capsys, monkeypatch, tmp_path):
    seen = no_server(monkeypatch)
    folder = tmp_path / "model"
    folder.mkdir()
    for model_args in ([DEFAULT_MODEL_HUB_ID], [str(folder)], [str(folder), "--model", str(folder)], []):
        code, _, err = run_main(serve_argv() + model_args, capsys)
        assert code == 0, err
    assert [executor.model for _, executor in seen] == ["default", str(folder), str(folder), "default"]


@pytest.mark.parametrize(
    "model_args, message",
    [
        (["meta-llama/Llama-3.2-1B"], "downloads nothing from a model hub: pass a local model folder"),
        (["--model", "Qwen/Qwen2.5-0.5B"], "downloads nothing from a model hub"),
        (["/no/such/folder"], "no such folder or .gguf file"),
        (["a/b", "--model", "c/d"], "the model is given twice"),
    ],
)
def test_serve_refuses_a_model_it_cannot_have_in_one_line(model_args, message, capsys):
    code, _, err = run_main(serve_argv() + model_args, capsys)
    assert code == 2 and message in one_line(err)


def test_check_model():
    assert check_model(DEFAULT_MODEL_HUB_ID) == "default"
    assert check_model("default") == "default"
    with pytest.raises(ValueError, match="model hub"):
        check_model("HuggingFaceTB/SmolLM2-360M-Instruct")


# ---------------------------------------------------------------------------------------
# client subcommands: one address flag, one-line errors


@contextlib.contextmanager
def grpc_server(token: str | None = None):
    """A gRPC server with the health service only, like the Admin or executor port is to a
    Generation client (the executor's one checks a token, as the real one does)."""
    interceptors = [SyncBearerTokenInterceptor(token)] if token else []
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=interceptors)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@pytest.mark.parametrize("token", [None, "executor-token"], ids=["admin-port", "executor-port"])
def test_generate_at_another_port_says_so(token, capsys):
    with grpc_server(token) as address:
        code, _, err = run_main(["generate", "--address", address, "hi"], capsys)
        line = one_line(err)
        assert code == 1
        assert f"the server at {address} does not serve chunkserve.v1.Generation" in line, line
        assert "--port" in line and "50051" in line and "Admin or executor port" in line
        # the old spelling still works and means the same address
        host, port = address.split(":")
        code, _, err = run_main(["generate", "--host", host, "--port", port, "hi"], capsys)
        assert code == 1 and f"the server at {address} does not serve" in one_line(err)


def test_generate_sends_the_sampling_flags(capsys):
    """`chunkserve generate`'s sampling flags reach the request: penalties, stop strings and
    bad words (repeatable), as a stub Generation server receives them."""
    from chunkserve_contracts.v1 import chunkserve_pb2 as pb
    from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

    got: list[pb.GenerateRequest] = []

    class Stub(pb_grpc.GenerationServicer):
        def Generate(self, request, context):
            got.append(request)
            yield pb.GenerateResponse(request_id="r", text="ok", finished=True)

    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_GenerationServicer_to_server(Stub(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        flags = ["--presence-penalty", "0.5", "--frequency-penalty", "0.25", "--repetition-penalty", "1.5"]
        flags += ["--stop", "x", "--bad-word", "cat", "--bad-word", "hot dog"]
        code, out, _ = run_main(["generate", "--address", f"127.0.0.1:{port}", *flags, "hi"], capsys)
    finally:
        server.stop(None)
    s = got[0].sampling
    assert code == 0 and out.startswith("ok")
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, 0.25, 1.5)
    assert list(s.stop) == ["x"] and list(s.bad_words) == ["cat", "hot dog"]


def test_generate_with_no_server_says_so(capsys):
    address = f"127.0.0.1:{closed_port()}"
    code, _, err = run_main(["generate", "--address", address, "hi"], capsys)
    assert code == 1 and f"no server answers at {address}" in one_line(err)


def test_admin_without_an_admin_service_says_how_to_start_one(capsys):
    port = closed_port()
    code, _, err = run_main(["admin", "--address", f"127.0.0.1:{port}", "config"], capsys)
    assert code == 1
    assert (
        one_line(err)
        == f"chunkserve admin: no Admin service at 127.0.0.1:{port} (start the server with --admin-port {port})"
    )


def test_admin_is_on_by_default_on_loopback_and_the_client_knows_where():
    from chunkserve.admin_cli import DEFAULT_ADMIN_PORT
    from scheduler_svc.config import SchedulerConfig

    config = SchedulerConfig()
    assert config.admin_port == DEFAULT_ADMIN_PORT == 50052 and config.admin_host == "127.0.0.1"


def test_bench_with_no_server_says_so_in_one_line(capsys):
    address = f"127.0.0.1:{closed_port()}"
    code, _, err = run_main(["bench", "--address", address, "--num-prompts", "2", "--disable-tqdm"], capsys)
    assert code == 1 and f"chunkserve bench: no server answers at {address}" in one_line(err)


def test_version(capsys):
    code, out, _ = run_main(["--version"], capsys)
    assert code == 0 and out.strip() == f"chunkserve {__version__}"


# ---------------------------------------------------------------------------------------
# scripts, in a temp copy of the repository's layout


def _script_copy(tmp_path: Path, name: str) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / name, tmp_path / "scripts" / name)
    return tmp_path / "scripts" / name


FAKE_CHUNKSERVE = r"""#!/usr/bin/env bash
# serve: says where it serves (its --port / --port=N, else $CHUNKSERVE_PORT, else 50051), then
# stays up until generate has been called; generate: records its arguments.
here=$(cd "$(dirname "$0")" && pwd)
if [ "$1" = serve ]; then
  port=${CHUNKSERVE_PORT:-50051}
  while [ $# -gt 0 ]; do
    case "$1" in --port) port=$2; shift ;; --port=*) port=${1#--port=} ;; esac
    shift
  done
  echo "some log line"
  echo "chunkserve: serving on 0.0.0.0:$port"
  while [ ! -e "$here/generate.args" ]; do sleep 0.1; done
  exit 0
fi
shift
echo "$*" > "$here/generate.args.tmp" && mv "$here/generate.args.tmp" "$here/generate.args"
echo "Paris"
"""


@pytest.mark.parametrize(
    "args, env, address",
    [
        (["--port", "50551"], {}, "127.0.0.1:50551"),
        (["--max-num-seqs", "4", "--port=50552"], {}, "127.0.0.1:50552"),
        ([], {"CHUNKSERVE_PORT": "50553"}, "127.0.0.1:50553"),
        ([], {}, "127.0.0.1:50051"),
    ],
)
def test_quickstart_asks_the_port_the_server_was_given(tmp_path, args, env, address):
    script = _script_copy(tmp_path, "quickstart.sh")
    (tmp_path / "scripts" / "setup.sh").write_text("#!/usr/bin/env bash\n")
    (tmp_path / "scripts" / "setup.sh").chmod(0o755)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "chunkserve").write_text(FAKE_CHUNKSERVE)
    (bin_dir / "chunkserve").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSERVE_")} | env
    done = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    recorded = (bin_dir / "generate.args").read_text()
    assert recorded.startswith(f"--address {address} "), recorded
    assert f"serving on {address}" in done.stdout


def test_quickstart_stops_when_the_server_exits_during_start_up(tmp_path):
    script = _script_copy(tmp_path, "quickstart.sh")
    (tmp_path / "scripts" / "setup.sh").write_text("#!/usr/bin/env bash\n")
    (tmp_path / "scripts" / "setup.sh").chmod(0o755)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "chunkserve").write_text(
        "#!/usr/bin/env bash\necho 'chunkserve serve: --port 1 is in use' >&2\nexit 2\n"
    )
    (bin_dir / "chunkserve").chmod(0o755)
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "exited during start-up" in done.stderr


@pytest.mark.skipif(subprocess.run([sys.executable, "-m", "ensurepip", "--version"]).returncode, reason="no ensurepip")
@pytest.mark.parametrize("broken", ["no-pip", "no-python"])
def test_setup_makes_a_broken_venv_again(tmp_path, broken):
    """A first setup.sh interrupted while making .venv leaves it without pip (or without
    python): the next run makes it again instead of failing with "No module named pip"."""
    script = _script_copy(tmp_path, "setup.sh")
    venv = tmp_path / ".venv"
    if broken == "no-pip":
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        assert subprocess.run([venv / "bin" / "python", "-m", "pip", "--version"], capture_output=True).returncode
    else:
        (venv / "lib").mkdir(parents=True)
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(["bash", str(script), "--venv-only"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "broken" in done.stderr
    subprocess.run([venv / "bin" / "python", "-m", "pip", "--version"], check=True, capture_output=True)
    # A sound venv is left alone.
    again = subprocess.run(["bash", str(script), "--venv-only"], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "broken" not in again.stderr


def test_the_default_model_is_served_by_its_hub_id_as_vllm_names_it():
    from chunkserve.cli import served_name

    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert served_name(hub, None) == hub and served_name("default", None) == hub
    assert served_name(hub, "mine") == "mine"
    assert served_name("/models/llama", None) is None  # the executor names it: the folder as given
