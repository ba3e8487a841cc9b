"""docker-compose.yml: no Docker engine runs here, so every command in it is run as a real
`cgad-node` invocation that validates the full configuration (join --dry-run), and the bootstrap
multiaddr the workers dial is checked against the bootstrap's key file."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
