"""The WAN testbed: how a run is kept (runlog.py), that the committed summaries are what report.py
makes of the committed runs, what a run records of the code and data order it ran
(provenance.py), the floor a swarm is checked against, and the short scenario: 3 real daemons in
network namespaces on 10 Mbit links, one SIGKILLed and restarted (skipped, with the reason, where
namespaces cannot be made)."""

import gzip
import importlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

ROOT = Path(__file__).resolve().parent.parent
WAN = ROOT / "bench" / "wan"
RESULTS = ROOT / "bench" / "results" / "wan"

from cgad.bench.wan import checks, provenance, report, runlog  # noqa: E402
from cgad.bench.wan.testbed import available  # noqa: E402

SCENARIOS = WAN / "scenarios"


@pytest.fixture
def runner():
    """bench/wan/run.py (it imports the daemon's admin client: here, not at collection)."""
    return importlib.import_module("cgad.bench.wan.run")


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


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True)
    return done.stdout


def test_a_run_records_the_commit_and_a_tree_with_changes_outside_results_is_refused(tmp_path):
    repo = tmp_path / "repo"
    (repo / "node").mkdir(parents=True)
    (repo / "bench" / "results" / "wan").mkdir(parents=True)
    (repo / "node" / "a.py").write_text("x = 1\n")
    (repo / "bench" / "results" / "wan" / "kept.png").write_text("old")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.org", "commit", "-q", "-m", "start")
    head = _git(repo, "rev-parse", "HEAD").strip()

    state = provenance.tree_state(repo)
    assert state == {"commit": head, "clean": True, "changes": []}
    assert provenance.refusal(state, None) is None
    # what runs write: new results, and a result made again under its name
    (repo / "bench" / "results" / "wan" / "new.jsonl.gz").write_bytes(b"x")
    (repo / "bench" / "results" / "wan" / "kept.png").write_text("new")
    assert provenance.tree_state(repo)["clean"]
    # code changed, or a file beside it the code may import
    (repo / "node" / "a.py").write_text("x = 2\n")
    (repo / "node" / "b.py").write_text("")
    state = provenance.tree_state(repo)
    assert state["commit"] == head and not state["clean"]
    assert state["changes"] == [" M node/a.py", "?? node/b.py"]
    why = provenance.refusal(state, None)
    assert why and "node/a.py" in why and "--experiment" in why
    assert provenance.refusal(state, "a.py at x = 2") is None


def test_main_refuses_a_tree_with_changes_before_anything_else(runner, monkeypatch):
    dirty = {"commit": "0" * 40, "clean": False, "changes": [" M node/x.py"]}
    monkeypatch.setattr(runner, "tree_state", lambda root: dirty)
    monkeypatch.setattr(
        runner, "available", lambda nat=False, cpu=False: pytest.fail("checked the testbed first")
    )
    monkeypatch.setattr(sys, "argv", ["run.py", str(SCENARIOS / "smoke-3.json")])
    with pytest.raises(SystemExit, match=r"node/x\.py"):
        runner.main()
    monkeypatch.setattr(sys, "argv", ["run.py", str(SCENARIOS / "smoke-3.json"), "--experiment", " "])
    with pytest.raises(SystemExit, match="needs a note"):
        runner.main()


def test_the_host_load_counts_each_node_process_over_the_run_alone(runner, monkeypatch):
    """``host_cpu``: what the nodes used during the run (a node restarted since counts whole, a
    node killed and gone is the rest of the host's), and what the rest of the host took."""
    monkeypatch.setattr(runner, "host_cpu_seconds", lambda: (1300.0, 2.0))
    first = [object() for _ in range(3)]  # the node processes at the start
    at_start = {i: (node, 5.0) for i, node in enumerate(first)}  # index: (node, CPU seconds so far)
    at_end = {0: {"cgad-node": 300.0, "p2pd": 5.0}, 1: {"cgad-node": 200.0}}  # node 2 killed
    now = {0: first[0], 1: object()}  # node 1 restarted: a new process
    host = runner._host_load((100.0, 1.0), at_start, at_end, now, 600.0)
    assert host["busy_s"] == 1200.0 and host["steal_s"] == 1.0 and host["wall_s"] == 600.0
    assert host["nodes_s"] == (305.0 - 5.0) + 200.0 and host["others_s"] == 1200.0 - 500.0


