"""The CGAD paper's claim at the nearest scale these machines reach: the outer methods at `small`.

The CGAD seed reports CGAD stable across delays at 25M-7B parameters, Adam-Decay competitive at
25M and Nesterov the least stable; at the sweeps' 0.6M-1.9M models here CGAD ended above training
alone. This runs the simulator (the daemon's member engine on a virtual clock) at the `small`
preset (26M parameters): `cga` (the default), `cgad`, `adam-decay`, `nesterov` and `local` (each
worker training alone: the floor), without delay and with random delays of 0-8 rounds, 2 seeds.

Every method at its defaults (outer lr `auto`: derived from H x inner lr for the Adam family,
the method's own otherwise; late mixing for `cga` only), no per-method tuning at this scale: what a
volunteer who picks `--optimizer X` would run, with the simulator's defaults where they differ
from the daemon's (deltas sent as fp32, where the daemon sends 4-bit; H = 10, the daemon's 50).
The scale: 4 workers, batch 4 x 128 (the daemon's sequence length; batch as in bench/scale.py),
the daemon's inner lr and warm-up, disjoint data shards, ``--rounds`` outer rounds (20 by default:
200 inner steps per worker, about 9 minutes a run on two cores, or 18 on one thread).
Cells that are one run by construction run once: training alone under either condition, and
Adam-Decay without delay (CGAD bit for bit when every delivery is fresh).

Runs are appended to bench/results/seed_claim.runs.jsonl as they finish, so the sweep resumes
where it stopped (a run cut short is run again whole); a bar shows inner steps done and left.
`--report` writes bench/results/seed_claim.json (mean and standard deviation over seeds of each
method's final held-out loss and its gain over training alone, per condition; the commit each run
was made at) and seed_claim.png (held-out loss by round, mean over seeds).

``--model tiny`` runs the same table at the `tiny` preset (1.9M parameters, the scale of the
daemon's earlier figures; about a tenth of a `small` run's time), logged apart
(seed_claim_tiny.runs.jsonl): the two side by side say whether the ranking moves with scale in one
setting, not across benches that differ in more than the model. ``--report`` reports every model
with a log.

    .venv/bin/python bench/seed_claim.py [--model small] [--rounds 20] [--threads 2] [--part K/N]
        [--condition C] [--report]

``--part K/N`` runs every N-th run left, from the K-th (1-based), and ``--condition C`` only that
condition's: processes of one thread each share two cores as well as one of two threads does, and
append to the same log under a lock. A run under random delays holds the deltas in flight (~12 GB
at `small`, ~7 GB without delay): on 24 GB run one such beside one without
(``--condition random:8`` beside ``--condition τ=0``), never two.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from cgad.bench.wan.provenance import describe, tree_state
from cgad.node.front.progress import progress_bar
from cgad.node.front.report import load_runs, summarize
from cgad.node.sim.config import SimConfig

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "bench" / "results"
MODELS = ("tiny", "small")  # the scale of the earlier figures here, and the claim's
BASE: dict[str, Any] = {"workers": 4, "inner_steps": 10, "batch_size": 4, "seq_len": 128}
METHODS = ("local", "cga", "cgad", "adam-decay", "nesterov")
CONDITIONS = {"τ=0": "0", "random:8": "random:8"}
SEEDS = (0, 1)


def run_key(method: str, condition: str, seed: int, rounds: int) -> str:
    """The run a table cell reads: cells that are the same run by construction share one."""
    # a worker training alone does the same steps whatever the network does: run once, at τ = 0
    condition = "τ=0" if method == "local" else condition
    # with every delivery fresh Adam-Decay is CGAD bit for bit (both weigh age 0 by 1 and never
    # reach the cutoff; the two runs at seed 0 agree in every field): run once, as CGAD
    method = "cgad" if method == "adam-decay" and condition == "τ=0" else method
    return json.dumps([method, condition, seed, rounds])


def jobs(rounds: int) -> list[tuple[str, str, int]]:
    """Every (method, condition, seed) the table needs, each run once: the first cell of a
    shared run is the one run."""
    cells = [(m, c, s) for s in SEEDS for c in CONDITIONS for m in METHODS]
    unique: dict[str, tuple[str, str, int]] = {}
    for m, c, s in cells:
        unique.setdefault(run_key(m, c, s, rounds), (m, c, s))
    return list(unique.values())


def log_path(model: str) -> Path:
    """Where ``model``'s runs are logged (`small`'s under the bench's own name, as first run)."""
    return RESULTS / ("seed_claim.runs.jsonl" if model == "small" else f"seed_claim_{model}.runs.jsonl")


