"""A small client for chunkserve.v1 (used by `chunkserve generate`, tests and benchmarks)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import grpc

from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc


def build_request(
    prompt: str | list[int] | list[dict[str, str]], cache_salt: str = "", **sampling: object
) -> pb.GenerateRequest:
    """A GenerateRequest from text, token ids or chat messages; sampling as keyword fields."""
    req = pb.GenerateRequest(
        sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}), cache_salt=cache_salt
    )
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.chat.messages.extend(pb.ChatMessage(**m) for m in prompt)  # type: ignore[arg-type]
    else:
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    return req


@dataclass
class Completion:
    """A whole streamed completion, and the messages it came in."""

    request_id: str = ""
    client_request_id: str = ""  # the echo; the server sends it in the first message only
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    deltas: list[str] = field(default_factory=list)
    finish_reason: int = 0
    matched_stop: str = ""
    usage: pb.Usage | None = None
    num_messages: int = 0
    logprobs: list[pb.Logprobs] = field(default_factory=list)
    prompt_logprobs: list[pb.Logprobs] = field(default_factory=list)  # SamplingParams.prompt_logprobs
    prompt_token_ids: list[int] = field(default_factory=list)

    def add(self, msg: pb.GenerateResponse) -> None:
        self.request_id = msg.request_id
        if self.num_messages == 0:
            self.client_request_id = msg.client_request_id
        self.token_ids += msg.token_ids
        self.text += msg.text
        self.deltas.append(msg.text)
        self.logprobs += msg.logprobs
        self.prompt_logprobs += msg.prompt_logprobs
        self.prompt_token_ids += msg.prompt_token_ids
        self.num_messages += 1
        if msg.finished:
            self.finish_reason = msg.finish_reason
            self.matched_stop = msg.matched_stop
            self.usage = msg.usage


def generate_cli(args: argparse.Namespace) -> int:
    """`chunkserve generate`: prints the text as it streams; returns an exit code."""
    prompt: str | list[dict[str, str]] = args.prompt
    if args.chat:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
    req = build_request(
        prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        ignore_eos=args.ignore_eos or None,
        logprobs=args.logprobs,
    )
    req.sampling.stop.extend(args.stop)
    req.sampling.bad_words.extend(args.bad_word)
    target = args.address or f"{args.host}:{args.port}"  # --host/--port: the old spelling, still taken
    host, _, port = target.rpartition(":")
    if host in ("0.0.0.0", "::", "[::]", ""):
        target = f"127.0.0.1:{port}"
    if args.tls_ca_file:
        with open(args.tls_ca_file, "rb") as ca:
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(ca.read()))
    else:
        channel = grpc.insecure_channel(target)
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
    with channel:
        stub = pb_grpc.GenerationStub(channel)
        streamed = False  # whether text was written: then an error starts on a line of its own
        try:
            for msg in stub.Generate(req, timeout=args.timeout, metadata=metadata):
                streamed = streamed or bool(msg.text)
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if args.logprobs is not None:
                    for tid, lp in zip(msg.token_ids, msg.logprobs):
                        alts = ", ".join(f"{t.text!r}:{t.logprob:.2f}" for t in lp.top)
                        sys.stderr.write(f"\n  [{tid} {lp.logprob:.3f}] {alts}")
                if msg.finished:
                    reason = pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
                    sys.stderr.write(
                        f"\n[{reason}; prompt {msg.usage.prompt_tokens} tokens, "
                        f"completion {msg.usage.completion_tokens} tokens]\n"
                    )
        except grpc.RpcError as exc:
            line = rpc_error_line(exc, target, "chunkserve.v1.Generation")
            sys.stderr.write(("\n" if streamed else "") + f"chunkserve generate: {line}\n")
            return 1
    return 0


def rpc_error_line(exc: grpc.RpcError, address: str, service: str) -> str:
    """One line for a failed call to `service` at `address`: no server there, or a server that
    is not the public API (the Admin or executor port), said as such; else code and details."""
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE and "connect" in (exc.details() or "").lower():
        return f"no server answers at {address} ({exc.details()}); is `chunkserve serve` running, on that port?"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (
            f"the server at {address} does not serve {service}: the public API is on the port given to "
            "`chunkserve serve --port` (default 50051); that port may be the Admin or executor port"
        )
    return f"{code.name}: {exc.details()}"
