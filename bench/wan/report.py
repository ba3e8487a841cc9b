"""Compare WAN testbed runs: each scenario against the isolated floor, at the same wall-clock.

Reads the runs of ``bench/wan/run.py`` (bench/results/wan/<name>.jsonl.gz, or <name>.json as
they were written before; runlog.py reads both), and for each scenario reports, per node and as
mean [range] over nodes: the held-out loss at a common wall-clock time (the shortest run's end,
so every scenario is judged at the same seconds), and the mean of its evaluations in the minute
before (one evaluation is a few batches: noisy), utilisation (inner steps done / the floor's
mean inner steps in the same seconds), fragments applied, mean age, and what was rejected or
skipped; and, apart from utilisation, what the exchange did per unit of compute: each node's
loss at its last evaluation against the floor's at the same number of inner steps (interpolated;
comparing rounds would not do, since a swarm node trains on while it waits and carries those
steps into the round). Writes bench/results/wan/summary.json, a PNG of mean loss against
wall-clock and against inner steps per scenario, and prints a markdown table (docs/WAN.md).

    python bench/wan/report.py [--floor 10mbit-4-isolated] [--out summary] [names...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

from cgad.bench.wan.provenance import describe, what_ran
from cgad.bench.wan.runlog import find_run, read_run, run_names

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "wan"


def load(name: str, directory: Path = RESULTS) -> dict[str, Any]:
    """Run ``name``'s record, in either format."""
    return read_run(find_run(directory, name))


def node_series(result: dict[str, Any], index: int, field: str) -> list[tuple[float, float]]:
    """(seconds, value) of one status field of one node, from the poller's samples."""
    return [
        (s["t"], s["status"][field])
        for s in result["samples"]
        if s.get("node") == index and s.get("status") and s["status"].get(field) is not None
    ]


def at(series: list[tuple[float, float]], t: float) -> float | None:
    """The latest value at or before ``t``."""
    before = [v for when, v in series if when <= t]
    return before[-1] if before else None


def nodes_of(result: dict[str, Any]) -> list[int]:
    return sorted({s["node"] for s in result["samples"] if "node" in s})


def evaluations(result: dict[str, Any], index: int, t: float) -> list[tuple[float, float]]:
    """(inner steps, held-out loss) at each evaluation of one node up to ``t``: the inner step
    count of the first sample whose history holds that evaluation (sampled each second or so)."""
    points, seen = [], set()
    for s in result["samples"]:
        status = s.get("status")
        if s.get("node") != index or not status or s["t"] > t or not status.get("eval_history"):
            continue
        evaluated_round, loss = status["eval_history"][-1]
        if evaluated_round not in seen and evaluated_round > 0:
            seen.add(evaluated_round)
            points.append((float(status["inner_step"]), float(loss)))
    return points


def last_minute(result: dict[str, Any], index: int, t: float, seconds: float = 60.0) -> float | None:
    """The mean of one node's evaluations in the ``seconds`` before ``t``: a single evaluation
    (a few held-out batches) moves by up to 0.1 from round to round on a swarm node at H = 10."""
    window = [v for when, v in node_series(result, index, "eval_loss") if t - seconds < when <= t]
    # the poller samples every few seconds: count each evaluation once (consecutive repeats)
    values = [v for k, v in enumerate(window) if k == 0 or v != window[k - 1]]
    return statistics.fmean(values) if values else None


def interpolate(curve: list[tuple[float, float]], x: float) -> float | None:
    """The curve's value at x, linear between its points; None outside them."""
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def floor_curve(result: dict[str, Any], t: float) -> list[tuple[float, float]]:
    """The floor's mean loss against inner steps: its nodes evaluate every round of H steps."""
    per_node = [evaluations(result, i, t) for i in nodes_of(result)]
    rounds = min(len(points) for points in per_node)
    return [
        (statistics.fmean(p[r][0] for p in per_node), statistics.fmean(p[r][1] for p in per_node))
        for r in range(rounds)
    ]


