"""Factored mixing's trade-off: the blocking consensus step every K rounds against utilisation,
agreement and loss, in the simulator.

Every run is the default member (``cga`` with late gossip, the non-blocking exchange) at the sweep
model's scale (bench/sweep_model.json, a 1024-token BPE of the bundled corpus, batch 4 × 64, inner
lr 1e-3, as bench/long_sweep.py, but H = 5 so that it fits two shared cores), 16 members with random
delays of 0-4 rounds (the long sweep's random:4), each taking at most 4 peers' fragments per
fragment and round (the daemon's ``--fan-in``; runs from before the simulator had the cap are kept
apart as "fan-in every peer"), and ``--consensus-every K`` for each K (0: never,
today's default), in groups of 4 with a 30 s timeout (the defaults; an inner step is one virtual
second, a round five). Groups form as hivemind's matchmaking forms them, from whoever looks within
the window (10 s: a third of the timeout); runs from before, whose groups were a fixed random
partition per round, are reported apart. The blocking step runs over the same virtual network as
the deltas: from the group's start each member's φ reaches each other member after a delay drawn
from the same 0-4 rounds, and the all-reduce is over when every copy has landed; its members wait,
idle, until then or their timeout (node/sim/groups.py).

Per run: utilisation (the share of the members' present time spent computing), the consensus
distance (mean over members of ‖φ_i − φ̄‖ / ‖φ̄‖, measured each round once the round's
synchronisation is over, and its mean over the run), the members' mean final held-out loss and
that of their average φ̄, and the members' held-out loss at the wall time the run without the
blocking step took (the same compute budget in time: a run that waits gets through fewer rounds).
Cells are means over seeds with the standard deviation.

Runs go to bench/results/factored.runs.jsonl as they finish (the sweep resumes where it stopped);
bench/results/factored.json holds the table, every run, the commit and whether the tree was
clean; bench/results/factored.png draws the trade-off.

    .venv/bin/python bench/factored.py [--ks 0,1,2,4,8,16] [--seeds 0,1] [--rounds 20] [--jobs 2]
    .venv/bin/python bench/factored.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from cgad.bench.wan.provenance import tree_state

ROOT = Path(__file__).resolve().parent.parent
from cgad.node.front.report import load_runs  # noqa: E402

RESULTS = ROOT / "bench" / "results"
LOG = RESULTS / "factored.runs.jsonl"
MODEL = ROOT / "bench" / "sweep_model.json"
VOCAB = 1024
# H = 5 keeps 16 members x 20 rounds within what two shared cores finish in minutes; the blocking
# step's default 30 s timeout then covers the slowest copy (4 rounds of 5 s) and the members' skew
BASE: dict[str, Any] = dict(
    inner_steps=5, batch_size=4, seq_len=64, eval_batches=2, inner_lr=1e-3, delay="random:4",
    consensus_group=4, consensus_timeout=30.0, fan_in=4,
)  # fmt: skip
# runs from before the simulator's fan-in cap carry no fan_in: every member took every peer's fragment
UNCAPPED = "every peer"
# how the simulator forms consensus groups: from whoever looks within the matchmaking window, as
# hivemind does (runs from before carry no groups: a fixed random partition of the members per round)
GROUPS = "window"
PARTITION = "partition"
CURRENT = (BASE["fan_in"], GROUPS)


def config(workers: int, rounds: int, every: int, seed: int) -> Any:
    from cgad.node.sim.config import SimConfig

    return SimConfig(
        **BASE, workers=workers, rounds=rounds, consensus_every=every, seed=seed, model=str(MODEL)
    )


def run_key(workers: int, rounds: int, every: int, seed: int) -> str:
    fields = {"workers": workers, "rounds": rounds, "every": every, "seed": seed, "fan_in": BASE["fan_in"],
              "groups": GROUPS}  # fmt: skip
    return json.dumps(fields, sort_keys=True)


def setting_of(record: dict) -> tuple[int | str, str]:
    """The run's fan-in cap and how its groups formed (what runs of other commits differ in)."""
    return record.get("fan_in", UNCAPPED), record.get("groups", PARTITION)


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # two one-thread runs beat one two-thread run on a tiny model


