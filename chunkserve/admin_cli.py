"""`chunkserve admin ...`: read and change a running server's scheduling without a restart."""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from google.protobuf import json_format

from chunkserve_contracts.auth import ADMIN_TOKEN_ENV, bearer_metadata
from chunkserve_contracts.flags import env_name
from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc


def _budget(text: str) -> int:
    """A token budget, or `auto` (0: the executor's limit, with --target-itl-ms)."""
    return 0 if text.strip().lower() == "auto" else int(text)


_budget.__name__ = "int"  # argparse says "invalid int value"

_SETTINGS = {  # flag -> (SchedulingConfig field, type)
    "--policy": ("policy", str),
    "--max-num-batched-tokens": ("max_num_batched_tokens", _budget),
    "--target-itl-ms": ("target_itl_ms", float),
    "--max-num-seqs": ("max_num_seqs", int),
    "--max-num-partial-prefills": ("max_num_partial_prefills", int),
    "--max-long-partial-prefills": ("max_long_partial_prefills", int),
    "--long-prefill-token-threshold": ("long_prefill_token_threshold", int),
}


DEFAULT_ADMIN_PORT = 50052  # scheduler_svc.config.SchedulerConfig.admin_port (not imported: this side stays light)


def _error_line(exc: grpc.RpcError, address: str) -> str:
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE and "connect" in (exc.details() or "").lower():
        return f"no Admin service at {address} (start the server with --admin-port {address.rpartition(':')[2]})"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (
            f"the Admin service at {address} refused this call (UNAUTHENTICATED): set {ADMIN_TOKEN_ENV} to the "
            "server's --admin-token"
        )
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (
            f"the server at {address} does not serve chunkserve.v1.Admin: that is another port (the public "
            f"API's or the executor's?); the Admin service is on `chunkserve serve --admin-port` (default "
            f"{DEFAULT_ADMIN_PORT})"
        )
    return f"{code.name}: {exc.details()}"


def add_admin_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("admin", help="inspect or reconfigure a running server (Admin service)")
    port = os.environ.get(env_name("admin_port"), "")  # the server's, when this shell started it
    default = f"127.0.0.1:{port if port not in ('', '0') else DEFAULT_ADMIN_PORT}"
    p.add_argument(
        "--address",
        default=default,
        help=f"host:port of the Admin service, the server's --admin-port (default {default}; on by default)",
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get(ADMIN_TOKEN_ENV),
        help=f"the server's --admin-token, when it has one; better through the environment [env {ADMIN_TOKEN_ENV}]",
    )
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("config", help="print the live scheduling configuration and state")
    setp = actions.add_parser("set", help="change settings at the next step boundary (validated, atomic)")
    for flag, (_, kind) in _SETTINGS.items():
        setp.add_argument(flag, type=kind)
    setp.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    actions.add_parser("watch-steps", help="stream the step trace as JSON lines until Ctrl-C")
    actions.add_parser("reset-prefix-cache", help="forget every cached prefix block")


def run_admin(args: argparse.Namespace) -> int:
    stub = pb_grpc.AdminStub(grpc.insecure_channel(args.address))
    md = bearer_metadata(args.admin_token)
    try:
        if args.action == "config":
            print(json_format.MessageToJson(stub.GetConfig(pb.GetConfigRequest(), metadata=md, timeout=10)))
        elif args.action == "set":
            update = pb.SchedulingConfig()
            for flag, (field, _) in _SETTINGS.items():
                value = getattr(args, flag.removeprefix("--").replace("-", "_"))
                if value is not None:
                    setattr(update, field, value)
            if args.enable_chunked_prefill is not None:
                update.enable_chunked_prefill = args.enable_chunked_prefill
            print(json_format.MessageToJson(stub.UpdateConfig(update, metadata=md, timeout=10)))
        elif args.action == "reset-prefix-cache":
            print(
                stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), metadata=md, timeout=10).num_blocks_dropped,
                "blocks dropped",
            )
        else:
            for trace in stub.WatchSteps(pb.WatchStepsRequest(), metadata=md):
                print(json_format.MessageToJson(trace, indent=None), flush=True)
    except grpc.RpcError as exc:
        sys.stderr.write(f"chunkserve admin: {_error_line(exc, args.address)}\n")
        return 1
    except KeyboardInterrupt:
        pass
    return 0
