"""Run one WAN scenario on the namespace testbed and record what every node reported.

A scenario is data (JSON; see bench/wan/scenarios/): how many nodes, each link's rates, the flags
every node gets (and ``node_args``: more for some nodes, by index), how long to train, events at
given seconds (``kill``, ``restart``, ``partition`` for a while, ``shape`` to new rates,
``leave`` through the admin API), and what the run must show at its end (``expect``: see
checks.py; the runner exits 1 when a check fails). Node 0 starts the swarm; the others join it,
unless ``isolated`` is set (the floor: the same nodes, each training alone). ``nat`` lists the
nodes behind NAT routers of their own (testbed.py), ``default_network`` gives every node the
daemon's listen defaults (a NATed node always has them), ``cpu`` holds every node to that many
cores (a CPU cgroup each: swarms of different sizes then compute at the same speed per node).
Every few seconds the runner asks each node's admin API for its status; at the end every node
is asked to leave.

A swarm scenario may name its floor (``"floor": "10mbit-4-h50-isolated"``, a scenario beside it):
the runner then runs the floor too, in the same invocation and before the swarms that name it
(unless it is given itself), and checks that the swarm's mean final held-out loss is below the
floor's (checks.py). Node i of every run gets the same ``--data-seed``, derived from its index
and the run seed (``--run-seed``, 0 by default; provenance.py), so that runs compared with each
other, and a swarm with its floor, see the same data in the same order (``"data_seed": false``
in a scenario, or ``--no-data-seed``, leaves each node to draw its own from its peer id).

A run records the commit it ran (``git rev-parse HEAD``) and whether the tree held changes beside
it; the runner refuses a tree with changes outside bench/results/ unless given
``--experiment NOTE``, which each run's record keeps.

Writes bench/results/wan/<name>.jsonl.gz (the scenario, the testbed, every status sample, each
node's final status, the checks' verdicts; per sample only what changed: runlog.py reads it back)
and a PNG of held-out loss against wall-clock time per node.

    sudo .venv/bin/python bench/wan/run.py bench/wan/scenarios/10mbit-4.json [more.json ...] [--minutes M]
        [--keep-logs DIR] [--run-seed N] [--no-data-seed] [--experiment NOTE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cgad.bench.wan.checks import EXPECTATIONS, check, check_floor, final_losses
from cgad.bench.wan.provenance import data_seed, describe, refusal, tree_state
from cgad.bench.wan.runlog import LEGACY_SUFFIX, SUFFIX, write_run
from cgad.bench.wan.testbed import Link, Testbed, available, host_cpu_seconds
from cgad.node.daemon.admin import call_admin
from cgad.node.front.progress import progress_bar

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "wan"
POLL_SECONDS = 5.0


SCENARIO_KEYS = {
    "name", "nodes", "mbit", "links", "minutes", "args", "node_args", "events", "isolated",
    "shape_after_join", "expect", "floor", "data_seed", "nat", "default_network", "cpu",
}  # fmt: skip


def load_scenario(path: str | Path) -> dict[str, Any]:
    scenario = json.loads(Path(path).read_text())
    sections = [(scenario, SCENARIO_KEYS, ""), (scenario.get("expect", {}), EXPECTATIONS, "expect.")]
    for given, known, where in sections:
        unknown = sorted(set(given) - known)
        if unknown:  # a typo would otherwise be a check silently not made
            raise ValueError(f"{path}: unknown {where}{unknown[0]!r} (known: {', '.join(sorted(known))})")
    scenario.setdefault("name", Path(path).stem)
    scenario.setdefault("events", [])
    scenario.setdefault("args", [])
    scenario.setdefault("isolated", False)
    scenario.setdefault("data_seed", True)
    if not isinstance(scenario["data_seed"], bool):
        raise ValueError(f"{path}: data_seed is true or false (the value comes from the run seed)")
    if "floor" in scenario and (scenario["isolated"] or not isinstance(scenario["floor"], str)):
        raise ValueError(f"{path}: floor names the scenario of a swarm's floor, and a floor has none")
    nodes = scenario["nodes"]
    same = {"up_mbit": scenario.get("mbit"), "down_mbit": scenario.get("mbit")}
    links = scenario.get("links") or [same] * nodes
    if len(links) != nodes:
        raise ValueError(f"{len(links)} links for {nodes} nodes")
    scenario["links"] = links
    return scenario


def node_args(scenario: dict[str, Any], index: int, run_seed: int) -> list[str]:
    """The flags node ``index`` gets from the scenario: everyone's, its own, and its data seed
    (unless the scenario gives it one, or leaves data order to the nodes)."""
    args = [*scenario["args"], *scenario.get("node_args", {}).get(str(index), [])]
    if scenario.get("data_seed", True) and "--data-seed" not in args:
        args += ["--data-seed", str(data_seed(index, run_seed))]
    return args


def _last(args: list[str], flag: str) -> str | None:
    """The value of the last ``flag`` in ``args`` (the one the daemon takes), or None."""
    values = [args[k + 1] for k, arg in enumerate(args[:-1]) if arg == flag]
    return values[-1] if values else None


def takes_data_seed(executable: str) -> bool:
    """Whether ``cgad-node join`` here has ``--data-seed`` (``--help-all``: the short help lists
    only what a volunteer sets; a cgad-node from before it had one help, which lists every flag)."""
    for asked in ("--help-all", "--help"):
        shown = subprocess.run([executable, "join", asked], capture_output=True, text=True)
        if shown.returncode == 0:
            return "--data-seed" in shown.stdout
    return False


def run(
    scenario: dict[str, Any], workdir: Path, executable: str, run_seed: int = 0, experiment: str | None = None
) -> dict[str, Any]:
    """Run ``scenario`` and return its record (``experiment``: the note the run goes by, or None;
    the record says whether the tree was clean either way)."""
    links = [Link(**link) for link in scenario["links"]]
    samples: list[dict[str, Any]] = []
    finals: dict[int, Any] = {}
    events = sorted(scenario["events"], key=lambda e: e["at"])
    # the code the daemons run (they import it when they start)
    state = tree_state(ROOT)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    given = {str(i): _last(node_args(scenario, i, run_seed), "--data-seed") for i in range(len(links))}
    seeds = {i: int(value) for i, value in given.items() if value is not None}
    shape_after = scenario.get("shape_after_join", False)
    # nodes behind NAT routers, and whether public nodes too take the daemon's listen defaults
    nat = {"nat": scenario["nat"]} if scenario.get("nat") else {}
    defaults = {"listen_flags": False} if scenario.get("default_network") else {}
    with Testbed([Link() for _ in links] if shape_after else links, **nat, cpu=scenario.get("cpu")) as bed:

        def start(index: int, peers: list[str]) -> None:
            args = [*node_args(scenario, index, run_seed),
                    "--checkpoint-dir", str(workdir / f"n{index}" / "ckpt"),
                    "--identity", str(workdir / f"n{index}.key")]  # fmt: skip
            if peers:
                args += ["--peers", *peers]
            bed.start(index, executable, args, workdir / f"n{index}", **defaults)

        start(0, [])
        bootstrap = [bed.multiaddr(0)]
        for index in range(1, len(links)):
            start(index, [] if scenario["isolated"] else bootstrap)
        for index in range(len(links)):
            bed.multiaddr(index)
        if shape_after:
            for index, link in enumerate(links):
                bed.shape(index, link)
        started = time.monotonic()
        host_at_start = host_cpu_seconds()
        nodes_at_start = {i: (node, sum(node.cpu_seconds().values())) for i, node in bed.nodes.items()}
        deadline = started + scenario["minutes"] * 60
        partitions: list[tuple[float, int]] = []
        bar = progress_bar(int(deadline - started), scenario["name"], "s", every=60.0)
        while time.monotonic() < deadline:
            now = time.monotonic() - started
            bar.update(int(now) - bar.n)
            while events and events[0]["at"] <= now:
                event = events.pop(0)
                _apply(event, bed, start, bootstrap, partitions, now)
                samples.append({"t": now, "event": event})
            for until, index in [p for p in partitions if p[0] <= now]:
                bed.set_link(index, True)
                partitions.remove((until, index))
                samples.append({"t": now, "event": {"healed": index}})
            for index, node in bed.nodes.items():
                status = _status(node.admin) if node.alive() else None
                samples.append({"t": now, "node": index, "alive": node.alive(), "status": status})
            losses = [s["status"]["eval_loss"] for s in samples[-len(bed.nodes) :] if s.get("status")]
            losses = [loss for loss in losses if loss is not None]
            if losses:
                bar.set_postfix_str(
                    f"{len(losses)} node(s) up, mean held-out loss {sum(losses) / len(losses):.3f}"
                )
            time.sleep(POLL_SECONDS)
        bar.close()
        cpu = {index: node.cpu_seconds() for index, node in bed.nodes.items() if node.alive()}
        host = _host_load(host_at_start, nodes_at_start, cpu, dict(bed.nodes), time.monotonic() - started)
        for index, node in bed.nodes.items():
            finals[index] = _status(node.admin) if node.alive() else None
            if node.alive():
                try:
                    call_admin(node.admin, "Leave", timeout=10)
                except ConnectionError:
                    pass
        for node in bed.nodes.values():
            try:
                node.process.wait(timeout=120)
            except Exception:
                pass
        testbed = bed.describe()
        logs = {i: node.log.read_text()[-4000:] for i, node in bed.nodes.items()}
        spread = phi_spread([workdir / f"n{i}" / "ckpt" for i in sorted(bed.nodes)])
    result = {"scenario": scenario, **state, "experiment": experiment, "started_at": started_at,
              "run_seed": run_seed, "data_seeds": seeds, "testbed": testbed, "samples": samples,
              "final": finals, "log_tails": logs, "phi_spread": spread,
              "cpu_seconds_by_process": cpu, "host_cpu": host}  # fmt: skip
    result["checks"] = check(result)
    return result


def _host_load(
    at_start: tuple[float, float],
    nodes_at_start: dict[int, tuple[Any, float]],
    cpu: dict[int, dict[str, float]],
    nodes: dict[int, Any],
    wall: float,
) -> dict[str, Any]:
    """The host's CPU over the training time: its cores, how busy they were, the nodes' share of
    it and what the rest of the host took (the runner, and anything else running beside it: a
    run's inner steps depend on the cores left to the nodes, so a busy host explains a slow run).
    The nodes' seconds are those of the nodes alive at the end, less what the same process had
    used at the start (a node restarted since counts whole); a node killed and not restarted is
    counted in the rest of the host."""
    busy, steal = host_cpu_seconds()
    used_by_nodes = 0.0
    for index, used in cpu.items():  # the same node process as at the start, or a new one
        node, before = nodes_at_start.get(index, (None, 0.0))
        used_by_nodes += sum(used.values()) - (before if node is nodes.get(index) else 0.0)
    busy -= at_start[0]
    return {"cores": os.cpu_count(), "wall_s": round(wall, 1), "busy_s": round(busy, 1),
            "steal_s": round(steal - at_start[1], 1), "nodes_s": round(used_by_nodes, 1),
            "others_s": round(busy - used_by_nodes, 1)}  # fmt: skip


def phi_spread(checkpoints: list[Path]) -> dict[str, Any] | None:
    """How far apart the nodes' outer parameters φ ended, from their final checkpoints: each node's
    distance to the mean φ, relative to the mean φ's norm. A swarm whose nodes apply the same
    updates keeps this near 0; isolated nodes drift apart freely."""
    import torch

    from cgad.node.daemon.checkpoint import load_checkpoint

    flats = []
    for directory in checkpoints:
        state = load_checkpoint(directory) if directory.exists() else None
        if state is not None:
            flats.append(torch.cat([p.detach().double().flatten() for p in state["outer"]["phi"]]))
    if len(flats) < 2:
        return None
    mean = torch.stack(flats).mean(dim=0)
    scale = float(mean.norm())
    to_mean = [float((f - mean).norm()) / scale for f in flats]
    return {"nodes": len(flats), "relative_distance_to_mean": to_mean, "mean": sum(to_mean) / len(to_mean)}


def _apply(event: dict, bed: Testbed, start: Any, bootstrap: list[str], partitions: list, now: float) -> None:
    if "kill" in event:
        bed.kill(event["kill"])
    elif "restart" in event:
        index = event["restart"]  # back through any live node (node 0 may be the one restarting)
        others = [bed.multiaddr(i) for i, node in bed.nodes.items() if i != index and node.alive()]
        start(index, others[:2] or bootstrap)
    elif "partition" in event:
        bed.set_link(event["partition"], False)
        partitions.append((now + event.get("for", 60), event["partition"]))
    elif "leave" in event:
        call_admin(bed.nodes[event["leave"]].admin, "Leave", timeout=30)
    elif "shape" in event:
        bed.shape(event["shape"], Link(event.get("up_mbit"), event.get("down_mbit")))
    else:
        raise ValueError(f"unknown event {event}")


def _status(admin: str) -> dict | None:
    try:
        return call_admin(admin, "Status", timeout=10)
    except ConnectionError:
        return None


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    nodes = sorted({s["node"] for s in result["samples"] if "node" in s})
    for index in nodes:
        samples = [s for s in result["samples"] if s.get("node") == index and s.get("status")]
        points = [(s["t"], s["status"]["eval_loss"]) for s in samples if s["status"]["eval_loss"] is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], label=f"node {index}")
    for s in result["samples"]:
        if "event" in s:
            ax.axvline(s["t"], color="grey", lw=0.6, ls=":")
    ax.set(
        xlabel="wall-clock seconds",
        ylabel="held-out loss",
        title=f"{result['scenario']['name']}\n{describe(result)}",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plan(paths: list[str | Path]) -> list[dict[str, Any]]:
    """The scenarios in ``paths``, in the order they run: as given, but with the floor a swarm
    names (a scenario beside the swarm's file) before the first swarm that names it, added where
    it is not given itself."""
    given = [load_scenario(path) for path in paths]
    by_name: dict[str, dict[str, Any]] = {}
    for scenario in given:
        if scenario["name"] in by_name:
            raise ValueError(f"{scenario['name']} given twice")
        by_name[scenario["name"]] = scenario
    for path, scenario in zip(paths, given, strict=True):
        floor = scenario.get("floor")
        if floor is not None and floor not in by_name:
            by_name[floor] = load_scenario(Path(path).parent / f"{floor}.json")
        alone = floor is None or (by_name[floor]["isolated"] and by_name[floor]["nodes"] == scenario["nodes"])
        if not alone:
            raise ValueError(f"{scenario['name']}'s floor {floor} is not {scenario['nodes']} isolated nodes")
    order: list[str] = []
    for scenario in given:
        for name in (scenario.get("floor"), scenario["name"]):
            if name is not None and name not in order:
                order.append(name)
    return [by_name[name] for name in order]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenarios", nargs="+", help="scenario files, run one after another")
    parser.add_argument("--minutes", type=float, help="override each scenario's duration")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--keep-logs", metavar="DIR", help="copy each node's whole log to DIR/<scenario>/")
    parser.add_argument(
        "--run-seed", type=int, default=0, metavar="N",
        help="node i's --data-seed derives from (i, N): the same in every run with this N",
    )  # fmt: skip
    parser.add_argument(
        "--no-data-seed", action="store_true",
        help="give no --data-seed: each node draws its data order from its peer id",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=1, metavar="N",
        help="run each swarm scenario N times (its floor once, first), named <name>[-TAG]-r1..rN,"
        " and write <name>[-TAG]-repeats.json: every run's mean final loss beside the floor's",
    )  # fmt: skip
    parser.add_argument(
        "--tag", help="added to every record's name (e.g. a date), so that runs keep earlier ones"
    )
    parser.add_argument(
        "--experiment", metavar="NOTE",
        help="run on a tree with uncommitted changes; NOTE, what is tried, goes in each run's record",
    )  # fmt: skip
    args = parser.parse_args()
    if args.experiment is not None and not args.experiment.strip():
        sys.exit("--experiment needs a note: what the run tries, or what the uncommitted changes are")
    why = refusal(tree_state(ROOT), args.experiment)
    if why:
        sys.exit(why)
    loaded = [load_scenario(path) for path in args.scenarios]
    why = available(nat=any(s.get("nat") for s in loaded), cpu=any(s.get("cpu") for s in loaded))
    if why:
        sys.exit(f"cannot build the testbed here: {why}")
    # a SIGTERM (kill, timeout) unwinds like Ctrl-C, so that the testbed's teardown runs: by
    # default Python dies at once and leaves the namespaces and the nodes in them running
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    try:  # a typo fails before any run
        scenarios = plan(args.scenarios)
    except (OSError, ValueError) as error:
        sys.exit(str(error))
    executable = shutil.which("cgad-node", path=str(Path(sys.executable).parent)) or "cgad-node"
    for scenario in scenarios:
        if args.no_data_seed:
            scenario["data_seed"] = False
        if args.minutes:
            scenario["minutes"] = args.minutes
    if any(s["data_seed"] for s in scenarios) and not takes_data_seed(executable):
        sys.exit(f"{executable} join has no --data-seed: update it, or run with --no-data-seed")
    given = {load_scenario(path)["name"] for path in args.scenarios}
    added = [s["name"] for s in scenarios if s["name"] not in given]
    if added:
        print(f"running the floor(s) named, first: {', '.join(added)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    results: dict[str, dict[str, Any]] = {}
    repeated: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    runs: list[tuple[str, dict[str, Any]]] = []  # (record name, scenario), in the order they run
    for scenario in scenarios:
        base = f"{scenario['name']}-{args.tag}" if args.tag else scenario["name"]
        if scenario["isolated"] or args.repeats <= 1:
            runs.append((base, scenario))
        else:
            runs += [(f"{base}-r{k}", scenario) for k in range(1, args.repeats + 1)]
    for record, scenario in runs:
        why = refusal(tree_state(ROOT), args.experiment)  # changed while the last one ran?
        if why:
            sys.exit(why)
        with tempfile.TemporaryDirectory(prefix="cgad-wan-") as tmp:
            result = run(scenario, Path(tmp), executable, args.run_seed, args.experiment)
            if args.keep_logs:  # everything but checkpoints and identity keys
                shutil.copytree(tmp, Path(args.keep_logs) / record, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("ckpt", "*.key"))  # fmt: skip
        if "floor" in scenario:
            result["checks"].append(check_floor(result, results.get(scenario["floor"])))
        if scenario["isolated"] or scenario["name"] not in results:
            results[scenario["name"]] = result
        if "floor" in scenario and args.repeats > 1:
            repeated.setdefault(scenario["name"], []).append((record, result))
        written = write_run(out / f"{record}{SUFFIX}", result)
        # a record of an earlier run of this name, in the format before, would now be read instead
        (out / f"{record}{LEGACY_SUFFIX}").unlink(missing_ok=True)
        png = plot(result, out / f"{record}.png")
        for index, status in sorted(result["final"].items()):
            loss = None if status is None else status.get("eval_loss")
            cpu = {k: round(v) for k, v in result["cpu_seconds_by_process"].get(index, {}).items()}
            print(f"node {index}: final eval loss {loss}; CPU seconds {cpu}")
        host = result["host_cpu"]
        room = host["cores"] * host["wall_s"]
        print(
            f"host: {host['cores']} cores busy {host['busy_s']:.0f} s of {room:.0f};"
            f" the nodes {host['nodes_s']:.0f} s, the rest of the host {host['others_s']:.0f} s"
        )
        for verdict in result["checks"]:
            print(f"{'ok  ' if verdict['ok'] else 'FAIL'} {verdict['check']}: {verdict['detail']}")
        print(f"wrote {written} and {png}")
        if not all(verdict["ok"] for verdict in result["checks"]):
            failed.append(scenario["name"])
    for name, done in repeated.items():
        base = f"{name}-{args.tag}" if args.tag else name
        summary = repeats_summary(done, results.get(done[0][1]["scenario"]["floor"]))
        written = out / f"{base}-repeats.json"
        written.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"{name}: {summary['line']}; wrote {written}")
    if failed:
        sys.exit(f"checks failed in {', '.join(failed)}")


def repeats_summary(done: list[tuple[str, dict[str, Any]]], floor: dict[str, Any] | None) -> dict[str, Any]:
    """Every repeat of a swarm scenario beside its floor: each run's mean final held-out loss over
    its nodes (with the nodes' range), their mean and range over runs, and the floor's."""

    def one(name: str, result: dict[str, Any]) -> dict[str, Any]:
        losses = final_losses(result)
        return {
            "record": name, "commit": result.get("commit"), "clean": result.get("clean"),
            "started_at": result.get("started_at"), "node_losses": losses,
            "mean": sum(losses.values()) / len(losses) if losses else None,
            "below_floor": next((v["ok"] for v in result["checks"] if v["check"] == "below_floor"), None),
        }  # fmt: skip

    rows = [one(name, result) for name, result in done]
    means = [r["mean"] for r in rows if r["mean"] is not None]
    base = one("floor", floor) if floor is not None else None
    summary: dict[str, Any] = {"scenario": done[0][1]["scenario"], "runs": rows, "floor": base}
    if means:
        summary["mean"], summary["range"] = sum(means) / len(means), [min(means), max(means)]
        summary["gain"] = base["mean"] - summary["mean"] if base and base["mean"] is not None else None
    line = f"{len(means)} run(s): mean {summary.get('mean', float('nan')):.3f}"
    if means:
        line += f" [{min(means):.3f}-{max(means):.3f}]"
    if base and base["mean"] is not None:
        line += f" against the floor's {base['mean']:.3f}"
    summary["line"] = line
    return summary


if __name__ == "__main__":
    main()