def config(model: str, method: str, condition: str, seed: int, rounds: int) -> SimConfig:
    return SimConfig(
        **BASE, model=model, rounds=rounds, delay=CONDITIONS[condition], optimizer=method, seed=seed
    )


def run(
    model: str, rounds: int, threads: int, part: tuple[int, int] = (1, 1), condition: str | None = None
) -> None:
    """Run what ``model``'s log does not hold yet, one run at a time on ``threads`` torch threads.

    Args:
        model: the model preset.
        rounds: outer rounds of every run.
        threads: torch threads of this process.
        part: (K, N): this process runs the K-th of every N runs left (1-based).
        condition: only this condition's runs (None: all). A run under delay holds the deltas in
            flight, ~12 GB at `small` against ~7 GB without: two at once do not fit in 24 GB, one
            beside a run without delay does.
    """
    import fcntl

    import torch

    from cgad.node.sim.simulate import simulate
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    torch.set_num_threads(threads)
    log_file = log_path(model)
    done = load_runs(log_file)
    todo = [j for j in jobs(rounds) if run_key(*j, rounds) not in done and condition in (None, j[1])]
    todo = todo[part[0] - 1 :: part[1]]
    print(f"{len(done)} run(s) in the log, {len(todo)} to go")
    if not todo:
        return
    first = config(model, *todo[0], rounds)
    tokenizer = load_tokenizer(first.tokenizer)
    dataset = load_dataset(tokenizer, first.data)
    commit = describe(tree_state(ROOT), short=True)  # runs may span sessions: each says its code
    steps_per_run = first.workers * first.inner_steps * rounds
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with progress_bar(len(todo), f"seed claim at {model}", "run") as bar:
        for method, condition, seed in todo:
            started, what = time.monotonic(), f"{method} {condition} seed {seed}"
            progress = _StepCount(bar, what, steps_per_run)

            c = config(model, method, condition, seed, rounds)
            record = simulate(c, dataset, tokenizer.vocab_size, progress=progress)
            record.pop("config", None)
            key = run_key(method, condition, seed, rounds)
            took = time.monotonic() - started
            record.update(key=key, method=method, condition=condition, seed=seed, rounds=rounds,
                          commit=commit, wall_seconds=took)  # fmt: skip
            with log_file.open("a") as log:  # other parts append to the same log
                fcntl.flock(log, fcntl.LOCK_EX)
                log.write(json.dumps(record) + "\n")
            bar.write(f"{method} {condition} seed {seed}: final held-out loss {record['final_loss']:.4f}")
            bar.update()


class _StepCount:
    """The simulator's progress hook: inner steps done in the run under way, on the bar's line."""

    def __init__(self, bar: Any, what: str, expected: int) -> None:
        self.bar, self.what, self.expected, self.done = bar, what, expected, 0

    def __call__(self, steps: int) -> None:
        self.done += steps
        self.bar.set_postfix_str(f"{self.what}: {self.done} of ~{self.expected} inner steps")


