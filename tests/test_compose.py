"""docker-compose.yml. Everywhere: every command in it is run as a real `cgad-node` invocation that
validates the full configuration (join --dry-run), and the bootstrap multiaddr the workers dial is
checked against the bootstrap's key file. Where a Docker engine runs: `make compose-up` builds the
image and starts the three containers, they train together until the bootstrap's metrics on the
host show both workers' fragments applied, and `make compose-down` removes them."""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cgad.node.front.cli import build_parser
from cgad.protocol.records import Identity

ROOT = Path(__file__).resolve().parent.parent
CLI = str(Path(sys.executable).with_name("cgad-node"))
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_service_command_is_a_valid_join(name, tmp_path):
    command = SERVICES[name]["command"]
    assert command[0] == "join"
    env = {**os.environ, "CGAD_CACHE_DIR": str(tmp_path)}
    result = subprocess.run(
        [CLI, *command, "--dry-run"], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert '"run_id": "compose-demo"' in result.stdout


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_healthcheck_is_a_cgad_node_command(name):
    test = SERVICES[name]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "cgad-node"]
    args = build_parser().parse_args(test[2:])
    assert args.command == "status"
    assert args.admin == "127.0.0.1:7780"
    assert "--admin-port=7780" in SERVICES[name]["command"]


def test_workers_dial_the_bootstrap_peer_id():
    peer_id = Identity.load_or_create(str(ROOT / "docker" / "bootstrap.key")).peer_id
    for name, service in SERVICES.items():
        peers = [arg.split("=", 1)[1] for arg in service["command"] if arg.startswith("--peers=")]
        if name == "bootstrap":
            assert not peers
        else:
            assert peers == [f"/dns4/bootstrap/tcp/31337/p2p/{peer_id}"]


def test_every_volume_is_declared_and_checkpoints_are_per_node():
    declared = set(COMPOSE["volumes"])
    checkpoint_volumes = []
    for service in SERVICES.values():
        for mount in service["volumes"]:
            source, target = mount.split(":")[:2]
            if not source.startswith("."):
                assert source in declared
            if target == "/checkpoints":
                checkpoint_volumes.append(source)
    assert len(set(checkpoint_volumes)) == len(SERVICES)


def test_dockerfile_runs_the_cli():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["cgad-node"]' in dockerfile
    assert "torch==2.13.0" in dockerfile


def test_the_image_takes_its_base_as_a_build_argument():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim\nFROM ${BASE_IMAGE}\n" in dockerfile
    for service in SERVICES.values():
        assert service["build"]["args"]["BASE_IMAGE"] == "${CGAD_BASE_IMAGE:-python:3.11-slim}"


# --- the network itself, where an engine runs -------------------------------------------------------

PROJECT = "cgad-node"  # the Makefile's COMPOSE_PROJECT
METRICS = "http://127.0.0.1:9100/metrics"
DASHBOARD = "http://127.0.0.1:7781/api/status"
TRAIN_DEADLINE_S = 600  # docs/USAGE.md promises both workers applied within 10 minutes of the start


def _engine_missing() -> str | None:
    """Why the compose network cannot run here, or None when it can."""
    if shutil.which("docker") is None:
        return "no docker command"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["no output"])[-1]
        return f"no Docker engine runs here (docker info: {last})"
    has_plugin = subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    if not has_plugin and shutil.which("docker-compose") is None:
        return "neither `docker compose` nor `docker-compose` is installed"
    running = subprocess.run(
        ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split()
    if running:
        return f"a compose network '{PROJECT}' is already up here: this test would take it down"
    return None


def _compose(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    has_plugin = subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    command = ["docker", "compose"] if has_plugin else ["docker-compose"]
    return subprocess.run(
        [*command, "-p", PROJECT, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read()
    except OSError:
        return None


def _metrics() -> dict[str, float]:
    body = _get(METRICS)
    if body is None:
        return {}
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if not sample.labels
    }


def _worker_status(name: str) -> dict | None:
    result = _compose("exec", "-T", name, "cgad-node", "status", "--admin", "127.0.0.1:7780", "--json")
    return json.loads(result.stdout) if result.returncode == 0 else None


@pytest.mark.system
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_compose_network_trains_together():
    reason = _engine_missing()
    if reason:
        pytest.skip(reason)
    started = time.monotonic()
    up = subprocess.run(["make", "compose-up"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        built_s = time.monotonic() - started
        deadline = time.monotonic() + TRAIN_DEADLINE_S
        workers: dict[str, dict] = {}
        metrics: dict[str, float] = {}
        bootstrap: dict = {}
        while time.monotonic() < deadline:
            time.sleep(10)
            metrics = _metrics()
            body = _get(DASHBOARD)
            bootstrap = json.loads(body) if body else {}
            for name in ("worker1", "worker2"):
                status = _worker_status(name)
                if status:
                    workers[name] = status
            applied = bootstrap.get("applied_by_peer") or {}
            if (
                len(workers) == 2
                and len(bootstrap.get("eval_history") or []) >= 3
                and metrics.get("cgad_peers", 0) >= 2
                and all(applied.get(w["peer_id"], 0) > 0 for w in workers.values())
                and all(
                    (w.get("applied_by_peer") or {}).get(bootstrap.get("peer_id"), 0) > 0
                    for w in workers.values()
                )
            ):
                break
        logs = _compose("logs", "--no-color", "--tail=40").stdout
        assert len(workers) == 2, f"the workers' admin APIs never answered\n{logs[-4000:]}"
        peer_ids = {name: w["peer_id"] for name, w in workers.items()}
        assert len({bootstrap.get("peer_id"), *peer_ids.values()}) == 3, (bootstrap.get("peer_id"), peer_ids)
        # the bootstrap's metrics, as published on the host, see both workers and their fragments
        assert metrics.get("cgad_peers", 0) >= 2, (metrics, logs[-4000:])
        applied = bootstrap.get("applied_by_peer") or {}
        for name, peer_id in peer_ids.items():
            assert applied.get(peer_id, 0) > 0, f"the bootstrap applied nothing from {name}: {applied}"
        assert metrics.get("cgad_applied_total", 0) >= 2, metrics
        # and it goes both ways: each worker applied the bootstrap's fragments, all three learning
        for name, status in workers.items():
            assert (status.get("applied_by_peer") or {}).get(bootstrap["peer_id"], 0) > 0, (name, status)
        for status in (bootstrap, *workers.values()):
            assert status["run_id"] == "compose-demo"
        history = [loss for _, loss in bootstrap["eval_history"]]
        assert len(history) >= 3 and history[-1] < history[0] - 0.5, history
        print(
            f"compose network: up in {built_s:.0f} s, both workers applied "
            f"{time.monotonic() - started - built_s:.0f} s later; bootstrap {applied}"
        )
    finally:
        down = subprocess.run(["make", "compose-down"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    left = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split()
    assert not left, f"make compose-down left containers: {left}"
    volumes = subprocess.run(
        ["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split()
    assert not volumes, f"make compose-down left volumes: {volumes}"