def test_node_i_gets_the_same_data_seed_in_a_swarm_and_its_floor(runner):
    swarm = runner.load_scenario(SCENARIOS / "10mbit-4-h50-downloading-joiners.json")
    floor = runner.load_scenario(SCENARIOS / f"{swarm['floor']}.json")
    assert swarm["data_seed"] and floor["data_seed"]  # on unless a scenario says otherwise

    def seed(scenario, index, run_seed=0):
        args = runner.node_args(scenario, index, run_seed)
        assert args.count("--data-seed") == 1, args
        return int(args[args.index("--data-seed") + 1])

    for index in range(4):
        assert seed(swarm, index) == seed(floor, index) == provenance.data_seed(index, 0)
    seeds = {seed(swarm, i, run_seed) for i in range(4) for run_seed in range(3)}
    assert len(seeds) == 12 and all(0 <= s < 2**32 for s in seeds)
    assert runner.node_args(swarm, 1, 0)[-4:-2] == ["--seed", "1"]  # a node's own flags kept
    # a scenario may leave data order to the nodes, or give a node its own seed
    assert "--data-seed" not in runner.node_args({**swarm, "data_seed": False}, 0, 0)
    own = {**swarm, "node_args": {"2": ["--data-seed", "7"]}}
    assert runner.node_args(own, 2, 0)[-2:] == ["--data-seed", "7"]
    assert runner.node_args(own, 2, 0).count("--data-seed") == 1


def test_every_scenario_loads_and_a_named_floor_runs_first_once(runner, tmp_path):
    paths = sorted(SCENARIOS.glob("*.json"))
    for path in paths:
        scenario = runner.load_scenario(path)
        if "floor" in scenario:
            floor = runner.load_scenario(SCENARIOS / f"{scenario['floor']}.json")
            assert floor["isolated"] and floor["nodes"] == scenario["nodes"], path.name
    names = [
        s["name"] for s in runner.plan([SCENARIOS / "10mbit-4-h50.json", SCENARIOS / "2mbit-4-h50.json"])
    ]
    assert names == ["10mbit-4-h50-isolated", "10mbit-4-h50", "2mbit-4-h50"]
    given_after = runner.plan([SCENARIOS / "10mbit-4.json", SCENARIOS / "10mbit-4-isolated.json"])
    assert [s["name"] for s in given_after] == ["10mbit-4-isolated", "10mbit-4"]
    assert [s["name"] for s in runner.plan([SCENARIOS / "chaos-leave.json"])] == ["chaos-leave"]
    (tmp_path / "swarm.json").write_text(json.dumps({"nodes": 3, "mbit": 10, "minutes": 1, "floor": "alone"}))
    (tmp_path / "alone.json").write_text(json.dumps({"nodes": 4, "mbit": 10, "minutes": 1, "isolated": True}))
    with pytest.raises(ValueError, match="not 3 isolated nodes"):
        runner.plan([tmp_path / "swarm.json"])
    (tmp_path / "typo.json").write_text(json.dumps({"nodes": 3, "mbit": 10, "minutes": 1, "data_seed": 5}))
    with pytest.raises(ValueError, match="data_seed is true or false"):
        runner.load_scenario(tmp_path / "typo.json")


