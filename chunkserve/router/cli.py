"""`chunkserve router`'s flags (each also an environment variable CHUNKSERVE_ROUTER_<NAME>)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from chunkserve.router.legs import TRANSPORTS
from chunkserve.router.scoring import POLICIES
from chunkserve_contracts.auth import check_admin_bind

HELP = "route requests across chunkserve replicas by cached prefix, predicted TTFT and load"


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get("CHUNKSERVE_ROUTER_" + name.upper(), default)


def add_router_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help=HELP, description=HELP + " (docs/deploy.md).")
    p.add_argument(
        "--replica",
        action="append",
        default=[r for r in (_env("replica") or "").split() if r],
        help="a replica: HOST:PORT (its public gRPC API)[,admin=PORT (its --admin-port, default PORT+1)]"
        "[,http=PORT (its --http-port; needed to route the OpenAI API to it)]; repeatable",
    )
    p.add_argument(
        "--replica-dns",
        default=_env("replica_dns"),
        help="a DNS name whose A records are replicas (a Kubernetes headless Service), re-resolved every few seconds",
    )
    p.add_argument(
        "--replica-port",
        type=int,
        default=int(_env("replica_port", "50051")),
        help="public gRPC port of replicas found through --replica-dns",
    )
    p.add_argument(
        "--replica-admin-port",
        type=int,
        default=int(_env("replica_admin_port", "50052")),
        help="admin port of replicas found through --replica-dns (they need --admin-host 0.0.0.0)",
    )
    p.add_argument(
        "--replica-http-port",
        type=int,
        default=int(_env("replica_http_port", "8000")),
        help="HTTP port of replicas found through --replica-dns (0: none)",
    )
    p.add_argument("--host", default=_env("host", "0.0.0.0"), help="address of the router's gRPC API")
    p.add_argument("--port", type=int, default=int(_env("port", "50051")), help="port of the router's gRPC API")
    p.add_argument("--http-host", default=_env("http_host", "0.0.0.0"))
    p.add_argument(
        "--http-port",
        type=int,
        default=int(_env("http_port", "8000")),
        help="port of the router's OpenAI-compatible HTTP API; 0 = off",
    )
    p.add_argument("--admin-host", default=_env("admin_host", "127.0.0.1"))
    p.add_argument(
        "--admin-port",
        type=int,
        default=int(_env("admin_port", "50052")),
        help="port of the chunkserve.v1.Router service (ListReplicas, DrainReplica); 0 = off",
    )
    p.add_argument("--metrics-host", default=_env("metrics_host", "0.0.0.0"))
    p.add_argument(
        "--metrics-port", type=int, default=int(_env("metrics_port", "9400")), help="Prometheus /metrics port; 0 = off"
    )
    p.add_argument(
        "--tokenizer",
        default=_env("tokenizer"),
        help="the replicas' model folder (its tokenizer.json "
        "and chat template): text and chat prompts are hashed as the replicas hash them; without it "
        "only token-id prompts are routed by cache",
    )
    p.add_argument("--policy", choices=POLICIES, default=_env("policy", "cache_aware"))
    p.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=int(_env("balance_abs_threshold", "32")),
        help="cache_aware falls back to least-loaded when the busiest replica has more than this many "
        "requests more than the idlest ...",
    )
    p.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=float(_env("balance_rel_threshold", "1.5")),
        help="... and more than this many times as many",
    )
    p.add_argument(
        "--api-key",
        default=_env("api_key") or os.environ.get("CHUNKSERVE_API_KEY"),
        help=argparse.SUPPRESS,  # secret: CHUNKSERVE_ROUTER_API_KEY or CHUNKSERVE_API_KEY, never the command line
    )
    p.add_argument(
        "--admin-token",
        default=_env("admin_token"),
        help=argparse.SUPPRESS,  # secret: CHUNKSERVE_ROUTER_ADMIN_TOKEN, never the command line
    )
    p.add_argument(
        "--admin-allow-unauthenticated",
        action=argparse.BooleanOptionalAction,
        default=(_env("admin_allow_unauthenticated", "") or "").lower() in ("1", "true", "yes", "on"),
        help="serve --admin-port beyond loopback without CHUNKSERVE_ROUTER_ADMIN_TOKEN (anyone who reaches it may "
        "drain replicas): only where a network policy admits trusted callers alone",
    )
    p.add_argument(
        "--replica-admin-token",
        default=_env("replica_admin_token"),
        help=argparse.SUPPRESS,  # secret: CHUNKSERVE_ROUTER_REPLICA_ADMIN_TOKEN, the replicas' --admin-read-token
    )
    p.add_argument(
        "--replica-transport",
        choices=TRANSPORTS,
        default=_env("replica_transport", "mux"),
        help="how requests travel to a replica: mux (default), all of them on one multiplexed stream per replica, "
        "their messages batched per engine step; call, one Generate call each, the client's key forwarded on it "
        "(also used for a replica that refuses the stream: an older chunkserve)",
    )
    p.add_argument("--health-interval-s", type=float, default=float(_env("health_interval_s", "1.0")))
    p.add_argument("--load-interval-s", type=float, default=float(_env("load_interval_s", "0.1")))


def config_from(args: argparse.Namespace):
    from chunkserve.router.app import RouterConfig
    from chunkserve.router.replicas import Intervals, parse_replica

    replicas = [parse_replica(r) for r in args.replica]
    dns = None
    if args.replica_dns:
        dns = (args.replica_dns, args.replica_port, args.replica_admin_port, args.replica_http_port)
    if args.health_interval_s <= 0 or args.load_interval_s <= 0:
        raise ValueError("--health-interval-s and --load-interval-s must be > 0")
    if args.admin_port:
        check_admin_bind(
            args.admin_host, args.admin_token, args.admin_allow_unauthenticated, "CHUNKSERVE_ROUTER_ADMIN_TOKEN"
        )
    return RouterConfig(
        replicas=replicas,
        dns=dns,
        host=args.host,
        port=args.port,
        http_host=args.http_host,
        http_port=args.http_port,
        admin_host=args.admin_host,
        admin_port=args.admin_port,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        tokenizer=args.tokenizer,
        policy=args.policy,
        balance_abs=args.balance_abs_threshold,
        balance_rel=args.balance_rel_threshold,
        intervals=Intervals(health_s=args.health_interval_s, load_s=args.load_interval_s),
        api_key=args.api_key or None,
        admin_token=args.admin_token or None,
        admin_allow_unauthenticated=args.admin_allow_unauthenticated,
        replica_admin_token=args.replica_admin_token or None,
        replica_transport=args.replica_transport,
    )


def run_router_cli(args: argparse.Namespace) -> int:
    import uvloop

    from chunkserve.router.app import run_router

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from(args)
        if not config.replicas and config.dns is None:
            raise ValueError("give the replicas: --replica HOST:PORT (repeatable) and/or --replica-dns NAME")
    except ValueError as exc:
        print(f"chunkserve router: {exc}", file=sys.stderr)
        return 2

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            return await run_router(config, stop)
        except ValueError as exc:
            logging.getLogger("chunkserve.router").error("%s", exc)
            return 2

    return uvloop.run(main())
