"""`python -m chunkserve.healthcheck`: a container health probe for either service.

    python -m chunkserve.healthcheck --target scheduler [--address 127.0.0.1:50051]
    python -m chunkserve.healthcheck --target executor  [--address 127.0.0.1:50061]

Exit status 0 = healthy, 1 = not (one line on stderr says why), as Docker's HEALTHCHECK and
compose's `healthcheck.test` expect (2 is reserved there, so a usage error also exits 1).

- scheduler: the standard grpc.health.v1 Check of `chunkserve.v1.Generation` (`--service`
  changes it; `""` is "process alive") must answer SERVING, i.e. the executor handshake is
  done and requests are accepted.
- executor: its Handshake RPC must answer; a reply means the model is loaded and serving.
  The probe sends the executor token from CHUNKSERVE_EXECUTOR_TOKEN when it is set (it is,
  in the executor's container, when the deployment sets one).

The default address is loopback on the port the service itself was configured with
(CHUNKSERVE_PORT, CHUNKSERVE_EXECUTOR_PORT, else 50051 / 50061), so inside a container the
probe needs no arguments beyond `--target`. It imports grpc and the generated stubs only:
no torch, so it costs a fraction of a second and little memory per probe.
"""

from __future__ import annotations

import argparse
import os
import sys

TARGETS = {  # target -> (port environment variable, default port)
    "scheduler": ("CHUNKSERVE_PORT", 50051),
    "executor": ("CHUNKSERVE_EXECUTOR_PORT", 50061),
}
READY_SERVICE = "chunkserve.v1.Generation"
# Never route a loopback probe through an HTTP proxy a container may have in its environment.
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


def default_address(target: str) -> str:
    var, port = TARGETS[target]
    return f"127.0.0.1:{os.environ.get(var) or port}"


def check_scheduler(address: str, service: str, timeout: float) -> str:
    """Returns a description when `service` is SERVING; raises RuntimeError otherwise."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            raise RuntimeError(_rpc_error(exc)) from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise RuntimeError(
            f"service {service!r} is {status}" + (" (waiting for the executor?)" if service == READY_SERVICE else "")
        )
    return f"service {service!r} is {status}"


def check_executor(address: str, timeout: float, token: str | None = None) -> str:
    """Returns a description when the executor answers its Handshake; raises RuntimeError otherwise."""
    import grpc

    from chunkserve_contracts.auth import bearer_metadata
    from chunkserve_contracts.executor.v1 import executor_pb2 as epb
    from chunkserve_contracts.executor.v1 import executor_pb2_grpc as epb_grpc

    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        try:
            # scheduler_version names the caller in the executor's "handshake from" log line.
            hs = epb_grpc.ExecutorStub(channel).Handshake(
                epb.HandshakeRequest(scheduler_version="healthcheck"), timeout=timeout, metadata=bearer_metadata(token)
            )
        except grpc.RpcError as exc:
            raise RuntimeError(_rpc_error(exc)) from None
    return f"serving {hs.model_name} ({hs.dtype} on {hs.device}, {hs.num_device_blocks} KV blocks)"


def _rpc_error(exc: object) -> str:
    code = getattr(exc, "code", lambda: None)()
    details = getattr(exc, "details", lambda: None)() or ""
    name = code.name if code is not None else "ERROR"
    return f"{name}: {details.splitlines()[0] if details else 'no details'}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # exit 1, never Docker's reserved 2
        self.exit(1, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(
        prog="python -m chunkserve.healthcheck",
        description="Health probe: exit 0 when the service is ready, 1 otherwise.",
    )
    parser.add_argument("--target", required=True, choices=sorted(TARGETS), help="which service to probe")
    parser.add_argument(
        "--address",
        help="host:port (default: 127.0.0.1 and $CHUNKSERVE_PORT / $CHUNKSERVE_EXECUTOR_PORT, else 50051 / 50061)",
    )
    parser.add_argument(
        "--service",
        default=READY_SERVICE,
        help=f"scheduler only: grpc.health.v1 service to check (default {READY_SERVICE!r}; '' = process alive)",
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the reply (default 3)")
    args = parser.parse_args(argv)
    address = args.address or default_address(args.target)
    try:
        if args.target == "scheduler":
            what = check_scheduler(address, args.service, args.timeout)
        else:
            what = check_executor(address, args.timeout, os.environ.get("CHUNKSERVE_EXECUTOR_TOKEN") or None)
    except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy", said in one line
        print(f"unhealthy: {args.target} at {address}: {exc}", file=sys.stderr)
        return 1
    print(f"healthy: {args.target} at {address}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
