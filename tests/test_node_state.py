"""Checkpoints (atomic, lossless, safe to parse) and the node's configuration (YAML + flags)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cgad.node.config import ConfigError, JoinConfig, build_config, load_yaml
from cgad.node.daemon.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    load_checkpoint,
    pack,
    save_checkpoint,
    unpack,
)

CLI = str(Path(sys.executable).with_name("cgad-node"))


def sample_state():
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    return {
        "opt": opt.state_dict(),
        "versions": [3, 4],
        "betas": (0.9, 0.95),
        "bf16": torch.ones(2, dtype=torch.bfloat16),
    }


def test_pack_round_trip_keeps_types_and_values():
    state = sample_state()
    back = unpack(pack(state))
    assert back["versions"] == [3, 4] and back["betas"] == (0.9, 0.95)
    assert back["bf16"].dtype == torch.bfloat16
    assert list(back["opt"]["state"]) == [0]  # int keys survive
    torch.testing.assert_close(back["opt"]["state"][0]["exp_avg"], state["opt"]["state"][0]["exp_avg"])
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4, 3))])
    fresh.load_state_dict(back["opt"])


@pytest.mark.parametrize("data", [b"", b"garbage", b"\xff" * 64, (8).to_bytes(8, "little") + b"{}{}{}{}"])
def test_unpack_rejects_malformed_blobs(data):
    with pytest.raises(CheckpointError):
        unpack(data)


def test_save_replaces_atomically_and_leaves_no_temp_files(tmp_path):
    save_checkpoint(tmp_path, {"round": 1, "w": torch.zeros(3)})
    save_checkpoint(tmp_path, {"round": 2, "w": torch.ones(3)})
    assert load_checkpoint(tmp_path)["round"] == 2
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_NAME]
    assert load_checkpoint(tmp_path / "empty") is None


def test_a_crash_mid_write_keeps_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, {"round": 1, "w": torch.zeros(1000)})
    # a child process that dies (SIGKILL) while writing a much larger checkpoint
    code = (
        "import os, signal, torch\n"
        "import cgad.node.daemon.checkpoint as c\n"
        "real = os.fsync\n"
        "def die(fd):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "os.fsync = die\n"
        f"c.save_checkpoint({str(tmp_path)!r}, {{'round': 2, 'w': torch.ones(10**6)}})\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert result.returncode == -9
    state = load_checkpoint(tmp_path)
    assert state["round"] == 1 and state["w"].numel() == 1000


def test_yaml_config_and_flags(tmp_path):
    path = tmp_path / "node.yaml"
    peer = "/ip4/1.2.3.4/tcp/5/p2p/QmWJbxQCyGo6X5mLrE9tYtWZj7VJbFsYJbw6pbJbZTbW3T"
    path.write_text(f"run-id: shakespeare\ninner_steps: 20\nfragments: 2\npeers: {peer}\n")
    values = load_yaml(path)
    config = build_config(JoinConfig, ("file", values), ("flags", {"inner_steps": 40}))
    assert config.run_id == "shakespeare" and config.inner_steps == 40 and config.fragments == 2
    assert config.peers == [peer]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("inner-step: 20\n", "unknown option 'inner-step' .*did you mean 'inner-steps'"),
        ("inner_steps: many\n", "node.yaml: inner_steps .*valid integer"),
        ("client_mode: 3\n", "node.yaml: client_mode .*valid boolean"),
        ("- a\n- b\n", "mapping"),
        ("a: [\n", "not valid YAML"),
        ("grpc_port: 70000\n", "grpc_port .*65535"),
        ("fan_in: 0\n", "fan_in .*greater than or equal to 1"),
        ("alpha: -0.5\n", "alpha .*greater than or equal to 0"),
        ("outer_lr: .nan\n", "outer_lr .*finite"),
        ("peers: 203.0.113.7:31337\n", "peers .*not a multiaddr"),
        ("peers: /ip4/203.0.113.7/tcp/99999\n", "peers .*port 99999"),
    ],
)
def test_bad_yaml(tmp_path, text, match):
    path = tmp_path / "node.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        build_config(JoinConfig, (f"config file {path}", load_yaml(path)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer": "adamw"}, "optimizer .*'cgad'"),
        ({"codec": "3bit"}, "codec .*'4bit'"),
        ({"admin_port": -1}, "admin_port"),
        ({"inner_lr": float("nan")}, "inner_lr"),
        ({"inner_steps": 10, "fragments": 3}, "multiple"),
        ({"data": "does/not/exist"}, "does not exist"),
        ({"params_codec": "sparse"}, "pseudo-gradients only"),
        ({"codec": "sparse", "error_feedback": False}, "needs --error-feedback"),
        ({"inner_steps": 10, "apply_delay": 10}, "must be under a block"),  # was capped silently
    ],
)
def test_bad_node_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        build_config(JoinConfig, ("", kwargs))


def test_join_dry_run_validates_flags_and_file(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text("run_id: from-file\ninner_steps: 8\n")
    env = {**os.environ, "CGAD_CACHE_DIR": str(tmp_path)}
    ok = subprocess.run([CLI, "join", "--config", str(path), "--fragments", "2", "--dry-run"],
                        capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert '"run_id": "from-file"' in ok.stdout and '"fragments": 2' in ok.stdout
    typo = subprocess.run([CLI, "join", "--fragmnets", "2"], capture_output=True, text=True, timeout=120)
    assert typo.returncode == 2 and "--fragments" in typo.stderr
    bad = subprocess.run([CLI, "join", "--config", str(path), "--fragments", "3", "--dry-run"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "multiple of fragments" in bad.stderr


def _lone_node(tmp_path: Path, **overrides):
    from cgad.node.daemon.node import Node

    config = JoinConfig(
        run_id="lifecycle", model="tiny", inner_steps=4, batch_size=2, seq_len=32, eval_batches=1,
        checkpoint_dir=str(tmp_path / "ckpt"), admin_port=0, dashboard=False, **overrides,
    )  # fmt: skip
    return Node(config)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_max_rounds_stops_after_whole_rounds_of_this_run(tmp_path):
    """The last round is whole: its outer step taken, nothing published after it (the steps
    carried past it stay on θ); a resumed node runs that many rounds more."""
    for expected in (2, 4):
        node = _lone_node(tmp_path, max_rounds=2)
        try:
            assert node.run() == 0
        finally:
            node.close()
        state = load_checkpoint(tmp_path / "ckpt")
        assert state["round"] == expected and state["outer"]["versions"] == [expected]
        assert state["blocks"] == expected  # no block published without its outer step
        # the first node of a swarm: nobody to fetch its deltas, none encoded (``audience``)
        assert node.loop.counters.published == 0 and node.loop.counters.unheard == 2


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_leaving_while_waiting_for_the_swarms_state_saves_nothing(tmp_path):
    """A node told to leave before any snapshot came neither offers nor checkpoints its
    untrained model (the next start would resume from it instead of joining)."""
    import json
    import threading

    from _netswarm import make_transport  # tests/ is on sys.path under pytest

    from cgad.protocol.records import PROTOCOL_VERSION

    with make_transport({}, run_id="lifecycle") as silent:  # a peer that never offers a state
        node = _lone_node(tmp_path, peers=silent.maddrs(), join_timeout=120.0)
        silent.describe_as(json.dumps({**node.swarm, "protocol": PROTOCOL_VERSION}))
        try:
            threading.Timer(3.0, node.request_leave).start()
            assert node.run() == 0
            assert node.trainer.steps == 0 and not node.transport.store.offers(None)
        finally:
            node.close()
    assert load_checkpoint(tmp_path / "ckpt") is None


def test_a_checkpoint_goes_to_disk_and_back_without_a_serialized_copy_of_the_state(tmp_path):
    """Saving streams the tensors into the file and loading reads each from the mapped file: no
    model-sized bytes object on the way (``pack``/``unpack`` hold one, and at every checkpoint of
    a 26M-parameter model that was 1 GiB above the daemon's steady memory). tracemalloc sees
    Python's allocations (bytes objects), not tensors' own storage."""
    import tracemalloc

    state = {"round": 3, "phi": torch.randn(5_000_000), "opt": {"state": {0: {"m": torch.randn(2_000_000)}}}}
    size = 7_000_000 * 4
    tracemalloc.start()
    try:
        save_checkpoint(tmp_path, state)
        _, saving = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        back = load_checkpoint(tmp_path)
        _, loading = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert saving < size / 20 and loading < size / 20, (saving, loading)
    assert back["round"] == 3
    torch.testing.assert_close(back["phi"], state["phi"], rtol=0, atol=0)
    torch.testing.assert_close(back["opt"]["state"][0]["m"], state["opt"]["state"][0]["m"], rtol=0, atol=0)
    # the loaded tensors are the node's own: writing to them leaves the file as it was
    written = (tmp_path / CHECKPOINT_NAME).read_bytes()
    back["phi"].add_(1.0)
    assert (tmp_path / CHECKPOINT_NAME).read_bytes() == written
    torch.testing.assert_close(load_checkpoint(tmp_path)["phi"], state["phi"], rtol=0, atol=0)


@pytest.mark.parametrize("data", [b"", b"garbage", b"\xff" * 64, (8).to_bytes(8, "little") + b"{}{}{}{}"])
def test_a_malformed_checkpoint_file_says_so(tmp_path, data):
    (tmp_path / CHECKPOINT_NAME).write_bytes(data)
    with pytest.raises(CheckpointError, match=CHECKPOINT_NAME):
        load_checkpoint(tmp_path)