def _run(workers: int, rounds: int, every: int, seed: int) -> dict:
    from cgad.node.sim.simulate import simulate
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None, vocab_size=VOCAB)
    started = time.perf_counter()
    record = simulate(config(workers, rounds, every, seed), load_dataset(tokenizer), tokenizer.vocab_size)
    record.pop("config", None)
    record["cpu_wall_seconds"] = time.perf_counter() - started
    return record


def load_log() -> dict[str, dict]:
    return load_runs(LOG)


def run_all(jobs: list[tuple[int, int, int, int]], parallel: int) -> None:
    """Run what the log does not hold yet, each record appended as it finishes."""
    done = load_log()
    todo = [job for job in jobs if run_key(*job) not in done]
    if not todo:
        return
    state = tree_state(ROOT)
    RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with ProcessPoolExecutor(parallel, initializer=_init_worker) as pool, LOG.open("a") as log:
        futures = {pool.submit(_run, *job): job for job in todo}
        for n, future in enumerate(as_completed(futures), 1):
            workers, _, every, seed = futures[future]
            record = future.result()
            record.update(key=run_key(*futures[future]), workers=workers, every=every,
                          fan_in=BASE["fan_in"], groups=GROUPS, commit=state["commit"],
                          clean=state["clean"])  # fmt: skip
            log.write(json.dumps(record) + "\n")
            log.flush()
            elapsed = time.perf_counter() - started
            print(
                f"[{n}/{len(todo)}, {elapsed / 60:.1f} min] K={every} seed {seed}:"
                f" loss {record['final_loss']:.3f} φ̄ {record['final_mean_phi_loss']:.3f}"
                f" utilisation {record['utilization']:.3f}"
                f" ({record['cpu_wall_seconds']:.0f} s)",
                flush=True,
            )


def loss_at(record: dict, seconds: float) -> float:
    """The members' mean held-out loss at virtual time ``seconds``: that of the last round the
    swarm had finished by then (the initial loss before its first)."""
    reached = sum(t <= seconds for t in record["round_seconds"])
    return record["losses"][reached - 1] if reached else record["initial_loss"]


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def _ours(records: list[dict], workers: int, rounds: int, setting: tuple[int | str, str]) -> list[dict]:
    return [
        r
        for r in records
        if r["workers"] == workers and len(r["losses"]) == rounds and setting_of(r) == setting
    ]


def summarize(
    records: list[dict], workers: int, rounds: int, setting: tuple[int | str, str]
) -> dict[str, Any]:
    """The table: one row per K, each metric's mean, standard deviation and range over seeds."""
    ours = _ours(records, workers, rounds, setting)
    off = {r["seed"]: r["virtual_seconds"] for r in ours if r["every"] == 0}
    rows: dict[str, dict[str, Any]] = {}
    for every in sorted({r["every"] for r in ours}):
        runs = sorted((r for r in ours if r["every"] == every), key=lambda r: r["seed"])
        step = [r["consensus_step"] or {} for r in runs]
        row = {
            "seeds": [r["seed"] for r in runs],
            "utilization": _spread([r["utilization"] for r in runs]),
            "consensus_final": _spread([r["consensus"][-1] for r in runs]),
            "consensus_mean": _spread([statistics.fmean(r["consensus"]) for r in runs]),
            "final_loss": _spread([r["final_loss"] for r in runs]),
            "final_mean_phi_loss": _spread([r["final_mean_phi_loss"] for r in runs]),
            "virtual_seconds": _spread([r["virtual_seconds"] for r in runs]),
            "averaged": sum(s.get("averaged", 0) for s in step),
            "alone": sum(s.get("alone", 0) for s in step),
        }
        paired = [loss_at(r, off[r["seed"]]) for r in runs if r["seed"] in off]
        if paired:
            row["loss_at_off_wall_time"] = _spread(paired)
        rows["off" if every == 0 else str(every)] = row
    return rows


