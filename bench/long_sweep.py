"""The long-horizon sweep: every outer method against the floor (each worker alone), 100 rounds.

4 workers of the sweep model (bench/sweep_model.json with a 1024-token BPE of the bundled corpus,
so that an inner step costs what these 2-core machines can afford), H = 10, batch 4 × 64, inner
AdamW lr 1e-3, 100 outer rounds (1000 inner steps per worker, 6.9 → ~3.8 in loss: past the early
phase the short sweep measured). Conditions: no delay, random delays up to 4 and up to 8 rounds
(the latter at the random:4 tuning), stragglers (two of the four workers 2x and 3x slower, so ages
come from speed as on the internet), and churn 0.05 with 10% of deliveries lost. The spec was cut
from 8 workers x 150 rounds x 5 conditions (~15 CPU-hours) to what one session's two cores finish.

Stages (the tuning seed is disjoint from the table's seeds):
 1. each tuned method's grid, per condition, on seed 100;
 2. the table: every method in every condition, seeds 0-2, each at its own tuned setting.

Runs go to a JSON-lines log as they finish (bench/results/long_sweep.runs.jsonl; what the
repository keeps of it is gzipped beside it, .runs.jsonl.gz, and read first), so the sweep
resumes where it stopped; `--stage 1` stops after tuning; `--report` writes the JSON and the PNG
from what the log holds.

`--rerun COND...` runs those conditions' table cells again after a change to what they simulate.

`--scaled` runs the spec's scale, 8 workers over 150 rounds, for the default against the floor
and the baselines, each at the setting the 4-worker sweep tuned, in every condition but random:4
(stragglers: half of the workers 2-3x slower); and the default and averaging without the
direction screen, and with the screen that judges a peer by its record, at τ = 0 (and random:8);
it writes bench/results/long_sweep_8x150.{runs.jsonl,json,png}.

    python bench/long_sweep.py [--scaled] [--jobs 2] [--stage 1|2] [--report] [--rerun COND ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, NamedTuple

from cgad.bench.wan.provenance import describe, tree_state
from cgad.node.front.progress import progress_bar
from cgad.node.front.report import load_runs, summarize
from cgad.node.sim.config import SimConfig

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "bench" / "results"
MODEL = ROOT / "bench" / "sweep_model.json"
VOCAB = 1024

BASE = dict(workers=4, inner_steps=10, rounds=100, batch_size=4, seq_len=64, eval_batches=4, inner_lr=1e-3)
CONDITIONS: dict[str, dict[str, Any]] = {
    "τ=0": {"delay": "0"},
    "random:4": {"delay": "random:4"},
    "random:8": {"delay": "random:8"},
    "stragglers": {"stragglers": [1.0, 1.0, 2.0, 3.0]},
    "churn+drop": {"churn": 0.05, "drop": 0.1},
}
SEEDS = [0, 1, 2]
TUNING_SEED = 100
# H × inner lr: the size of the largest coordinate moves the inner steps can make in a round, the
# scale the Adam family's outer lr is tuned against (and --outer-lr auto derives from)
STEP_SCALE = BASE["inner_steps"] * BASE["inner_lr"]

# Grids narrowed to where the short sweep and the exploration found each method's best (a run
# costs a few CPU-minutes here): CGAD 0.5-1 × H × inner lr, Nesterov 0.7 without delay and 0.1 at
# random:8, NoLoCo 0.7-1.
ADAM_GRID = [{"outer_lr": c * STEP_SCALE} for c in (0.5, 1.0)]
NESTEROV_CGA_GRID = [{"outer_lr": lr, "cga_momentum": mu} for lr, mu in ((0.7, 0.9), (1.0, 0.5))]

# name in the tables -> (optimizer, fixed settings, grid of settings to tune over or None)
METHODS: dict[str, tuple[str, dict[str, Any], list[dict[str, Any]] | None]] = {
    "local": ("local", {}, None),
    "cga": ("cga", {"cga_momentum": 0.0}, None),  # without momentum
    "cga + momentum": ("cga", {}, NESTEROV_CGA_GRID),  # μ scaled by the running freshness
    "sgd (averaging)": ("sgd", {"outer_lr": 1.0}, None),
    "gossip": ("sgd", {"outer_lr": 1.0, "mixing": "gossip"}, None),
    # the age weighting with gossip's drift removal: added when plain averaging + gossip led the
    # delayed conditions on seed 0
    "cga + gossip": ("cga", {"mixing": "gossip", "cga_momentum": 0.0}, None),
    # the default's momentum (following freshness) with gossip, every round or as late as deltas come
    "cga + momentum + gossip": ("cga", {"mixing": "gossip", "cga_momentum": 0.5}, None),
    "cga + late gossip": ("cga", {"mixing": "late", "cga_momentum": 0.5}, None),
    # the default's step with twice the cutoff: added when random:8 dropped half the deliveries
    "cga + momentum, cutoff 8": ("cga", {"cga_momentum": 0.5, "cutoff": 8.0}, None),
    "cgad": ("cgad", {}, ADAM_GRID),
    "pa-cgad": ("pa-cgad", {"fragments": 2}, None),  # at CGAD's tuned lr (TUNED_LIKE)
    "nesterov": ("nesterov", {}, [{"outer_lr": lr} for lr in (0.1, 0.3, 0.7)]),
    "delayed-nesterov": ("delayed-nesterov", {}, [{"outer_lr": lr} for lr in (0.1, 0.3, 0.7)]),
    "noloco": ("noloco", {}, [{"outer_lr": lr} for lr in (0.7, 1.0)]),
    # without the direction screen (--min-cosine -1): added when the 8-worker runs refused 4-15%
    # of the honest deltas as `opposed` late in training, and the workers drifted apart at τ = 0
    "cga + late gossip, no screen": (
        "cga", {"mixing": "late", "cga_momentum": 0.5, "min_cosine": -1.0}, None
    ),
    "sgd, no screen": ("sgd", {"outer_lr": 1.0, "min_cosine": -1.0}, None),
    # no defence at all: every peer's Δ as sent (bench/defence_tax.py measures each defence's
    # price against it)
    "cga + late gossip, mean": ("cga", {"mixing": "late", "cga_momentum": 0.5, "aggregation": "mean"}, None),
    # the settings of the rows above them, run at the code whose screen judged a peer by its
    # record of direction (c8db201, reverted in the next commit): reported from the log only
    # (ARCHIVED), since the code that made them is gone and a rerun would make other rows
    "cga + late gossip, screen by record": ("cga", {"mixing": "late", "cga_momentum": 0.5}, None),
    "sgd, screen by record": ("sgd", {"outer_lr": 1.0}, None),
    # every flag at its default (bench/defence_tax.py --at-defaults), without a defence, and with
    # the data score on
    "defaults": ("cga", {}, None),
    "defaults, mean": ("cga", {"aggregation": "mean"}, None),
    "defaults + data score": ("cga", {"data_score": "on"}, None),
}  # fmt: skip
SCREEN_OFF = ("cga + late gossip, no screen", "sgd, no screen")
AT_DEFAULTS = ("defaults, mean", "defaults", "defaults + data score")  # bench/defence_tax.py's
SCREEN_BY_RECORD = ("cga + late gossip, screen by record", "sgd, screen by record")
ARCHIVED = frozenset(SCREEN_BY_RECORD)  # in the tables from their logged runs, never run again
# tuned once without delay and once under random delay; the delayed conditions use the latter
# (stragglers and churn also put stale deliveries into the outer step)
TUNED_AT = {
    "τ=0": "τ=0", "random:4": "random:4", "random:8": "random:4", "stragglers": "random:4",
    "churn+drop": "random:4",
}  # fmt: skip
# one family, one tuning: PA-CGAD is CGAD streamed over fragments
TUNED_LIKE = {"pa-cgad": "cgad"}
# a worker training alone does the same steps on the same data whatever the network does (and
# never adopts another's state after churn): its runs are made once, without delay
SAME_AS = {("local", c): "τ=0" for c in CONDITIONS}


class Sweep(NamedTuple):
    """One sweep's scale, cells and files (bench/results/<name>.runs.jsonl, .json, .png).
    ``tuned_by``: the sweep whose tuning it takes (None: it tunes its own grids)."""

    name: str
    base: dict[str, Any]
    conditions: dict[str, dict[str, Any]]
    methods: tuple[str, ...]
    tuned_by: Sweep | None = None
    skip: frozenset[tuple[str, str]] = frozenset()  # (method, condition) cells not run

    @property
    def log(self) -> Path:
        return RESULTS / f"{self.name}.runs.jsonl"


LONG = Sweep(
    "long_sweep", BASE, CONDITIONS,
    tuple(m for m in METHODS if m not in SCREEN_OFF + SCREEN_BY_RECORD + AT_DEFAULTS),
)  # fmt: skip
SCALED = Sweep(
    "long_sweep_8x150",
    # the fan-in its stored runs had (the default before --fan-in auto; keys do not name it)
    {**BASE, "workers": 8, "rounds": 150, "fan_in": 4},
    {"τ=0": CONDITIONS["τ=0"], "random:8": CONDITIONS["random:8"],
     "stragglers": {"stragglers": [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]},
     "churn+drop": CONDITIONS["churn+drop"]},
    ("local", "cga + late gossip", "sgd (averaging)", "gossip", "nesterov", "noloco",
     *SCREEN_OFF, *SCREEN_BY_RECORD),
    tuned_by=LONG,
    skip=frozenset(
        [(m, c) for m in SCREEN_OFF + SCREEN_BY_RECORD for c in ("stragglers", "churn+drop")]
        + [("sgd, screen by record", "random:8")]
    ),
)  # fmt: skip


def config(sweep: Sweep, method: str, condition: str, seed: int, settings: dict[str, Any]) -> SimConfig:
    optimizer, fixed, _ = METHODS[method]
    return SimConfig(
        **sweep.base, **sweep.conditions[condition], **fixed, **settings,
        optimizer=optimizer, seed=seed, model=str(MODEL),
    )  # fmt: skip


def run_key(method: str, condition: str, seed: int, settings: dict[str, Any]) -> str:
    condition = SAME_AS.get((method, condition), condition)
    return json.dumps([method, condition, seed, settings], sort_keys=True)


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # two single-threaded runs beat one two-threaded run on tiny models


def _run(c: SimConfig) -> dict:
    from cgad.node.sim.simulate import simulate
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None, vocab_size=VOCAB)
    record = simulate(c, load_dataset(tokenizer), tokenizer.vocab_size)
    record.pop("config", None)
    return record


def load_log(sweep: Sweep) -> dict[str, dict]:
    return load_runs(sweep.log)


def run_all(
    sweep: Sweep,
    jobs: list[tuple[str, str, int, dict]],
    workers: int,
    desc: str,
    rerun: frozenset[str] = frozenset(),
) -> dict[str, dict]:
    """Run what the log does not hold yet (each run once, however many cells share it), and the
    runs of the ``rerun`` conditions again (their new records replace the old ones on reading;
    the old stay in the log with the commit that made them); return the records of all ``jobs``
    by key."""
    done = load_log(sweep)

    def due(job: tuple[str, str, int, dict]) -> bool:
        return run_key(*job) not in done or SAME_AS.get((job[0], job[1]), job[1]) in rerun

    todo = list({run_key(*j): j for j in jobs if due(j)}.values())
    commit = _commit(sweep)  # runs of one table may span sessions: each says which code made it
    if todo:
        RESULTS.mkdir(parents=True, exist_ok=True)
        with (
            ProcessPoolExecutor(workers, initializer=_init_worker) as pool,
            progress_bar(len(todo), desc, "run") as bar,
            sweep.log.open("a") as log,
        ):
            futures = {pool.submit(_run, config(sweep, m, SAME_AS.get((m, c), c), seed, st)): (m, c, seed, st)
                       for m, c, seed, st in todo}  # fmt: skip
            for future in as_completed(futures):
                method, condition, seed, settings = futures[future]
                try:
                    record = future.result()
                except Exception as error:  # one broken run must not throw away the others'
                    bar.write(f"{method} {condition} seed {seed} {settings} failed: {error!r}")
                    bar.update()
                    continue
                condition = SAME_AS.get((method, condition), condition)  # where it actually ran
                record.update(key=run_key(method, condition, seed, settings), method=method,
                              condition=condition, settings=settings, commit=commit)  # fmt: skip
                log.write(json.dumps(record) + "\n")
                log.flush()
                done[record["key"]] = record
                bar.set_postfix_str(f"{method} {condition}: {record['final_loss']:.3f}")
                bar.update()
    return {run_key(*j): done[run_key(*j)] for j in jobs if run_key(*j) in done}


def _commit(sweep: Sweep) -> str:
    """The commit the runs are made at ("+changes" when the tree had changes beside it; what
    sweeps write under bench/results/ is no change to the code that made the runs)."""
    try:
        return describe(tree_state(ROOT), short=True)
    except (RuntimeError, OSError):  # no git here (a copy of the tree): the runs still count
        return "unknown"


def score(record: dict) -> float:
    """Final loss; a diverged run counts as infinitely bad."""
    return math.inf if record["diverged"] else record["final_loss"]


def tuned_settings(records: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """For each method and condition of the 4-worker sweep, the grid point with the lowest loss
    on the tuning seed in the condition it is tuned at (``TUNED_AT``)."""
    chosen: dict[str, dict[str, dict]] = {}
    for method, (_, _, grid) in METHODS.items():
        if method in TUNED_LIKE:
            continue
        for condition in CONDITIONS:
            if not grid:
                chosen.setdefault(method, {})[condition] = {}
                continue
            keys = [run_key(method, TUNED_AT[condition], TUNING_SEED, s) for s in grid]
            scored = [(score(records[k]), i) for i, k in enumerate(keys) if k in records]
            if len(scored) == len(grid):
                chosen.setdefault(method, {})[condition] = grid[min(scored)[1]]
    for method, like in TUNED_LIKE.items():
        if like in chosen:
            chosen[method] = dict(chosen[like])
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    parser.add_argument("--stage", type=int, choices=(1, 2), default=2, help="stop after this stage")
    parser.add_argument("--report", action="store_true", help="only write the report from the log")
    parser.add_argument(
        "--rerun", nargs="+", default=[], choices=list(CONDITIONS), help="run these conditions' cells again"
    )
    parser.add_argument("--scaled", action="store_true", help="8 workers over 150 rounds (see above)")
    args = parser.parse_args()
    sweep = SCALED if args.scaled else LONG

    if sweep.tuned_by is None:
        tuning = [
            (m, c, TUNING_SEED, s)
            for c in dict.fromkeys(TUNED_AT.values())
            for m, (_, _, grid) in METHODS.items()
            if grid
            for s in grid
        ]
        if not args.report:
            run_all(sweep, tuning, args.jobs, "1/2 tuning")
    chosen = tuned_settings(load_log(sweep.tuned_by or sweep))
    # seed by seed, so that an interrupted sweep has every cell at one seed before any at three
    table = [
        (m, c, seed, chosen[m][c])
        for seed in SEEDS
        for c in sweep.conditions
        for m in sweep.methods
        if c in chosen.get(m, {}) and (m, c) not in sweep.skip
    ]
    if not args.report and args.stage == 2:
        runnable = [job for job in table if job[0] not in ARCHIVED]
        run_all(sweep, runnable, args.jobs, "2/2 table", rerun=frozenset(args.rerun))
    write_report(sweep, chosen, table)


def write_report(
    sweep: Sweep, chosen: dict[str, dict[str, dict]], table: list[tuple[str, str, int, dict]]
) -> None:
    from cgad.node.front.report import plot_long_sweep

    done = load_log(sweep)
    rows: dict[str, dict[str, dict]] = {}
    for method, condition, seed, settings in table:
        record = done.get(run_key(method, condition, seed, settings))
        if record is not None:  # a shared run stands in each cell it serves, under that cell's name
            rows.setdefault(method, {}).setdefault(condition, []).append({**record, "condition": condition})
    cells = {
        method: {condition: _cell(records) for condition, records in by_condition.items()}
        for method, by_condition in rows.items()
    }
    floor = {c: cells.get("local", {}).get(c, {}).get("mean") for c in sweep.conditions}
    result = {
        "config": {**sweep.base, "model": MODEL.name, "vocab": VOCAB, "conditions": sweep.conditions,
                   "seeds": SEEDS, "tuning_seed": TUNING_SEED,
                   "tuned_by": sweep.tuned_by.name if sweep.tuned_by else sweep.name},
        "methods": {m: {"optimizer": o, "fixed": f, "grid": g} for m, (o, f, g) in METHODS.items()
                    if m in sweep.methods},
        "tuned": {m: {c: s for c, s in by_c.items() if c in sweep.conditions}
                  for m, by_c in chosen.items() if m in sweep.methods},
        "cells": cells,
        "gain_over_local": {
            m: {c: (floor[c] - cell["mean"]) if floor[c] is not None else None for c, cell in by_c.items()}
            for m, by_c in cells.items()
        },
        "records": [r for by_c in rows.values() for rs in by_c.values() for r in rs],
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{sweep.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot_long_sweep(result, RESULTS / f"{sweep.name}.png")
    done_runs, all_runs = len(result["records"]), len(table)
    print(f"wrote {RESULTS / sweep.name}.json and .png ({done_runs}/{all_runs} table runs)")


def _cell(records: list[dict]) -> dict[str, Any]:
    mean, std = summarize(score(r) for r in records)
    phi_mean, _ = summarize(r["final_mean_phi_loss"] for r in records)
    consensus, _ = summarize(r["consensus"][-1] for r in records)
    return {"mean": mean, "std": std, "risk": mean + std, "seeds": len(records),
            "mean_phi_loss": phi_mean, "consensus": consensus}  # fmt: skip


if __name__ == "__main__":
    main()