def table_of(model: str, rounds: int) -> dict[str, Any]:
    """What ``model``'s log holds at ``rounds``: per condition, each method's final held-out loss
    (mean, standard deviation, per seed), its gain over training alone (of the means, and per
    seed against the same seed's floor) and the methods ranked by mean."""
    done = load_runs(log_path(model))
    table: dict[str, dict[str, Any]] = {}
    for condition in CONDITIONS:
        floors = {
            s: done[k]["final_loss"] for s in SEEDS if (k := run_key("local", condition, s, rounds)) in done
        }
        for method in METHODS:
            runs = [done[k] for s in SEEDS if (k := run_key(method, condition, s, rounds)) in done]
            if not runs:
                continue
            finals = [r["final_loss"] for r in runs]
            mean, std = summarize(finals)
            alone = method == "local"
            # each seed against the same seed's floor: the same data shards and initial model
            paired = [floors[r["seed"]] - r["final_loss"] for r in runs if r["seed"] in floors]
            table.setdefault(condition, {})[method] = {
                "final_loss": mean,
                "std": std,
                "per_seed": finals,
                "seeds": [r["seed"] for r in runs],
                "diverged": sum(bool(r["diverged"]) for r in runs),
                "gain_over_alone": None if alone or not paired else summarize(paired)[0],
                "gain_per_seed": None if alone else paired,
                "runs_of": runs[0]["method"],  # another method's where the two are one run
                "mean_age": summarize([r["mean_age"] for r in runs])[0],
                "losses": [sum(v) / len(v) for v in zip(*(r["losses"] for r in runs), strict=True)],
                "commits": sorted({r["commit"] for r in runs}),
            }
    ranking = {c: sorted(rows, key=lambda m: rows[m]["final_loss"]) for c, rows in table.items()}
    runs = len({run_key(*job, rounds) for job in jobs(rounds)} & set(done))
    return {"runs": runs, "of": len(jobs(rounds)), "table": table, "ranking": ranking}


def report(rounds: int) -> dict[str, Any]:
    """Every model's table (those with a log), the smallest model first."""
    models = {m: table_of(m, rounds) for m in MODELS if load_runs(log_path(m))}
    return {
        "what": "the outer methods at their defaults in the simulator, by model size (issue 28)",
        "settings": {**BASE, "rounds": rounds, "conditions": CONDITIONS, "seeds": list(SEEDS)},
        "models": models,
    }


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    conditions = list(CONDITIONS)
    fig, axes = plt.subplots(
        max(1, len(models)), len(conditions), figsize=(6.5 * len(conditions), 4.8 * max(1, len(models))),
        squeeze=False,
    )  # fmt: skip
    for row, model in zip(axes, models, strict=False):
        for ax, condition in zip(row, conditions, strict=True):
            part = result["models"][model]
            for method, cell in part["table"].get(condition, {}).items():
                gain = cell["gain_over_alone"]
                label = f"{method}: {cell['final_loss']:.3f}" + (
                    "" if gain is None else f" (gain over alone {gain:+.3f})"
                )
                style = "--" if method == "local" else "-"
                ax.plot(range(1, len(cell["losses"]) + 1), cell["losses"], lw=1.8, ls=style, label=label)
            ax.set(
                title=f"{model}, {condition} ({part['runs']} of {part['of']} runs)",
                xlabel="outer round",
                ylabel="held-out loss (mean over seeds)",
            )
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    s = result["settings"]
    fig.suptitle(
        f"outer methods by model size ({s['workers']} workers, H = {s['inner_steps']}, batch "
        f"{s['batch_size']} x {s['seq_len']}, {s['rounds']} rounds), every method at its defaults"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="small", help="the model preset to run")
    parser.add_argument("--rounds", type=int, default=20, help="outer rounds of every run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (one run at a time)")
    parser.add_argument("--part", default="1/1", help="K/N: run the K-th of every N runs left")
    parser.add_argument("--condition", choices=CONDITIONS, help="only this condition's runs")
    parser.add_argument("--report", action="store_true", help="only write the JSON and PNG from the log")
    args = parser.parse_args(argv)
    if not args.report:
        k, n = (int(x) for x in args.part.split("/"))
        if not 1 <= k <= n:
            parser.error("--part K/N needs 1 <= K <= N")
        run(args.model, args.rounds, args.threads, (k, n), args.condition)
    result = report(args.rounds)
    out = RESULTS / "seed_claim.json"
    out.write_text(json.dumps(result, indent=1))
    runs = ", ".join(f"{m}: {t['runs']} of {t['of']} runs" for m, t in result["models"].items())
    print(f"wrote {out} ({runs}) and {plot(result, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
