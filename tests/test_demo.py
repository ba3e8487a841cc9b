"""The README's main-job command, shortened: `cgad-node demo` runs a real swarm and reports."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CLI = str(Path(sys.executable).with_name("cgad-node"))


@pytest.mark.system
def test_demo_runs_a_swarm_and_ends_with_a_summary_and_a_plot(tmp_path, token_cache):
    env = {**os.environ, "CGAD_CACHE_DIR": token_cache}
    result = subprocess.run(
        [CLI, "demo", "--nodes", "2", "--minutes", "0.6", "--out", str(tmp_path), "--inner-steps", "8"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = re.findall(r"^\s+(\d)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+([\d.]+)$", result.stdout, re.M)
    assert [r[0] for r in rows] == ["0", "1"], result.stdout
    for _, start, end, published, applied, _ in rows:
        assert float(end) < float(start)
        assert int(published) > 0 and int(applied) > 0
    # beside them, one node trained alone on the same settings: it learned, and applied nothing
    alone = re.search(r"^\s*alone\s+([\d.]+)\s+([\d.]+)\s+\d+\s+0\s", result.stdout, re.M)
    assert alone and float(alone.group(2)) < float(alone.group(1)), result.stdout
    # the swarm against it by round and by wall-clock, and the gain in words
    versus = re.findall(
        r"^\s*(round|minute)\s+[\d.]+\s+([\d.]+)\s+([\d.]+)\s+([+-][\d.]+)$", result.stdout, re.M
    )
    assert {"round", "minute"} <= {v[0] for v in versus}, result.stdout
    for _, swarm, lone, gain in versus:
        assert float(gain) == pytest.approx(float(lone) - float(swarm), abs=2e-3)
    # a swarm behind its floor at equal inner steps is a failure of the swarm, not a case to print
    assert "the swarm is ahead by" in result.stdout, result.stdout
    assert re.search(r"the 2 nodes were worth (more than )?[\d.]+ nodes alone", result.stdout), result.stdout
    png = tmp_path / "demo_loss.png"
    assert str(png.resolve()) in result.stdout and png.stat().st_size > 10_000
    # the swarm's dashboards were told where the lone node's loss is, and it is there
    floor = json.loads((tmp_path / "demo-swarm" / "alone.json").read_text())["points"]
    assert len(floor) >= 2 and floor[-1][2] < floor[0][2]
    assert not list((tmp_path / "demo-swarm").glob("*.maddrs.tmp"))


def test_ctrl_c_stops_the_nodes_and_still_prints_the_summary_and_the_plot(tmp_path, token_cache):
    env = {**os.environ, "CGAD_CACHE_DIR": token_cache}
    demo = subprocess.Popen(
        [CLI, "demo", "--nodes", "2", "--minutes", "5", "--out", str(tmp_path), "--inner-steps", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    lines = []
    for line in demo.stdout:  # wait until the swarm is up and a first status has been shown
        lines.append(line)
        if "node 1: round" in line:
            break
    demo.send_signal(signal.SIGINT)
    out, err = demo.communicate(timeout=300)
    out = "".join(lines) + out
    assert demo.returncode == 130, out[-2000:] + err[-2000:]
    assert "interrupted: stopping every node" in err and "Traceback" not in err, err[-3000:]
    assert "eval start" in out and (tmp_path / "demo_loss.png").exists()
    assert not [p for p in (tmp_path / "demo-swarm").glob("*.log") if "Traceback" in p.read_text()]