def _ended(
    losses: dict, *, isolated: bool = False, started: str = "2025-12-08T10:00:00+00:00", **more
) -> dict:
    scenario = {"name": "s", "nodes": len(losses), "minutes": 10, "events": [], "isolated": isolated}
    if not isolated:
        scenario["floor"] = "alone"
    final = {str(i): {"eval_history": [[0, 8.0], [9, loss]]} for i, loss in losses.items()}
    return {"scenario": scenario, "commit": "c" * 40, "started_at": started, "run_seed": 0,
            "data_seeds": {"0": 1, "1": 2}, "final": final, **more}  # fmt: skip


def test_a_swarm_is_checked_against_its_floor_of_the_same_hour():
    floor = _ended({0: 4.2, 1: 4.3}, isolated=True, started="2025-12-08T10:11:00+00:00")
    verdict = checks.check_floor(_ended({0: 4.0, 1: 4.1}), floor)
    assert verdict["check"] == "below_floor" and verdict["ok"], verdict
    assert "4.050" in verdict["detail"] and "4.250" in verdict["detail"] and "-0.200" in verdict["detail"]
    assert not checks.check_floor(_ended({0: 4.2, 1: 4.4}), floor)["ok"]
    # a node that was told to leave is not counted; one silent at the end neither
    left = _ended({0: 4.0, 1: 9.0})
    left["scenario"]["events"] = [{"at": 5, "leave": 1}]
    assert checks.final_losses(left) == {0: 4.0}
    assert checks.check_floor(left, floor)["ok"]
    # runs that do not compare are not compared
    for unlike, why in [
        (None, "no run of its floor alone"),
        ({**floor, "commit": "d" * 40}, "commit"),
        ({**floor, "run_seed": 1}, "run_seed"),
        ({**floor, "data_seeds": {}}, "data_seeds"),
        ({**floor, "scenario": {**floor["scenario"], "minutes": 6}}, "10 minutes against 6"),
        ({**floor, "started_at": "2025-12-08T11:00:01+00:00"}, "more than an hour"),
        ({**floor, "final": {"0": None}}, "final losses of 2 swarm and 0 floor nodes"),
    ]:
        verdict = checks.check_floor(_ended({0: 4.0, 1: 4.1}), unlike)
        assert not verdict["ok"] and why in verdict["detail"], verdict


def test_a_figure_says_what_ran():
    ran = _ended({0: 4.0}, experiment="gossip every round", clean=False)
    assert (
        provenance.describe(ran)
        == "cccccccccc with uncommitted changes; experiment: gossip every round; run seed 0"
    )
    assert provenance.describe(ran, short=True) == "cccccccccc+changes experiment"
    old = {"commit": "1a0a345-dirty"}  # as the runner recorded it before
    assert provenance.describe(old) == provenance.describe(old, short=True) == "1a0a345-dirty"
    assert provenance.what_ran(old)["clean"] is None


class _FakeNode:
    def __init__(self, index: int, args: list[str], workdir: Path):
        self.index, self.args, self.admin = index, args, f"node-{index}"
        self.log = workdir / "log.txt"
        workdir.mkdir(parents=True, exist_ok=True)
        self.log.write_text("started\n")
        self.process = type("Process", (), {"wait": lambda self, timeout=None: 0})()

    def alive(self) -> bool:
        return True

    def cpu_seconds(self) -> dict:
        return {"python": 1.0}


class _FakeBed:
    """The testbed's interface, without namespaces or daemons: what the runner does around them."""

    started: ClassVar[list] = []

    def __init__(self, links, nat=(), cpu=None):
        self.links, self.nodes = links, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return None

    def start(self, index, executable, args, workdir):
        self.nodes[index] = _FakeNode(index, args, workdir)
        self.started.append(self.nodes[index])

    def multiaddr(self, index):
        return f"/ip4/10.77.0.{index + 1}/tcp/31337/p2p/Qm{index}"

    def describe(self):
        return {"links": [], "addresses": []}


