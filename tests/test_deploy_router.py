"""Data-parallel deployment: docker-compose.router.yml against the compose spec, and the
Kubernetes manifests in deploy/k8s against the Kubernetes schemas (kubernetes-validate
bundles them: offline), each checked for what the router relies on."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from executor_svc.config import ExecutorConfig
from scheduler_svc.admin_access import AdminAccess
from scheduler_svc.config import SchedulerConfig

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.router.yml"
K8S = sorted((REPO / "deploy" / "k8s").glob("*.yaml"))
SCHEMA = REPO / "tests" / "data" / "compose-spec" / "compose-spec.json"
K8S_VERSION = "1.30.0"  # the oldest release the manifests promise (gRPC probes are GA since 1.27)
GENERATION = "chunkserve.v1.Generation"


def serve_env() -> set[str]:
    fields = [
        *dataclasses.fields(SchedulerConfig),
        *dataclasses.fields(ExecutorConfig),
        *dataclasses.fields(AdminAccess),
    ]
    return {"CHUNKSERVE_" + f.name.upper() for f in fields if f.metadata.get("help")} | {
        "CHUNKSERVE_CACHE_DIR",  # read by the executor's cache (executor_svc.config.default_cache_dir)
        "HF_HUB_OFFLINE",
    }


def router_env() -> set[str]:
    from chunkserve.router.cli import add_router_parser

    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices["router"]  # type: ignore[union-attr]
    return {"CHUNKSERVE_ROUTER_" + a.dest.upper() for a in sub._actions if a.dest != "help"}


def interpolate(text: str) -> str:
    """${VAR:-default} -> default (the variables unset), as compose does; ${VAR:?message}, which
    compose refuses to start without, -> <VAR>, the operator's value."""
    text = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*):\?[^}]*\}", r"<\1>", text)
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", text)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(interpolate(COMPOSE.read_text()))


def test_compose_file_is_valid_and_only_the_router_is_published(compose):
    import json

    jsonschema.validate(compose, json.loads(SCHEMA.read_text()))
    assert "$" not in interpolate(COMPOSE.read_text()).replace("$$", "")
    replica, router = compose["services"]["replica"], compose["services"]["router"]
    assert replica["command"] == ["chunkserve", "serve"] and router["command"] == ["chunkserve", "router"]
    assert "ports" not in replica and replica["networks"] == ["internal"]
    assert int(replica["deploy"]["replicas"]) == 2
    assert router["environment"]["CHUNKSERVE_ROUTER_REPLICA_DNS"] == "replica"  # Docker's DNS: every replica
    assert router["depends_on"]["replica"]["condition"] == "service_healthy"
    assert set(replica["environment"]) <= serve_env(), set(replica["environment"]) - serve_env()
    assert set(router["environment"]) <= router_env(), set(router["environment"]) - router_env()
    renv, oenv = replica["environment"], router["environment"]
    assert renv["CHUNKSERVE_ADMIN_HOST"] == "0.0.0.0"  # the router reads events there ...
    # ... so the admin port needs tokens, which compose refuses to start without (no default),
    # and the router holds only the read token: it cannot change a replica.
    assert renv["CHUNKSERVE_ADMIN_TOKEN"] == "<CHUNKSERVE_ADMIN_TOKEN>"
    assert renv["CHUNKSERVE_ADMIN_READ_TOKEN"] == "<CHUNKSERVE_ADMIN_READ_TOKEN>"
    assert oenv["CHUNKSERVE_ROUTER_REPLICA_ADMIN_TOKEN"] == "<CHUNKSERVE_ADMIN_READ_TOKEN>"
    assert not any("<CHUNKSERVE_ADMIN_TOKEN>" in str(v) for v in oenv.values())
    assert "CHUNKSERVE_ADMIN_ALLOW_UNAUTHENTICATED" not in renv
    assert (
        router["environment"]["CHUNKSERVE_ROUTER_REPLICA_ADMIN_PORT"] == replica["environment"]["CHUNKSERVE_ADMIN_PORT"]
    )


def k8s_docs() -> list[dict]:
    return [doc for path in K8S for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_manifests_validate_against_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = k8s_docs()
    assert {d["kind"] for d in docs} == {"StatefulSet", "Service", "Deployment", "NetworkPolicy"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any unknown or wrong field
    broken = {**docs[0], "spec": {**docs[0]["spec"], "replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_manifests_wire_the_router_to_the_replicas():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs()}
    replicas = docs[("StatefulSet", "chunkserve-replica")]
    headless = docs[("Service", "chunkserve-replicas")]
    router = docs[("Deployment", "chunkserve-router")]
    assert headless["spec"]["clusterIP"] == "None" and replicas["spec"]["serviceName"] == "chunkserve-replicas"
    assert headless["spec"]["selector"].items() <= replicas["spec"]["template"]["metadata"]["labels"].items()
    front = docs[("Service", "chunkserve")]
    assert front["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    (rc,) = replicas["spec"]["template"]["spec"]["containers"]
    (ro,) = router["spec"]["template"]["spec"]["containers"]
    renv = {e["name"]: e.get("value") or e.get("valueFrom") for e in rc["env"]}
    oenv = {e["name"]: e.get("value") or e.get("valueFrom") for e in ro["env"]}
    assert set(renv) <= serve_env(), set(renv) - serve_env()
    assert set(oenv) <= router_env(), set(oenv) - router_env()
    assert oenv["CHUNKSERVE_ROUTER_REPLICA_DNS"] == headless["metadata"]["name"]
    assert oenv["CHUNKSERVE_ROUTER_REPLICA_ADMIN_PORT"] == renv["CHUNKSERVE_ADMIN_PORT"]
    assert renv["CHUNKSERVE_ADMIN_HOST"] == "0.0.0.0"
    # The admin port beyond loopback: tokens from a Secret, the router with the read token only.
    secret = {"name": "chunkserve-admin"}
    assert renv["CHUNKSERVE_ADMIN_TOKEN"] == {"secretKeyRef": {**secret, "key": "admin-token"}}
    assert renv["CHUNKSERVE_ADMIN_READ_TOKEN"] == {"secretKeyRef": {**secret, "key": "read-token"}}
    assert oenv["CHUNKSERVE_ROUTER_REPLICA_ADMIN_TOKEN"] == renv["CHUNKSERVE_ADMIN_READ_TOKEN"]
    assert "CHUNKSERVE_ADMIN_ALLOW_UNAUTHENTICATED" not in renv
    # The NetworkPolicy admits the router (and only labelled pods) to the admin port.
    policy = docs[("NetworkPolicy", "chunkserve-replica-admin")]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= replicas["spec"]["template"]["metadata"]["labels"].items()
    (admin_rule,) = [rule for rule in policy["ingress"] if {"port": "admin"} in rule["ports"]]
    (allowed,) = admin_rule["from"]
    assert allowed["podSelector"]["matchLabels"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    for container in (rc, ro):
        assert container["readinessProbe"]["grpc"] == {"port": 50051, "service": GENERATION}
        assert "grpc" in container["livenessProbe"]
        assert {"cpu", "memory"} <= container["resources"]["requests"].keys() <= container["resources"]["limits"].keys()
    assert rc["startupProbe"]["grpc"]["service"] == GENERATION
