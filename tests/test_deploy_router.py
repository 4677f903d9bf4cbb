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
from scheduler_svc.config import SchedulerConfig

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.router.yml"
K8S = sorted((REPO / "deploy" / "k8s").glob("*.yaml"))
SCHEMA = REPO / "tests" / "data" / "compose-spec" / "compose-spec.json"
K8S_VERSION = "1.30.0"  # the oldest release the manifests promise (gRPC probes are GA since 1.27)
GENERATION = "chunkserve.v1.Generation"


def serve_env() -> set[str]:
    fields = [*dataclasses.fields(SchedulerConfig), *dataclasses.fields(ExecutorConfig)]
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
    """${VAR:-default} -> default (the variables unset), as compose does."""
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
    assert replica["environment"]["CHUNKSERVE_ADMIN_HOST"] == "0.0.0.0"  # the router reads events there
    assert (
        router["environment"]["CHUNKSERVE_ROUTER_REPLICA_ADMIN_PORT"] == replica["environment"]["CHUNKSERVE_ADMIN_PORT"]
    )


def k8s_docs() -> list[dict]:
    return [doc for path in K8S for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_manifests_validate_against_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = k8s_docs()
    assert {d["kind"] for d in docs} == {"StatefulSet", "Service", "Deployment"}
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
    renv = {e["name"]: e.get("value") for e in rc["env"]}
    oenv = {e["name"]: e.get("value") for e in ro["env"]}
    assert set(renv) <= serve_env(), set(renv) - serve_env()
    assert set(oenv) <= router_env(), set(oenv) - router_env()
    assert oenv["CHUNKSERVE_ROUTER_REPLICA_DNS"] == headless["metadata"]["name"]
    assert oenv["CHUNKSERVE_ROUTER_REPLICA_ADMIN_PORT"] == renv["CHUNKSERVE_ADMIN_PORT"]
    assert renv["CHUNKSERVE_ADMIN_HOST"] == "0.0.0.0"
    for container in (rc, ro):
        assert container["readinessProbe"]["grpc"] == {"port": 50051, "service": GENERATION}
        assert "grpc" in container["livenessProbe"]
        assert {"cpu", "memory"} <= container["resources"]["requests"].keys() <= container["resources"]["limits"].keys()
    assert rc["startupProbe"]["grpc"]["service"] == GENERATION
