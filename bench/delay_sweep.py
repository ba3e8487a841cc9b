"""The CGAD delay sweep: every outer optimizer under fixed and random delays, three seeds each.

Stages (tuning seeds are disjoint from the seeds the tables report):
 1. outer-lr grid per optimizer, at no delay and at the largest random delay (seed 100);
 2. CGAD's alpha x cutoff grid at the largest random delay, with its tuned lr (seeds 100, 101);
 3. the table: every optimizer x every delay x seeds 0-2, each with its lr tuned at no delay;
 4. the robustness table: the largest delays again with the lr tuned at the largest random delay,
    for the optimizers whose tuned lr differs there.

Runs go to a JSON-lines log as they finish, so an interrupted sweep resumes where it stopped.
The outputs: bench/results/delay_sweep.json, bench/results/delay_sweep.png, docs/RESULTS.md.

    python bench/delay_sweep.py [--jobs 2] [--report-only]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from cgad.node.front.progress import progress_bar
from cgad.node.front.report import delay_sort_key, load_runs, plot_records, summarize
from cgad.node.sim.config import SimConfig

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LOG = RESULTS / "delay_sweep.runs.jsonl"
MODEL = ROOT / "bench" / "sweep_model.json"

OPTIMIZERS = ["nesterov", "delayed-nesterov", "sgd", "adam", "adam-decay", "cgad", "pa-cgad", "noloco"]
DELAYS = ["0", "1", "2", "4", "8", "random:4", "random:8"]
SEEDS = [0, 1, 2]
TUNING_SEEDS = [100, 101]
ADAM_LRS = [1e-3, 3e-3, 1e-2, 3e-2]
LR_GRID = {
    "nesterov": [0.1, 0.3, 0.7],
    "delayed-nesterov": [0.1, 0.3, 0.7],
    "sgd": [0.3, 0.7, 1.0],  # 1.0: plain averaging of the deliveries, the natural ceiling
    "noloco": [0.3, 0.7, 1.0],
    "adam": ADAM_LRS,
    "adam-decay": ADAM_LRS,
    "cgad": ADAM_LRS,
    "pa-cgad": ADAM_LRS,
}
ALPHAS = [0.1, 0.3, 0.6]
CUTOFFS = [4.0, 8.0, 16.0]
# CGAD's alpha and cutoff while the outer lrs are tuned (stage 1), before its own grid (stage 2)
TUNING_ALPHA, TUNING_CUTOFF = 0.2, 8.0
HARDEST = "random:8"

# One size for every run: 4 workers of a 0.6M-parameter Llama (bench/sweep_model.json), H = 8
# inner steps per round, 20 rounds, batch 4 x 64 tokens. The whole sweep fits in about an hour on
# two CPU cores.
BASE = dict(workers=4, inner_steps=8, rounds=20, batch_size=4, seq_len=64, eval_batches=4, inner_lr=1e-3)


def config(optimizer: str, delay: str, seed: int, lr: float, alpha: float, cutoff: float) -> SimConfig:
    return SimConfig(
        optimizer=optimizer, delay=delay, seed=seed, outer_lr=lr, alpha=alpha, cutoff=cutoff,
        fragments=4 if optimizer == "pa-cgad" else 1, model=str(MODEL), **BASE,
    )  # fmt: skip


def run_key(c: SimConfig) -> str:
    return f"{c.optimizer}|{c.delay}|{c.seed}|{c.outer_lr}|{c.alpha}|{c.cutoff}"


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # two single-threaded runs beat one two-threaded run on tiny models


def _run(c: SimConfig) -> dict:
    from cgad.node.sim.simulate import simulate
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    return simulate(c, load_dataset(tokenizer), tokenizer.vocab_size)


def load_log() -> dict[str, dict]:
    return load_runs(LOG)


def run_all(configs: list[SimConfig], jobs: int, desc: str) -> dict[str, dict]:
    """Run what the log does not hold yet; return the records of all ``configs``."""
    done = load_log()
    todo = [c for c in configs if run_key(c) not in done]
    if todo:
        with (
            ProcessPoolExecutor(jobs, initializer=_init_worker) as pool,
            progress_bar(len(todo), desc, "run") as bar,
            LOG.open("a") as log,
        ):
            futures = {pool.submit(_run, c): c for c in todo}
            for future in as_completed(futures):
                record = future.result()
                record["key"] = run_key(futures[future])
                record.pop("config", None)
                log.write(json.dumps(record) + "\n")
                log.flush()
                done[record["key"]] = record
                bar.update()
    return {run_key(c): done[run_key(c)] for c in configs}


def score(records: list[dict]) -> float:
    """Mean final loss; a diverged run counts as infinitely bad."""
    return summarize(r["final_loss"] if not r["diverged"] else math.inf for r in records)[0]


def tune_lrs(jobs: int) -> dict[str, dict[str, float]]:
    chosen: dict[str, dict[str, float]] = {}
    configs = [
        config(opt, delay, TUNING_SEEDS[0], lr, TUNING_ALPHA, TUNING_CUTOFF)
        for delay in ("0", HARDEST)
        for opt in OPTIMIZERS
        for lr in LR_GRID[opt]
    ]
    records = run_all(configs, jobs, "1/4 outer-lr grid")
    for delay in ("0", HARDEST):
        chosen[delay] = {}
        for opt in OPTIMIZERS:
            by_lr = {
                lr: score(
                    [records[run_key(config(opt, delay, TUNING_SEEDS[0], lr, TUNING_ALPHA, TUNING_CUTOFF))]]
                )
                for lr in LR_GRID[opt]
            }
            chosen[delay][opt] = min(by_lr, key=lambda lr: by_lr[lr])
    return chosen


def tune_cgad(lr: float, jobs: int) -> tuple[float, float, dict]:
    grid = {
        (a, c): [config("cgad", HARDEST, s, lr, a, c) for s in TUNING_SEEDS] for a in ALPHAS for c in CUTOFFS
    }
    records = run_all([c for cs in grid.values() for c in cs], jobs, "2/4 CGAD alpha x cutoff")
    scores = {k: score([records[run_key(c)] for c in cs]) for k, cs in grid.items()}
    best = min(scores, key=lambda k: scores[k])
    return best[0], best[1], {f"alpha={a},cutoff={c}": s for (a, c), s in scores.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)

    lrs = tune_lrs(args.jobs)
    alpha, cutoff, cgad_grid = tune_cgad(lrs[HARDEST]["cgad"], args.jobs)

    def optimizer_hp(opt: str, tuned_at: str) -> tuple[float, float, float]:
        if opt in ("cgad", "pa-cgad", "adam-decay"):
            return lrs[tuned_at][opt], alpha, cutoff
        return lrs[tuned_at][opt], TUNING_ALPHA, TUNING_CUTOFF

    table = [config(o, d, s, *optimizer_hp(o, "0")) for o in OPTIMIZERS for d in DELAYS for s in SEEDS]
    main_records = run_all(table, args.jobs, "3/4 delay table")
    retuned = [o for o in OPTIMIZERS if lrs[HARDEST][o] != lrs["0"][o]]
    robust = [
        config(o, d, s, *optimizer_hp(o, HARDEST)) for o in retuned for d in ("8", HARDEST) for s in SEEDS
    ]
    robust_records = run_all(robust, args.jobs, "4/4 retuned at the largest delay")

    result = {
        "config": {
            **BASE,
            "model": MODEL.name,
            "delays": DELAYS,
            "seeds": SEEDS,
            "tuning_seeds": TUNING_SEEDS,
        },
        "tuned_lr": lrs,
        "lr_grid": LR_GRID,
        "cgad": {"alpha": alpha, "cutoff": cutoff, "grid_mean_final_loss": cgad_grid},
        "records": list(main_records.values()),
        "robust_records": list(robust_records.values()),
    }
    (RESULTS / "delay_sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    plot_records(
        result["records"], RESULTS / "delay_sweep.png", title="delay sweep: 4 workers, outer lr tuned at τ=0"
    )
    write_markdown(result)
    print(f"wrote {RESULTS / 'delay_sweep.json'}, delay_sweep.png and docs/RESULTS.md")


def _cell(records: list[dict]) -> tuple[str, str]:
    if not records:
        return "", ""
    finite = [r for r in records if not r["diverged"]]
    mean, std = summarize(r["final_loss"] for r in records)
    diverged = len(records) - len(finite)
    if diverged:
        return f"div {diverged}/{len(records)}", "∞"
    return f"{mean:.3f} ± {std:.3f}", f"{mean + std:.3f}"


def tables(records: list[dict], delays: list[str]) -> tuple[str, str]:
    header = "| optimizer | " + " | ".join(f"τ={d}" for d in delays) + " |\n"
    header += "|---|" + "---|" * len(delays) + "\n"
    mean_rows, risk_rows = header, header
    for opt in dict.fromkeys(r["optimizer"] for r in records):
        cells = [_cell([r for r in records if r["optimizer"] == opt and r["delay"] == d]) for d in delays]
        mean_rows += f"| {opt} | " + " | ".join(c[0] for c in cells) + " |\n"
        risk_rows += f"| {opt} | " + " | ".join(c[1] for c in cells) + " |\n"
    return mean_rows, risk_rows


def write_markdown(result: dict) -> None:
    """The tables; the discussion around them is written by hand in docs/RESULTS.md's head."""
    delays = sorted({r["delay"] for r in result["records"]}, key=delay_sort_key)
    mean_table, risk_table = tables(result["records"], delays)
    robust_delays = sorted({r["delay"] for r in result["robust_records"]}, key=delay_sort_key)
    robust_mean, robust_risk = (
        tables(result["robust_records"], robust_delays) if result["robust_records"] else ("", "")
    )
    lrs = result["tuned_lr"]
    lr_rows = "| optimizer | grid | lr tuned at τ=0 | lr tuned at τ=random:8 |\n|---|---|---|---|\n"
    for opt in OPTIMIZERS:
        grid = ", ".join(map(str, result["lr_grid"][opt]))
        lr_rows += f"| {opt} | {grid} | {lrs['0'][opt]} | {lrs[HARDEST][opt]} |\n"
    cg = result["cgad"]
    grid_rows = "\n".join(f"- {k}: {v:.3f}" for k, v in cg["grid_mean_final_loss"].items())
    generated = f"""<!-- generated by bench/delay_sweep.py from bench/results/delay_sweep.json -->
## Final held-out loss, mean ± std over seeds {result["config"]["seeds"]}

Outer lr of every optimizer tuned at τ = 0. "div k/3": k of the 3 seeds ended above the initial loss.

{mean_table}
## Single-shot risk (mean + std)

{risk_table}
## Retuned at the largest random delay

Optimizers whose best lr at τ = random:8 differs from their best at τ = 0, rerun with it:

{robust_mean or "(every optimizer kept its lr)"}
{robust_risk}
## Outer learning rates

{lr_rows}
## CGAD's alpha x cutoff grid (τ = random:8, tuning seeds, mean final loss)

Chosen: alpha = {cg["alpha"]}, cutoff = {cg["cutoff"]}.

{grid_rows}
"""
    path = ROOT / "docs" / "RESULTS.md"
    head = path.read_text().split("<!-- generated")[0] if path.exists() else "# Results\n\n"
    path.parent.mkdir(exist_ok=True)
    path.write_text(head + generated)


if __name__ == "__main__":
    main()
