"""Who may call the scheduler's admin port (`--admin-port`): AdminAccess, its flags and check.

The admin port serves the Admin service (WatchSteps, GetConfig; ResetPrefixCache and
UpdateConfig, which change the running server) and the Replica service a router reads
(WatchKVEvents, whose events carry the prompts' token ids, and GetLoad). With `--admin-token`
every call but health and reflection must carry it; `--admin-read-token` is accepted for the
Replica service only, so the router can hold a token that cannot change anything. A port
beyond loopback without a token is refused at start-up unless `--admin-allow-unauthenticated`
(chunkserve_contracts.auth.check_admin_bind). A module of its own, apart from SchedulerConfig,
so the command lines build it without importing the scheduler.
"""

from __future__ import annotations

import dataclasses

from chunkserve_contracts.auth import BearerTokenInterceptor, check_admin_bind
from chunkserve_contracts.v1 import replica_pb2

REPLICA_METHODS = f"/{replica_pb2.DESCRIPTOR.services_by_name['Replica'].full_name}/"


@dataclasses.dataclass(frozen=True)
class AdminAccess:
    """Who may call the admin port. Flags and environment variables like SchedulerConfig's
    (chunkserve_contracts/flags.py): `--admin-token` is CHUNKSERVE_ADMIN_TOKEN."""

    admin_token: str | None = dataclasses.field(
        default=None,
        repr=False,
        metadata={
            "secret": True,
            "help": "require `authorization: Bearer <token>` on every call to the admin port (Admin and Replica "
            "services; health and reflection stay open); needed when --admin-host is not loopback; set it "
            "through the environment, not the command line",
        },
    )
    admin_read_token: str | None = dataclasses.field(
        default=None,
        repr=False,
        metadata={
            "secret": True,
            "help": "a second token the admin port accepts for the read-only Replica service only (KV events, "
            "load): the one to give a router (`chunkserve router`: CHUNKSERVE_ROUTER_REPLICA_ADMIN_TOKEN)",
        },
    )
    admin_allow_unauthenticated: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "serve the admin port beyond loopback without --admin-token (anyone who reaches it may change "
            "live settings and read prompts' token ids): only where a network policy admits trusted callers alone"
        },
    )

    def check(self, host: str) -> None:
        """ValueError (one line naming the flags) for a port beyond loopback with no token."""
        if self.admin_read_token and not self.admin_token:
            raise ValueError("--admin-read-token needs --admin-token (the Admin service would be open)")
        check_admin_bind(host, self.admin_token, self.admin_allow_unauthenticated)

    def interceptors(self) -> list[BearerTokenInterceptor]:
        if not self.admin_token:
            return []
        denial = "missing or wrong admin token (--admin-token; the Replica service also takes --admin-read-token)"
        return [BearerTokenInterceptor(self.admin_token, denial, scoped={REPLICA_METHODS: self.admin_read_token})]