def summarize(
    result: dict[str, Any], t: float, floor_steps: float | None, floor: list[tuple[float, float]] | None
) -> dict[str, Any]:
    per_node = []
    for index in nodes_of(result):
        loss = at(node_series(result, index, "eval_loss"), t)
        steps = at(node_series(result, index, "inner_step"), t)
        final = result["final"].get(str(index)) or result["final"].get(index) or {}
        evaluated = evaluations(result, index, t)
        at_steps = interpolate(floor, evaluated[-1][0]) if floor and evaluated else None
        per_node.append({
            "node": index,
            "eval_loss": loss,
            "eval_loss_last_minute": last_minute(result, index, t),
            "inner_steps": steps,
            "utilisation": steps / floor_steps if steps is not None and floor_steps else None,
            # its last evaluation against the floor's at as many inner steps (< 0: better)
            "vs_floor_same_steps": evaluated[-1][1] - at_steps if at_steps is not None else None,
            "applied": final.get("applied"),
            "mean_age": final.get("mean_age"),
            "rejected": final.get("rejected", {}),
            "skipped": final.get("skipped", {}),
            "resyncs": final.get("resyncs"),
        })  # fmt: skip
    losses = [n["eval_loss"] for n in per_node if n["eval_loss"] is not None]
    minute = [n["eval_loss_last_minute"] for n in per_node if n["eval_loss_last_minute"] is not None]
    utilisation = [n["utilisation"] for n in per_node if n["utilisation"] is not None]
    same_steps = [n["vs_floor_same_steps"] for n in per_node if n["vs_floor_same_steps"] is not None]
    return {
        "at_seconds": t,
        "nodes": per_node,
        "eval_loss_mean": statistics.fmean(losses) if losses else None,
        "eval_loss_range": [min(losses), max(losses)] if losses else None,
        "eval_loss_last_minute_mean": statistics.fmean(minute) if minute else None,
        "eval_loss_last_minute_range": [min(minute), max(minute)] if minute else None,
        "utilisation_mean": statistics.fmean(utilisation) if utilisation else None,
        "vs_floor_same_steps_mean": statistics.fmean(same_steps) if same_steps else None,
        "what_ran": what_ran(result),
    }


def compare(results: dict[str, dict[str, Any]], floor_name: str) -> dict[str, Any]:
    """The summary of ``results`` (name -> run; the floor's among them) against the floor's run,
    at the end of the shortest run: what ``main`` writes as JSON."""
    t = min(max(s["t"] for s in r["samples"]) for r in results.values())
    floor_nodes = summarize(results[floor_name], t, None, None)["nodes"]
    floor_steps = statistics.fmean(n["inner_steps"] for n in floor_nodes if n["inner_steps"] is not None)
    floor = floor_curve(results[floor_name], t)
    summary = {name: summarize(r, t, floor_steps, floor) for name, r in results.items()}
    return {"floor": floor_name, "scenarios": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="scenario names (default: every run in bench/results/wan)")
    parser.add_argument("--floor", default="10mbit-4-isolated", help="the isolated run to compare with")
    parser.add_argument("--out", default="summary", help="name of the JSON and PNG written (a comparison)")
    args = parser.parse_args()
    names = args.names or run_names(RESULTS)
    results = {name: load(name) for name in names}
    if args.floor not in results:
        results[args.floor] = load(args.floor)
    compared = compare(results, args.floor)
    summary = compared["scenarios"]
    t = next(iter(summary.values()))["at_seconds"]
    (RESULTS / f"{args.out}.json").write_text(json.dumps(compared, indent=1) + "\n")
    plot(results, RESULTS / f"{args.out}.png")
    print(
        f"| scenario (loss at {t:.0f} s) | eval loss, mean [range] | last minute's mean | utilisation"
        " | applied | mean age | vs floor at equal inner steps |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, row in summary.items():
        lo, hi = row["eval_loss_range"] or (float("nan"), float("nan"))
        minute = row["eval_loss_last_minute_mean"]
        minute_text = "–" if minute is None else f"{minute:.3f}"
        applied = sum(n["applied"] or 0 for n in row["nodes"])
        ages = [n["mean_age"] for n in row["nodes"] if n["mean_age"]]
        same = row["vs_floor_same_steps_mean"]
        same_text = "–" if same is None else f"{same:+.3f}"
        print(
            f"| {name} | {row['eval_loss_mean']:.3f} [{lo:.3f}-{hi:.3f}] | {minute_text} |"
            f" {row['utilisation_mean']:.2f} |"
            f" {applied} | {statistics.fmean(ages) if ages else 0:.2f} | {same_text} |"
        )


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, by_steps) = plt.subplots(1, 2, figsize=(13, 5))
    lowest = float("inf")
    for name, result in results.items():
        nodes = nodes_of(result)
        times = sorted({s["t"] for s in result["samples"] if "node" in s})
        points = []
        for t in times:
            values = [at(node_series(result, i, "eval_loss"), t) for i in nodes]
            values = [v for v in values if v is not None]
            if values:
                points.append((t, statistics.fmean(values)))
        (line,) = ax.plot(
            [p[0] for p in points], [p[1] for p in points], label=f"{name} ({describe(result, True)})"
        )
        for i in nodes:
            evaluated = evaluations(result, i, float("inf"))
            steps, losses = [e[0] for e in evaluated], [e[1] for e in evaluated]
            by_steps.plot(steps, losses, color=line.get_color(), lw=0.8)
            lowest = min([lowest, *losses])
    ax.set(xlabel="wall-clock seconds", ylabel="held-out loss, mean over nodes", title="WAN testbed")
    by_steps.set(xlabel="inner steps", ylabel="held-out loss, each node", title="per unit of compute")
    if lowest < float("inf"):  # the tail, where the methods part, not the first drop from 8
        by_steps.set_ylim(lowest - 0.05, lowest + 1.0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
