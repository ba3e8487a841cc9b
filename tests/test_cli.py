"""The installed `cgad-node` console script: help, version, and errors that name what was wrong."""

import subprocess
import sys
from pathlib import Path

import pytest

from cgad.node import __version__

CLI = str(Path(sys.executable).with_name("cgad-node"))


def cli(*args):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_subcommands():
    out = cli("--help")
    assert out.returncode == 0
    assert "info" in out.stdout


def test_join_help_lists_what_a_volunteer_sets_and_help_all_every_option():
    import re

    from cgad.node.config import JoinConfig

    short, everything = cli("join", "--help"), cli("join", "--help-all")
    assert short.returncode == 0 and everything.returncode == 0, short.stderr + everything.stderr
    listed = [re.findall(r"^  (--[\w-]+|-h)", out.stdout, re.M) for out in (short, everything)]
    assert len(listed[0]) <= 20 and {"--peers", "--identity", "--help-all"} <= set(listed[0]), listed[0]
    # every option of the configuration, by part, and the flags beside it; the internals are keys
    # of the config file only, named there
    internal = {"record_ttl", "liveness_ttl", "keep_reserved", "chunk_timeout", "history_versions"}
    fields = {"--" + name.replace("_", "-") for name in set(JoinConfig.model_fields) - internal}
    assert fields <= set(listed[1]), fields - set(listed[1])
    assert not {"--" + name.replace("_", "-") for name in internal} & set(listed[1])
    assert all(name in everything.stdout for name in internal)
    assert "The outer step" in everything.stdout
    # a flag the short help leaves out is still taken; an internal is not a flag, but a file's key
    dry = cli("join", "--dry-run", "--fan-in", "3")
    assert dry.returncode == 0 and '"fan_in": 3' in dry.stdout, dry.stderr
    for given, shown in (("none", "null"), ("auto", '"auto"')):  # every peer's; cut to the model
        dry = cli("join", "--dry-run", "--fan-in", given)
        assert dry.returncode == 0 and f'"fan_in": {shown}' in dry.stdout, dry.stderr
    assert cli("join", "--dry-run", "--record-ttl", "60").returncode == 2


def test_every_key_join_and_simulate_share_has_one_default():
    from cgad.node.config import JoinConfig
    from cgad.node.sim.config import SimConfig

    def default(model: type, name: str) -> object:
        return model.model_fields[name].get_default(call_default_factory=True)

    shared = [name for name in JoinConfig.model_fields if name in SimConfig.model_fields]
    assert len(shared) > 20
    differ = {name: (default(JoinConfig, name), default(SimConfig, name)) for name in shared}
    assert {name: pair for name, pair in differ.items() if pair[0] != pair[1]} == {}