def write_report(workers: int, rounds: int) -> dict[str, Any]:
    records = [r for r in load_log().values() if r["workers"] == workers]
    table = summarize(records, workers, rounds, CURRENT)
    runs = _ours(records, workers, rounds, CURRENT)
    settings = {(len(r["losses"]), setting_of(r)) for r in records} - {(rounds, CURRENT)}
    result = {
        "config": {**BASE, "workers": workers, "rounds": rounds, "model": MODEL.name, "vocab": VOCAB,
                   "optimizer": "cga", "mixing": "late", "groups": GROUPS},
        "commits": sorted({r["commit"] for r in runs}),
        "clean": all(r["clean"] for r in runs),
        "table": table,
        "records": runs,
        # runs of the log at other settings (another commit's BASE, named by its commit): their own tables
        "other_runs": {
            f"{n} rounds, fan-in {f[0]}, groups: {f[1]}": _other(records, workers, n, f)
            for n, f in sorted(settings, key=lambda s: (s[0], str(s[1])))
        },
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "factored" if workers == 16 else f"factored_{workers}"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, RESULTS / f"{name}.png")
    print_table(table)
    return result


def _other(records: list[dict], workers: int, rounds: int, setting: tuple[int | str, str]) -> dict[str, Any]:
    commits = sorted({r["commit"] for r in _ours(records, workers, rounds, setting)})
    return {"commits": commits, "table": summarize(records, workers, rounds, setting)}


def print_table(table: dict[str, dict[str, Any]]) -> None:
    def cell(row: dict, key: str) -> str:
        v = row.get(key)
        return f"{v['mean']:.3f} ± {v['std']:.3f}" if v else "-"

    keys = ("utilization", "consensus_mean", "consensus_final", "final_loss", "final_mean_phi_loss",
            "loss_at_off_wall_time")  # fmt: skip
    print("| K | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for k, row in table.items():
        print(f"| {k} | " + " | ".join(cell(row, key) for key in keys) + " |")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = result["table"]
    labels = list(table)
    fig, (agree, loss) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in labels:
        row = table[label]
        u, d = row["utilization"], row["consensus_mean"]
        agree.errorbar(u["mean"], d["mean"], xerr=u["std"], yerr=d["std"], fmt="o", capsize=3)
        agree.annotate(f"K={label}", (u["mean"], d["mean"]), textcoords="offset points", xytext=(5, 5))
    agree.set(xlabel="utilisation (share of time computing)", ylabel="mean consensus distance ‖φ_i − φ̄‖/‖φ̄‖",
              title="agreement against utilisation")  # fmt: skip
    x = range(len(labels))
    curves = (
        ("final_loss", "members, after the rounds"),
        ("final_mean_phi_loss", "φ̄, after the rounds"),
        ("loss_at_off_wall_time", "members, at K=off's wall time"),
    )
    for key, name in curves:
        means = [table[k].get(key, {}).get("mean", float("nan")) for k in labels]
        stds = [table[k].get(key, {}).get("std", 0.0) for k in labels]
        loss.errorbar(x, means, yerr=stds, marker="o", capsize=3, label=name)
    loss.set_xticks(list(x), [f"K={k}" for k in labels])
    loss.set(ylabel="held-out loss", title="loss by K")
    loss.legend(fontsize=8)
    config = result["config"]
    fig.suptitle(
        f"factored mixing: {config['workers']} members, fan-in {config['fan_in']}, {config['rounds']} rounds,"
        f" groups: {config.get('groups', PARTITION)},"
        f" H={config['inner_steps']}, delay {config['delay']};"
        f" commit {', '.join(c[:10] for c in result['commits'])}" + ("" if result["clean"] else " + changes"),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ks", default="0,1,2,4,8,16", help="K values (0: no blocking step)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    parser.add_argument("--report", action="store_true", help="only write the report from the log")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    if not args.report:
        # seed by seed, so that an interrupted sweep has every K at one seed before any at two
        jobs = [(args.workers, args.rounds, k, seed) for seed in seeds for k in ks]
        run_all(jobs, args.jobs)
    write_report(args.workers, args.rounds)


if __name__ == "__main__":
    main()