def test_the_runner_runs_a_named_floor_first_and_checks_the_swarm_against_it(runner, monkeypatch, tmp_path):
    """run.py's main around fake daemons: the floor runs first, every node gets its data seed, both
    records are written in the new format and the swarm's says how it compares with its floor."""
    losses = {"10mbit-4-h50-isolated": 4.2, "10mbit-4-h50": 4.0}
    running = []
    _FakeBed.started.clear()

    def status(admin, method, timeout=None):
        node = next(n for n in reversed(_FakeBed.started) if n.admin == admin)
        loss = losses[running[-1]] + 0.01 * node.index
        return {"eval_loss": loss, "eval_history": [[0, 8.0], [1, loss]], "inner_step": 10, "round": 1,
                "applied": 0, "applied_by_age": {}} if method == "Status" else {}  # fmt: skip

    real_run = runner.run

    def run(scenario, *args):
        running.append(scenario["name"])
        return real_run(scenario, *args)

    clean = {"commit": "c" * 40, "clean": True, "changes": []}
    monkeypatch.setattr(runner, "Testbed", _FakeBed)
    monkeypatch.setattr(runner, "call_admin", status)
    monkeypatch.setattr(runner, "run", run)
    monkeypatch.setattr(runner, "tree_state", lambda root: clean)
    monkeypatch.setattr(runner, "available", lambda nat=False, cpu=False: None)
    monkeypatch.setattr(runner, "takes_data_seed", lambda executable: True)
    monkeypatch.setattr(runner, "POLL_SECONDS", 0.05)
    out = tmp_path / "out"
    argv = [
        "run.py",
        str(SCENARIOS / "10mbit-4-h50.json"),
        "--minutes",
        "0.005",
        "--out",
        str(out),
        "--run-seed",
        "3",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    runner.main()  # exits 1 where a check fails

    assert running == ["10mbit-4-h50-isolated", "10mbit-4-h50"]
    seeds = [int(n.args[n.args.index("--data-seed") + 1]) for n in _FakeBed.started]
    assert seeds == [provenance.data_seed(i, 3) for i in range(4)] * 2
    swarm, floor = (runlog.read_run(out / f"{name}{runlog.SUFFIX}") for name in reversed(running))
    assert (out / "10mbit-4-h50.png").exists() and (out / "10mbit-4-h50-isolated.png").exists()
    assert swarm["commit"] == "c" * 40 and swarm["clean"] and swarm["experiment"] is None
    assert swarm["run_seed"] == floor["run_seed"] == 3
    assert swarm["data_seeds"] == floor["data_seeds"] == {str(i): seeds[i] for i in range(4)}
    below = [v for v in swarm["checks"] if v["check"] == "below_floor"]
    assert len(below) == 1 and below[0]["ok"], swarm["checks"]
    assert "4.015" in below[0]["detail"] and "4.215" in below[0]["detail"]
    assert not any(v["check"] == "below_floor" for v in floor["checks"])
    # a swarm above its floor fails the run
    losses["10mbit-4-h50"] = 4.5
    _FakeBed.started.clear()
    with pytest.raises(SystemExit, match="checks failed in 10mbit-4-h50"):
        runner.main()


@pytest.mark.system
@pytest.mark.integration
@pytest.mark.skipif(available() is not None, reason=str(available()))
@pytest.mark.timeout(600)
def test_three_nodes_on_10_mbit_train_and_a_killed_node_catches_up(tmp_path, monkeypatch):
    from cgad.bench.wan.run import load_scenario, run, takes_data_seed

    executable = shutil.which("cgad-node", path=str(Path(sys.executable).parent))
    # the runner gives every node a data seed: a cgad-node without the flag is a failure, not a skip
    assert takes_data_seed(executable), f"{executable} takes no --data-seed"
    monkeypatch.setenv("CGAD_CACHE_DIR", str(tmp_path / "cache"))
    scenario = load_scenario(ROOT / "bench" / "wan" / "scenarios" / "smoke-3.json")
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
    # what ran: the code (dirty or not, recorded either way) and each node's data seed
    assert len(result["commit"]) == 40 and isinstance(result["clean"], bool)
    assert set(result["data_seeds"]) == {"0", "1", "2"}
    # and the record kept of it reads back whole
    path = runlog.write_run(tmp_path / f"smoke{runlog.SUFFIX}", json.loads(json.dumps(result)))
    assert runlog.same(runlog.read_run(path), json.loads(json.dumps(result)))


def test_costs_per_round_count_the_steady_state_and_node_0_lists_the_swarm_in_time():
    def status(round_: int, bytes_in: int, stored: int, lookups: int, served: int, peers: int) -> dict:
        return {"round": round_, "bytes_in": bytes_in, "records_stored": {"holdings": stored, "progress": 1},
                "dht_lookups": lookups, "dht_served": {"find": served, "store": 0}, "peers": peers,
                "eval_history": [[0, 8.0]]}  # fmt: skip

    samples = [
        # a joiner's snapshot and the first dials come before the steady state: left out
        {"t": 5.0, "node": 0, "status": status(2, 9_000_000, 5, 10, 40, 1)},
        {"t": 35.0, "node": 0, "status": status(10, 10_000_000, 20, 30, 100, 2)},
        {"t": 36.0, "node": 1, "status": status(11, 500, 20, 30, 0, 2)},
        {"t": 95.0, "node": 0, "status": status(30, 12_000_000, 60, 70, 300, 2)},
    ]
    final = {"0": status(30, 12_000_000, 60, 70, 300, 2), "1": status(11, 900, 20, 30, 0, 2), "2": None}
    result = {"scenario": {"nodes": 3, "events": [], "expect": {"listed_within": 60}}, "samples": samples,
              "final": final}  # fmt: skip
    costs = checks.costs_per_round(result)
    assert costs["bytes_in"] == {"0": 100_000.0}  # node 1 trained no round since: no cost per round
    assert costs["records_stored"] == {"0": 2.0} and costs["dht_lookups"] == {"0": 2.0}
    assert costs["dht_served"] == {"0": 10.0}
    per_second = checks.costs_per_round(result, per="second")  # 60 s between the two samples
    assert per_second["bytes_in"]["0"] == pytest.approx(2_000_000 / 60)
    [listed] = [v for v in checks.check(result) if v["check"] == "listed_within"]
    assert listed["ok"] and "after 35 s" in listed["detail"], listed
    result["scenario"]["expect"]["listed_within"] = 30
    assert not next(v for v in checks.check(result) if v["check"] == "listed_within")["ok"]


@pytest.mark.integration  # it measures CPU time: alone, not beside other tests
@pytest.mark.skipif(available(cpu=True) is not None, reason=str(available(cpu=True)))
@pytest.mark.timeout(120)
def test_a_node_held_to_a_cpu_share_computes_at_that_share(tmp_path):
    """``cpu`` holds a node (and what it starts) to that many cores: a busy loop given 0.25 of a
    core for 3 s gets about 0.75 CPU seconds, where a core would give it about 3."""
    from cgad.bench.wan.testbed import Link, Testbed, _cpu_cgroups

    loop = tmp_path / "busy.py"
    loop.write_text(
        "import os, time\n"
        "end = time.monotonic() + 3\n"
        "while time.monotonic() < end:\n"
        "    pass\n"
        "print(os.times().user + os.times().system, flush=True)\n"
    )
    busy = tmp_path / "busy.sh"  # stands in for `cgad-node`: the testbed runs `<executable> join ...`
    busy.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{loop}"\n')
    busy.chmod(0o755)
    with Testbed([Link(), Link()], cpu=0.25) as bed:
        node = bed.start(0, str(busy), [], tmp_path / "n0")
        node.process.wait(timeout=60)
        used = float(node.log.read_text().split()[-1])
    assert 0.5 < used < 1.0, used  # 0.75 s of CPU in 3 s: the share, not the core
    assert not list(_cpu_cgroups()[0].glob("cgadwan-*")), "the testbed left its CPU cgroups behind"
