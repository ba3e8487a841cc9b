"""How a swarm scales with its size in the simulator: 4 to 256 members under the daemon's fan-in cap.

Each member is the daemon's member engine (node/sim/simulate.py) with every outer flag at the
daemon's default (CGA, late mixing, clipping) and a fan-in of 4 (the default before ``auto``), on
the sweeps' 0.6M-parameter Llama (bench/sweep_model.json), H = 8, 20 rounds, batch 4 x 64 tokens,
random delays of 0-4 rounds, the data split as daemons draw it (``shared``), deltas sent as 4-bit
blocks with error feedback. For each size: the members' mean final held-out loss and the loss of
their average phi (does the swarm drift apart as it grows?), the consensus distance (mean ||phi_i -
mean phi|| / ||mean phi|| over the last rounds), bytes each member sent per round, fragments it
applied per round and their mean age. Beside the default, at the second-largest size: a wider fan-in
and no mixing, to see what keeps the swarm together.

Runs go to a JSON-lines log as they finish (an interrupted sweep resumes), each with the commit it
ran at. Outputs bench/results/sim_scale.json and sim_scale.png.

    .venv/bin/python bench/sim_scale.py [--sizes 4 16 64 256] [--seeds 0 1] [--jobs 2] [--report-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from cgad.bench.wan.provenance import describe, tree_state
from cgad.node.front.progress import progress_bar
from cgad.node.front.report import load_runs
from cgad.node.sim.config import SimConfig

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "bench" / "results"
LOG = RESULTS / "sim_scale.runs.jsonl"
MODEL = ROOT / "bench" / "sweep_model.json"
SIZES = [4, 16, 64, 256]
SEEDS = [0, 1]
BASE = dict(
    inner_steps=8, rounds=20, batch_size=4, seq_len=64, eval_batches=4, inner_lr=1e-3,
    delay="random:4", data_split="shared", codec="4bit",
    fan_in=4,  # the stored runs' (the default before --fan-in auto, which takes 16 here at 4× the bytes)
)  # fmt: skip
ALONE_FROM = 128  # members: runs this large go one at a time (a 256-member run holds ~10 GB)
# what might keep a large swarm together, tried at the second-largest size beside the default
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "fan-in 16": {"fan_in": 16},
    "no mixing": {"mixing": "none"},
}
LAST_ROUNDS = 5  # consensus is averaged over these


def config(workers: int, seed: int, variant: str) -> SimConfig:
    return SimConfig(workers=workers, seed=seed, model=str(MODEL), **BASE, **VARIANTS[variant])


def run_key(workers: int, seed: int, variant: str) -> str:
    return f"{workers}|{seed}|{variant}"


def commit() -> str:
    """HEAD, with "+changes" when the tree had changes beside it."""
    try:
        return describe(tree_state(ROOT), short=True)
    except (RuntimeError, OSError):  # no git here (a copy of the tree): the runs still count
        return "unknown"


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def _run(workers: int, seed: int, variant: str) -> dict[str, Any]:
    from cgad.node.sim.simulate import simulate
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    c = config(workers, seed, variant)
    record = simulate(c, load_dataset(tokenizer), tokenizer.vocab_size)
    rounds = c.rounds
    return {
        "workers": workers,
        "seed": seed,
        "variant": variant,
        "final_loss": record["final_loss"],
        "final_mean_phi_loss": record["final_mean_phi_loss"],
        "initial_loss": record["initial_loss"],
        "consensus": statistics.fmean(record["consensus"][-LAST_ROUNDS:]),
        "consensus_by_round": record["consensus"],
        "bytes_sent_per_member_round": record["bytes_sent"] / workers / rounds,
        "applied_per_member_round": record["applied"] / workers / rounds,
        "mean_age": record["mean_age"],
        "age_counts": record["age_counts"],
        "utilization": record["utilization"],
        "wall_seconds": record["wall_seconds"],
        "settings": {
            k: v for k, v in record["config"].items() if k in {*BASE, "fan_in", "mixing", "optimizer"}
        },
    }


def load_log() -> dict[str, dict[str, Any]]:
    return load_runs(LOG)


def plan(sizes: list[int], seeds: list[int]) -> list[tuple[int, int, str]]:
    """Every size with the default, and the variants at the second-largest size; largest last."""
    jobs = [(n, s, "default") for n in sizes for s in seeds]
    probe = sorted(sizes)[-2] if len(sizes) > 1 else sizes[0]
    jobs += [(probe, s, v) for v in VARIANTS if v != "default" for s in seeds]
    return sorted(jobs, key=lambda j: j[0])


def run_all(jobs: list[tuple[int, int, str]], workers: int) -> dict[str, dict[str, Any]]:
    done = load_log()
    todo = [j for j in jobs if run_key(*j) not in done]
    at = commit()
    with progress_bar(len(todo), "sim scale", "run") as bar, LOG.open("a") as log:
        for batch, at_once in (
            ([j for j in todo if j[0] < ALONE_FROM], workers),
            ([j for j in todo if j[0] >= ALONE_FROM], 1),
        ):
            if not batch:
                continue
            with ProcessPoolExecutor(at_once, initializer=_init_worker) as pool:
                futures = {pool.submit(_run, *j): j for j in batch}
                for future in as_completed(futures):
                    record = {**future.result(), "key": run_key(*futures[future]), "commit": at}
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    done[record["key"]] = record
                    bar.update(1)
    return {run_key(*j): done[run_key(*j)] for j in jobs}


FIELDS = (
    "final_loss", "final_mean_phi_loss", "consensus", "bytes_sent_per_member_round",
    "applied_per_member_round", "mean_age", "utilization",
)  # fmt: skip


def summarize(records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per (size, variant): each field's mean over seeds with its range, and the seeds' runs."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for record in records.values():
        groups.setdefault((record["workers"], record["variant"]), []).append(record)
    cells = []
    for (workers, variant), runs in sorted(groups.items()):
        cell: dict[str, Any] = {"workers": workers, "variant": variant, "seeds": [r["seed"] for r in runs]}
        for field in FIELDS:
            values = [r[field] for r in runs if r[field] is not None]
            cell[field] = (
                {"mean": statistics.fmean(values), "range": [min(values), max(values)]} if values else None
            )
        cell["commits"] = sorted({r["commit"] for r in runs})
        cells.append(cell)
    return {
        "settings": {**BASE, "model": MODEL.name, "last_rounds_for_consensus": LAST_ROUNDS},
        "cells": cells,
    }


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    default = [c for c in summary["cells"] if c["variant"] == "default"]
    sizes = [c["workers"] for c in default]
    panels = [
        (("final_loss", "members"), ("final_mean_phi_loss", "average phi"), "final held-out loss"),
        (("consensus", "default"), None, "consensus distance"),
        (("bytes_sent_per_member_round", "default"), None, "bytes sent per member and round"),
        (("mean_age", "default"), None, "mean age of applied fragments"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (first, second, title) in zip(axes, panels, strict=True):
        for field, label in [p for p in (first, second) if p]:
            means = [c[field]["mean"] for c in default]
            low = [c[field]["mean"] - c[field]["range"][0] for c in default]
            high = [c[field]["range"][1] - c[field]["mean"] for c in default]
            ax.errorbar(sizes, means, yerr=[low, high], fmt="o-", capsize=3, label=label)
        for cell in summary["cells"]:
            if cell["variant"] != "default" and cell[first[0]]:
                ax.plot([cell["workers"]], [cell[first[0]]["mean"]], "x", ms=8, label=cell["variant"])
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("members")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    parser.add_argument("--seeds", type=int, nargs="+", default=SEEDS)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="summarize the log's runs at these sizes and seeds; run nothing",
    )
    args = parser.parse_args(argv)
    jobs = plan(args.sizes, args.seeds)
    if args.report_only:  # every run of the log at these sizes, each variant included
        logged = sorted(load_log().items(), key=lambda item: (item[1]["workers"], item[1]["seed"]))
        records = {k: r for k, r in logged if r["workers"] in args.sizes and r["seed"] in args.seeds}
    else:
        records = run_all(jobs, args.jobs)
    summary = summarize(records)
    (RESULTS / "sim_scale.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, RESULTS / "sim_scale.png")
    for cell in summary["cells"]:
        line = ", ".join(f"{f} {cell[f]['mean']:.4g}" for f in FIELDS if cell[f])
        print(f"{cell['workers']:4d} {cell['variant']:10s} {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
