"""bench/scale.py and bench/gpu_check.py keep working: each runs here at the tiny preset for
seconds (the real figures take hours on a CPU, or a GPU), through its own main, and what it writes
is checked for what the figures will be read for."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
    """One token cache for the module's processes (the corpus is tokenized once)."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.mark.system
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_scale_measures_a_lone_daemon_against_a_bare_loop(tmp_path, monkeypatch, token_cache):
    monkeypatch.setenv("CGAD_CACHE_DIR", token_cache)
    scale = _load("scale")
    out = tmp_path / "scale.json"
    args = ["--presets", "tiny", "--seconds", "3", "--repeats", "1", "--warmup", "1", "--seq-len", "64"]
    assert scale.main([*args, "--threads", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert len(record["commit"]) == 40 and isinstance(record["clean"], bool)
    assert record["machine"]["cores"] >= 1 and record["repeats"] == 1
    assert record["settings"]["seq_len"] == 64 and record["settings"]["threads"] == 1
    (preset,) = record["presets"]
    numel, run, summary = preset["parameters"], preset["runs"][0], preset["summary"]
    assert 1.5e6 < numel < 2.5e6  # tiny
    for side in ("bare", "daemon"):
        got = run[side]
        assert len(got["window_rates"]) - 1 >= scale.MIN_WINDOWS, got
        assert got["tokens_per_second"] > 0
        assert got["peak_rss_bytes"] > 100 << 20  # torch and a model at least
    # the daemon is the bare loop and more (φ, the transport, hivemind), and at tiny not a multiple
    # of it: its model-sized buffers (~60 MB) are within the runtime's own spread between processes
    # the same order as a bare loop: below it too, as the daemon gives freed buffers back to the
    # system (node/daemon/allocator.py) where the bare loop's allocator keeps them (0.86x at tiny)
    assert 0.5 < summary["rss_ratio"] < 5.0, summary
    # how close to 1 is the full run's question (its goal is 0.95); that a lone daemon trains at
    # half the bare loop's rate or worse, on any machine, is a defect this catches
    assert summary["tokens_ratio"] > 0.5, summary
    # one repeat: its own pair's ratio is the ratio of the medians
    assert summary["tokens_ratio_pairs"] == [summary["tokens_ratio"]]
    assert abs(summary["tokens_ratio_of_medians"] - summary["tokens_ratio"]) < 1e-9
    # the flags the daemon ran with: only batch, sequence, H and where it listens were given, and
    # that its peers' gRPC endpoints on 127.0.0.1 are dialed (the last, a switch)
    flags = run["daemon"]["flags"]
    assert flags[-1] == "--private-endpoints"
    given = {flags[i] for i in range(0, len(flags) - 1, 2)}
    assert given == {"--model", "--batch-size", "--seq-len", "--inner-steps", "--admin-port",
                     "--dashboard-port", "--maddrs-file"}  # fmt: skip
    # a node alone encodes for nobody (node/member/audience.py): no pseudo-gradient published
    assert summary["published_bytes_per_round"] is None and run["daemon"]["status"]["sent_as"] == {}
    assert summary["transport_bytes_per_round"] == 0  # alone: nobody fetched anything
    # the snapshot as its signed offer states it: phi and at most two more model-sized tensors
    assert 0.25 * numel < summary["snapshot_bytes"] < 16 * numel + (1 << 20), summary
    stall = run["daemon"]["stall"]  # the status document's stall: blocks ended, so it is reported
    assert stall is not None, run["daemon"]
    assert 0 <= stall["fraction"] <= 1 and stall["per_outer_step_s"] >= 0
    assert summary["stall_fraction"] == stall["fraction"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the check itself")
def test_gpu_check_says_there_is_no_gpu_and_exits_0(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout
    assert not out.exists()


@pytest.mark.system
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_check_runs_every_part_on_the_cpu(tmp_path, monkeypatch, token_cache):
    """The script's code, on the CPU at tiny (``--device cpu``), so that the run on a GPU
    does not fail on anything but the GPU."""
    monkeypatch.setenv("CGAD_CACHE_DIR", token_cache)
    gpu_check = _load("gpu_check")
    out = tmp_path / "gpu_check.json"
    threads = torch.get_num_threads()
    try:
        args = [
            "--device",
            "cpu",
            "--presets",
            "tiny",
            "--seconds",
            "2",
            "--batch-size",
            "4",
            "--seq-len",
            "64",
        ]
        args += ["--inner-steps", "10", "--exchange-preset", "tiny", "--threads", "1", "--budget", "600"]
        assert gpu_check.main([*args, "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    record = json.loads(out.read_text())
    (preset,) = record["presets"]
    numel = preset["parameters"]
    for part in ("bare", "outer_step", "codecs", "daemon"):
        assert "error" not in preset[part] and "skipped" not in preset[part], (part, preset[part])
    assert preset["bare"]["tokens_per_second"] > 0 and preset["daemon"]["tokens_per_second"] > 0
    outer = preset["outer_step"]
    assert len(outer["apply_seconds"]) == gpu_check.OUTER_REPEATS
    assert outer["deliveries_last_step"] == 2  # its own Δ and the other member's
    assert outer["applied_from_peer"] == gpu_check.OUTER_REPEATS + 1 and not outer["rejected"], outer
    codecs = {codec: preset["codecs"][codec] for codec in gpu_check.CODECS}
    sizes = {codec: got["bytes"] for codec, got in codecs.items()}
    assert sizes["sparse"] < sizes["2bit"] < sizes["4bit"] < sizes["fp16"] < 4 * numel
    assert all(got["numel"] == numel for got in codecs.values())
    exchange = record["exchange"]
    assert "error" not in exchange, exchange
    assert exchange["both_applied"], exchange
    a, b = exchange["nodes"]["a"], exchange["nodes"]["b"]
    assert b["started_from"].startswith("peer ") and a["bytes_out"] > 0 and b["bytes_in"] > 0