def test_version():
    out = cli("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"cgad-node {__version__}"


def test_mistyped_subcommand_is_named_with_a_suggestion():
    out = cli("inf")
    assert out.returncode == 2
    assert "'inf'" in out.stderr
    assert "did you mean 'info'" in out.stderr


@pytest.mark.parametrize("flag", ["--verison", "--versoin"])
def test_mistyped_flag_is_named_with_a_suggestion(flag):
    out = cli(flag)
    assert out.returncode == 2
    assert flag in out.stderr
    assert "--version" in out.stderr


@pytest.mark.slow
def test_info_runs():
    out = cli("info")
    assert out.returncode == 0, out.stderr
    assert "CGAD" in out.stdout and "torch" in out.stdout


@pytest.mark.parametrize("command", ["status", "leave"])
def test_status_and_leave_stay_light(command):
    """The compose health check runs `status` every 30 s: it must not pay for torch."""
    code = (
        "import sys\n"
        "from cgad.node.front.cli import main\n"
        f"rc = main([{command!r}, '--admin', '127.0.0.1:9'])\n"
        "heavy = sorted(m for m in ('torch', 'hivemind', 'transformers') if m in sys.modules)\n"
        "print(rc, heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr


def test_the_status_summary_reads_a_fresh_node_and_a_busy_one() -> None:
    from cgad.node.daemon.status import status_report

    fresh = {
        "peer_id": "QmMe", "run_id": "r", "optimizer": "cga", "device": "cpu", "uptime": 5.0,
        "started_from": "scratch", "resumed": False, "round": 0, "inner_step": 0, "versions": [0],
        "loss": None, "eval_loss": 8.3, "tokens_per_second": 0.0, "peers": 0, "resyncs": 0,
        "published": 0, "applied": 0, "dropped_stale": 0, "clipped": 0, "tokens_capped": 0,
        "downlink_bytes_per_second": None,
        "fetches_waiting": 0, "rejected": {}, "skipped": {}, "mean_age": 0.0,
    }  # fmt: skip
    text = status_report(fresh)
    assert "0 live peer(s)" in text and "rejected   none" in text and "ages of" not in text
    assert "DHT writes none" in text
    busy = {**fresh, "uptime": 3725.0, "peers": 2, "applied": 7, "rejected": {"future": 3}, "mean_age": 0.71,
            "applied_by_peer": {"QmA": 5, "QmB": 2}, "applied_by_age": {"0": 4, "1": 2, "3": 1},
            "records_stored": {"progress": 12, "holdings": 30}}  # fmt: skip
    text = status_report(busy)
    assert "1h02m05s" in text and "future 3" in text and "  QmA  5" in text
    assert "DHT writes holdings 30, progress 12" in text
    assert "outer momentum" not in text
    assert "outer momentum 0.47" in status_report({**busy, "outer_momentum": 0.47})
    assert "sent as    the transport's codec" in text
    auto = status_report({**busy, "sent_as": {"4bit": 3, "sparse:20": 9}, "send_budget_bytes": 3.2e5})
    assert "sent as    4bit 3, sparse:20 9 (budget 0.32 MB per peer and round)" in auto
    assert "    0  " + "#" * 40 + " 4" in text and "    3  " + "#" * 10 + " 1" in text


def test_metrics_are_counters_and_gauges_a_scraper_can_read() -> None:
    import socket
    import urllib.request

    from cgad.node.daemon.metrics import Metrics

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    metrics = Metrics(port, "127.0.0.1")
    try:
        status = {"round": 3, "inner_step": 30, "published": 3, "applied": 5, "loss": 5.5, "peers": 2,
                  "rejected": {"future": 4, "non_finite": 1}, "skipped": {"fan_in": 2},
                  "records_stored": {"holdings": 7}, "bytes_in": 1000}  # fmt: skip
        metrics.update(status)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        metrics.stop()
    assert "# TYPE cgad_rounds_total counter" in text and "cgad_rounds_total 3.0" in text
    assert "# TYPE cgad_loss gauge" in text and "cgad_loss 5.5" in text
    assert 'cgad_rejected_total{reason="future"} 4.0' in text
    assert 'cgad_skipped_total{reason="fan_in"} 2.0' in text and "cgad_received_bytes_total 1000.0" in text
    assert 'cgad_records_stored_total{record="holdings"} 7.0' in text
    assert "cgad_eval_loss" not in text  # nothing is made up for what the status does not hold


def test_an_internal_is_set_in_the_config_file(tmp_path):
    config = tmp_path / "node.yaml"
    config.write_text("record_ttl: 60\nfan_in: 3\n")
    dry = cli("join", "--dry-run", "--config", str(config))
    assert dry.returncode == 0, dry.stderr
    assert '"record_ttl": 60' in dry.stdout and '"fan_in": 3' in dry.stdout


def test_an_error_names_a_flag_only_where_the_key_has_one() -> None:
    """A file-only key (an internal) is named as the config file's key, not as a flag that does
    not exist; a key with a flag names both."""
    from cgad.node.config import ConfigError, JoinConfig, build_config

    with pytest.raises(ConfigError) as internal:
        build_config(JoinConfig, ("node.yaml", {"record_ttl": -1}))
    assert str(internal.value).startswith("node.yaml: record_ttl: ") and "--record-ttl" not in str(
        internal.value
    )
    with pytest.raises(ConfigError) as flagged:
        build_config(JoinConfig, ("flags", {"inner_steps": 0}))
    assert "inner_steps (--inner-steps): " in str(flagged.value)
