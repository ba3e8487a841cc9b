"""What a round costs a node as the swarm grows: the scale-4, scale-8 and scale-16 runs side by side.

Each run (bench/wan/scenarios/scale-N.json: N tiny-model daemons on 10 Mbit links, every flag at
its default, five minutes) is read back from bench/results/wan/; per node and round, in the steady
state (``checks.costs_per_round``): bytes received, DHT records stored, the node's own looks at
the DHT, and the DHT requests it answered for others; per round and per second. A swarm whose
costs per node stay flat as N grows scales; ``flat`` compares each cost's mean over the nodes
with the 4-node run's (within ``FLAT_WITHIN``), and the maximum over the nodes is kept beside it
(a DHT server holding the swarm's keys answers for everyone). On this machine N nodes share two
cores, so a node's rounds lengthen with N and ``--codec auto`` sends more per round to fill the
link's share of it: per second is what a volunteer's link and DHT would see with a CPU of its
own. Also per run: how soon node 0 saw every other node live (``listed_within``), and the
swarm's mean final held-out loss beside its floor's where it has one.

The ``scale-cpu-N`` scenarios are the same with every node held to 0.11 of a core (a CPU cgroup
each; 16 nodes fill the two cores): a node then computes at the same speed in a swarm of 4 as in
one of 16, its rounds last as long, and costs per round compare what N itself does
(``--prefix scale-cpu``).

Writes bench/results/wan/<prefix>-n.json and <prefix>-n.png.

    .venv/bin/python bench/wan/run.py bench/wan/scenarios/scale-{4,8,16}.json   (as root: namespaces)
    .venv/bin/python bench/wan/scale_n.py [--prefix scale|scale-cpu] [--tag TAG]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from cgad.bench.wan.checks import COSTS, costs_per_round, final_losses
from cgad.bench.wan.runlog import find_run, read_run

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "wan"
FLAT_WITHIN = 1.5  # a cost per node and round at most this many times the 4-node run's
SIZES = (4, 8, 16)


def summarize_run(result: dict[str, Any], floor: dict[str, Any] | None) -> dict[str, Any]:
    """One run's line: its provenance, verdicts, costs per node and round, losses.

    Args:
        result: the run's record.
        floor: its floor's record, or None.
    """
    costs = {per: costs_per_round(result, per=per) for per in ("round", "second")}
    losses = list(final_losses(result).values())
    floor_losses = list(final_losses(floor).values()) if floor else []
    return {
        "nodes": result["scenario"]["nodes"],
        "cpu_per_node": result["scenario"].get("cpu"),  # cores each node was held to (None: shared)
        "commit": result["commit"],
        "clean": result["clean"],
        "started_at": result["started_at"],
        "checks": {v["check"]: {"ok": v["ok"], "detail": v["detail"]} for v in result["checks"]},
        **{
            f"costs_per_node_and_{per}": {
                name: {
                    "mean": statistics.fmean(per_node.values()),
                    "median": statistics.median(per_node.values()),
                    "max": max(per_node.values()),
                    "nodes": len(per_node),
                }
                for name, per_node in by_cost.items()
            }
            for per, by_cost in costs.items()
        },
        "final_loss_mean": statistics.fmean(losses) if losses else None,
        "final_loss_range": [min(losses), max(losses)] if losses else None,
        "floor_loss_mean": statistics.fmean(floor_losses) if floor_losses else None,
    }


def compare(runs: dict[int, dict[str, Any]], per: str) -> dict[str, Any]:
    """Each cost's mean per node and ``per`` (round or second) at every N over the smallest N's,
    and whether every one stays within ``FLAT_WITHIN``.

    Args:
        runs: ``summarize_run`` lines by N.
        per: "round" or "second".
    """
    field = f"costs_per_node_and_{per}"
    base = runs[min(runs)][field]
    ratios: dict[str, dict[str, float]] = {}
    for name in COSTS:
        if name not in base or not base[name]["mean"]:
            continue
        ratios[name] = {
            str(n): run[field][name]["mean"] / base[name]["mean"]
            for n, run in sorted(runs.items())
            if name in run[field]
        }
    flat = all(r <= FLAT_WITHIN for by_n in ratios.values() for r in by_n.values())
    return {"ratio_of_mean_to_smallest": ratios, "flat": flat}


def plot(runs: dict[int, dict[str, Any]], path: Path) -> None:
    """Each cost per node against N: per round (top) and per second (bottom), mean and max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {
        "bytes_in": "bytes received",
        "records_stored": "DHT records stored",
        "dht_lookups": "own DHT lookups",
        "dht_served": "DHT requests answered",
    }
    names = [n for n in COSTS if all(n in r["costs_per_node_and_round"] for r in runs.values())]
    fig, axes = plt.subplots(2, len(names), figsize=(4 * len(names), 6.4), squeeze=False)
    sizes = sorted(runs)
    for row, per in enumerate(("round", "second")):
        for ax, name in zip(axes[row], names, strict=True):
            for stat, style in (("mean", "o-"), ("max", "s--")):
                values = [runs[n][f"costs_per_node_and_{per}"][name][stat] for n in sizes]
                ax.plot(sizes, values, style, label=stat)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(n) for n in sizes])
            ax.set_ylim(bottom=0)
            ax.set_title(f"{titles[name]}\nper node and {per}", fontsize=9)
            ax.set_xlabel("nodes")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--prefix", default="scale", help="the runs read: <prefix>-N (scale, scale-cpu)")
    parser.add_argument("--tag", help="the runs made with run.py --tag TAG (<prefix>-N-TAG, floors too)")
    args = parser.parse_args(argv)
    directory = Path(args.results)
    tagged = (lambda name: f"{name}-{args.tag}") if args.tag else (lambda name: name)
    runs: dict[int, dict[str, Any]] = {}
    for n in args.sizes:
        result = read_run(find_run(directory, tagged(f"{args.prefix}-{n}")))
        floor_name = result["scenario"].get("floor")
        floor = read_run(find_run(directory, tagged(floor_name))) if floor_name else None
        runs[n] = summarize_run(result, floor)
    summary = {
        "runs": {str(n): run for n, run in sorted(runs.items())},
        "flat_within": FLAT_WITHIN,
        "per_round": compare(runs, "round"),
        "per_second": compare(runs, "second"),
    }
    out = directory / tagged(f"{args.prefix}-n")
    out = out.with_name(out.name + ".json")
    out.write_text(json.dumps(summary, indent=1) + "\n")
    plot(runs, out.with_suffix(".png"))
    for n, run in sorted(runs.items()):
        for per in ("round", "second"):
            costs = run[f"costs_per_node_and_{per}"]
            line = ", ".join(f"{name} {c['mean']:.1f} (max {c['max']:.1f})" for name, c in costs.items())
            print(f"{n:3d} nodes, per {per}: {line}")
        print(f"    {run['checks'].get('listed_within', {}).get('detail')}; loss {run['final_loss_mean']}")
    print(f"flat within {FLAT_WITHIN}x: per round {summary['per_round']['flat']}, per second"
          f" {summary['per_second']['flat']}; wrote {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
