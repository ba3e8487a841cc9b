"""The WAN testbed: how a run is kept (runlog.py), that the committed summaries are what report.py
makes of the committed runs, and the short scenario: 3 real daemons in network namespaces on
10 Mbit links, one SIGKILLed and restarted (skipped, with the reason, where namespaces cannot be
made)."""

import gzip
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WAN = ROOT / "bench" / "wan"
RESULTS = ROOT / "bench" / "results" / "wan"
sys.path.insert(0, str(WAN))

import report  # noqa: E402
import runlog  # noqa: E402
from testbed import available  # noqa: E402


def _status(step: int, history: list, **more) -> dict:
    return {"round": step // 10, "inner_step": step, "eval_loss": history[-1][1] if history else None,
            "eval_history": history, "applied_by_age": {"0": step}, "mean_age": 0.0, **more}  # fmt: skip


def _at(t: float, node: int, status: dict | None) -> dict:
    return {"t": t, "node": node, "alive": True, "status": status}


def _run(samples: list) -> dict:
    return {"scenario": {"name": "x", "nodes": 2}, "commit": "abc", "samples": samples, "final": {"0": None}}


def test_a_run_reads_back_exactly_and_stores_what_changed(tmp_path):
    history = [[0, 8.3], [1, 7.5], [2, 7.0], [3, 6.8]]
    no_age = {k: v for k, v in _status(43, history).items() if k != "mean_age"}
    samples = [
        _at(0.0, 0, _status(3, history[:2])),
        _at(0.0, 1, None),
        {"t": 5.0, "event": {"kill": 1}},
        _at(5.0, 0, _status(13, history[:3])),  # the history grew
        {"t": 5.0, "node": 1, "alive": False, "status": None},
        _at(10.0, 0, _status(23, history[1:])),  # ... or lost its head
        _at(10.0, 1, _status(0, [], resumed=True)),  # None -> a status
        _at(15.0, 0, {**_status(23, history[1:]), "mean_age": 0}),  # 0.0 -> 0
        _at(20.0, 0, {"eval_loss": math.nan, **_status(33, history)}),  # a key moved
        _at(25.0, 0, no_age),  # a key gone
        _at(25.0, 0, {**_status(43, history), "eval_loss": -0.0, "loss": math.nan}),
    ]
    run = _run(samples)
    path = runlog.write_run(tmp_path / f"x{runlog.SUFFIX}", run)
    back = runlog.read_run(path)
    assert runlog.same(back, run) and list(back) == list(run)
    assert json.dumps(back) == json.dumps(run)  # the same document, byte for byte
    with gzip.open(path, "rt") as lines:
        header, *encoded = [json.loads(line) for line in lines]
    assert header["format"] == "cgad-wan-run" and header["run"]["samples"] == len(samples)
    assert list(header["run"]) == list(run)  # the samples' count in their place among the keys
    assert len(encoded) == len(samples)
    grown = encoded[3]["d"]["sub"]["status"]
    assert grown["add"] == {"eval_history": [history[2]]}, grown  # only the new tail
    assert "set" in encoded[5]["d"]["sub"]["status"]  # a history that did not only grow: whole
    assert "s" in encoded[0] and "s" in encoded[2]  # a node's first sample and an event: whole
    # the bytes depend on the record alone
    again = runlog.write_run(tmp_path / f"y{runlog.SUFFIX}", run)
    assert again.read_bytes() == path.read_bytes()


def test_runs_are_found_in_either_format_the_new_one_first(tmp_path):
    old, new = _run([{"t": 0.0, "node": 0, "alive": True, "status": None}]), _run([])
    (tmp_path / "a.json").write_text(json.dumps(old, indent=1) + "\n")
    (tmp_path / "b.json").write_text(json.dumps(old, indent=1) + "\n")
    runlog.write_run(tmp_path / f"b{runlog.SUFFIX}", new)
    (tmp_path / "summary-x.json").write_text("{}")
    assert runlog.run_names(tmp_path) == ["a", "b"]
    assert report.load("a", tmp_path) == old
    assert report.load("b", tmp_path) == new
    with pytest.raises(FileNotFoundError):
        runlog.find_run(tmp_path, "c")


def test_a_cut_short_run_is_refused(tmp_path):
    run = _run([{"t": float(t), "node": 0, "alive": True, "status": _status(t, [])} for t in range(4)])
    path = runlog.write_run(tmp_path / f"x{runlog.SUFFIX}", run)
    with gzip.open(path, "rt") as lines:
        kept = lines.readlines()[:-1]
    with gzip.open(path, "wt") as out:
        out.writelines(kept)
    with pytest.raises(ValueError, match="3 samples, the header says 4"):
        runlog.read_run(path)


def test_the_committed_summaries_are_what_report_makes_of_the_committed_runs():
    """Every summary under bench/results/wan, made again from the runs kept beside it: the same
    numbers at every key it has (summaries made before report.py computed a field lack that
    field)."""

    def on_the_keys_of(kept, made):
        if isinstance(kept, dict) and isinstance(made, dict):
            return {k: on_the_keys_of(v, made.get(k)) for k, v in kept.items()}
        if isinstance(kept, list) and isinstance(made, list) and len(kept) == len(made):
            return [on_the_keys_of(a, b) for a, b in zip(kept, made, strict=True)]
        return made

    summaries = sorted(RESULTS.glob("summary*.json"))
    assert summaries
    runs: dict[str, dict] = {}
    for path in summaries:
        kept = json.loads(path.read_text())
        names = [*kept["scenarios"], *([] if kept["floor"] in kept["scenarios"] else [kept["floor"]])]
        for name in names:
            if name not in runs:
                runs[name] = report.load(name)
        made = json.loads(json.dumps(report.compare({n: runs[n] for n in names}, kept["floor"])))
        assert on_the_keys_of(kept, made) == kept, path.name


@pytest.mark.integration
@pytest.mark.skipif(available() is not None, reason=str(available()))
@pytest.mark.timeout(600)
def test_three_nodes_on_10_mbit_train_and_a_killed_node_catches_up(tmp_path, monkeypatch):
    from run import load_scenario, run

    monkeypatch.setenv("CGAD_CACHE_DIR", str(tmp_path / "cache"))
    scenario = load_scenario(ROOT / "bench" / "wan" / "scenarios" / "smoke-3.json")
    executable = shutil.which("cgad-node", path=str(Path(sys.executable).parent))
    result = run(scenario, tmp_path, executable)
    # the scenario's own expectations (bench/wan/checks.py): losses finite, every node answering
    # and learning, the joiners joined, the restarted node back within 4 versions of the swarm
    failed = [v for v in result["checks"] if not v["ok"]]
    assert not failed, (failed, result["log_tails"])
    final = result["final"]
    for index in range(3):
        assert final[index]["rejected"].get("non_finite", 0) == 0
        assert final[index]["applied"] > 0, (index, final[index])
    assert final[2]["resumed"], final[2]
    # how far apart the nodes' φ ended, read back from their three final checkpoints
    spread = result["phi_spread"]
    assert spread is not None and spread["nodes"] == 3, spread
    assert all(0 <= d < 1 for d in spread["relative_distance_to_mean"]), spread
    # and the record kept of it reads back whole
    path = runlog.write_run(tmp_path / f"smoke{runlog.SUFFIX}", json.loads(json.dumps(result)))
    assert runlog.same(runlog.read_run(path), json.loads(json.dumps(result)))
