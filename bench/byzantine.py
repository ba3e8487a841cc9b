"""Hostile workers among eight: what each attack does to the honest workers with no defence (the
plain mean of the deliveries, ``--aggregation mean``), with the default (``clip``: each peer's Δ
clipped around the receiver's own, with the direction screen) and with clipping alone
(``--min-cosine -1``), beside the same swarm without an attacker and beside the floor (each worker
training alone).

8 workers of the sweep model (bench/sweep_model.json, 1024-token BPE of the bundled corpus), the
last one or two of them attackers (they train, then forge what they publish: node/sim/attacks.py;
two attackers push one direction together); `cga` at its defaults, random delays up to 4 rounds,
H = 10, batch 4 × 64, inner lr 1e-3, 30 rounds, seeds 0-2. The loss is the honest workers' mean
held-out loss at the end. Runs go to bench/results/byzantine.runs.jsonl as they finish (the bench
resumes where it stopped); the summary to byzantine.json and byzantine.png; docs/SECURITY.md
quotes the table.

    python bench/byzantine.py [--jobs 2] [--seeds 0 1 2] [--aggregations clip ...] [--attacks LABEL ...]
                              [--name NAME] [--report]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from cgad.bench.wan.provenance import describe, tree_state
from cgad.node.front.progress import progress_bar
from cgad.node.front.report import load_runs

ROOT = Path(__file__).resolve().parent.parent

OUT = ROOT / "bench" / "results" / "byzantine.json"
LOG = OUT.with_suffix(".runs.jsonl")
MODEL = ROOT / "bench" / "sweep_model.json"
BASE = dict(workers=8, inner_steps=10, rounds=30, batch_size=4, seq_len=64, eval_batches=4, inner_lr=1e-3,
            delay="random:4")  # fmt: skip
# (attack, attackers): a blatant and a subtle scale, every other kind the simulator plays at
# amounts an attacker would pick (a huge claim; far past the cutoff), and two colluders
ATTACKS: list[tuple[str, int]] = [
    ("scale:1e6", 1),
    ("scale:10", 1),
    ("signflip", 1),
    ("noise:10", 1),
    ("nan", 1),
    ("inf", 1),
    ("tokens:1000000000000", 1),
    ("future:1000", 1),
    ("mirror:1", 1),
    ("signflip", 2),
    ("mirror:1", 2),
    # adaptive: its honest Δ plus the longest push on the final norm's gains inside every screen
    ("edge:norm.weight", 1),
    ("edge:norm.weight", 2),
]
# name -> the settings that make it (the default: none)
AGGREGATIONS: dict[str, dict[str, Any]] = {
    "mean": {"aggregation": "mean"},
    "clip": {},
    "clip, no screen": {"min_cosine": -1.0},
    "clip + data score": {"data_score": "on"},
}
DEFAULT = "clip"
# clipping alone only where the screen could make a difference: the attacks of a Δ of honest size
# (the non-finite, far-future and token attacks are refused or capped before any screen, and a
# scaled Δ is clipped to the radius)
SCREEN_MATTERS = {None, "signflip", "noise:10", "mirror:1"}
WITHIN = 0.05  # the target: every attack's mean loss within 5% of the same swarm without one


def label(attack: str | None, attackers: int) -> str:
    return "none" if attack is None else attack if attackers == 1 else f"{attackers} x {attack}"


def run_key(optimizer: str, attack: str | None, attackers: int, aggregation: str, seed: int) -> str:
    return json.dumps([optimizer, attack, attackers, aggregation, seed])


def run_cell(cell: tuple[str, str | None, int, str, int]) -> dict[str, Any]:
    optimizer, attack, attackers, aggregation, seed = cell
    import torch

    from cgad.node.sim.config import SimConfig
    from cgad.node.sim.simulate import simulate
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(None, vocab_size=1024)
    config = SimConfig(
        **BASE, **AGGREGATIONS[aggregation], optimizer=optimizer, seed=seed, model=str(MODEL),
        attackers=attackers if attack else 0, attack=attack,
    )  # fmt: skip
    record = simulate(config, load_dataset(tokenizer), tokenizer.vocab_size)
    keep = ("final_loss", "initial_loss", "diverged", "rejected", "clipped", "applied", "losses", "probed")
    return {"key": run_key(*cell), "optimizer": optimizer, "attack": attack, "attackers": attackers,
            "aggregation": aggregation, "seed": seed, **{k: record[k] for k in keep}}  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    losses = [r["final_loss"] for r in runs]
    return {
        "mean": statistics.fmean(losses),
        "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
        "seeds": len(losses),
        "final_losses": losses,
        "rejected": dict(sum((Counter(r["rejected"]) for r in runs), Counter())),
        "clipped": sum(r["clipped"] for r in runs),
    }


def _commit() -> str:
    """The commit the runs are made at ("+changes" when the tree had changes beside it)."""
    try:
        return describe(tree_state(ROOT), short=True)
    except (RuntimeError, OSError):  # no git here (a copy of the tree): the runs still count
        return "unknown"


def main() -> None:
    global OUT, LOG
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--report", action="store_true", help="only write the summary from the log")
    parser.add_argument("--aggregations", nargs="+", choices=AGGREGATIONS, default=list(AGGREGATIONS))
    labels = [label(a, n) for a, n in ATTACKS]
    parser.add_argument(
        "--attacks",
        nargs="+",
        choices=labels,
        default=labels,
        help="the attacks to play (their rows' labels)",
    )
    parser.add_argument(
        "--name", default=OUT.stem, help="results as bench/results/NAME.{runs.jsonl,json,png} (a rerun apart)"
    )
    args = parser.parse_args()
    OUT = OUT.with_name(f"{args.name}.json")
    LOG = OUT.with_suffix(".runs.jsonl")
    cells = [("local", None, 0, DEFAULT, seed) for seed in args.seeds]
    cells += [("cga", attack, n, agg, seed) for seed in args.seeds for agg in args.aggregations
              for attack, n in [(None, 0), *[(a, k) for a, k in ATTACKS if label(a, k) in args.attacks]]
              if agg != "clip, no screen" or attack in SCREEN_MATTERS]  # fmt: skip
    done = load_runs(LOG)
    todo = [] if args.report else [c for c in cells if run_key(*c) not in done]
    commit = _commit()
    if todo:
        with (
            ProcessPoolExecutor(args.jobs, max_tasks_per_child=1) as pool,
            progress_bar(len(todo), "byzantine", "run") as bar,
            LOG.open("a") as log,
        ):
            for future in as_completed([pool.submit(run_cell, cell) for cell in todo]):
                run = {**future.result(), "commit": commit}
                log.write(json.dumps(run) + "\n")
                log.flush()
                done[run["key"]] = run
                bar.set_postfix_str(f"{label(run['attack'], run['attackers'])} {run['aggregation']}: "
                                    f"{run['final_loss']:.3f}")  # fmt: skip
                bar.update()
    runs = [done[run_key(*c)] for c in cells if run_key(*c) in done]
    floors = [r for r in runs if r["optimizer"] == "local"]
    if not floors:
        raise SystemExit(f"{LOG} holds no run of the floor yet: run without --report")
    floor = summarize(floors)
    table: dict[str, dict[str, Any]] = {}
    for agg in AGGREGATIONS:
        ours = [r for r in runs if r["optimizer"] == "cga" and r["aggregation"] == agg]
        clean_runs = [r for r in ours if not r["attack"]]
        if not clean_runs:
            continue
        clean = summarize(clean_runs)
        table[agg] = {"none": clean}
        for attack, n in ATTACKS:
            these = [r for r in ours if r["attack"] == attack and r["attackers"] == n]
            if not these:
                continue
            cell = summarize(these)
            cell["vs_no_attack"] = cell["mean"] / clean["mean"] - 1
            cell["within_target"] = cell["vs_no_attack"] <= WITHIN
            cell["vs_floor"] = cell["mean"] - floor["mean"]
            cell["below_floor"] = cell["mean"] < floor["mean"]
            table[agg][label(attack, n)] = cell
    config = {**BASE, "model": MODEL.name, "seeds": args.seeds, "within": WITHIN,
              "aggregations": AGGREGATIONS, "default": DEFAULT,
              "commits": sorted({r.get("commit", "unknown") for r in runs})}  # fmt: skip
    result = {"config": config, "floor": floor, "table": table}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, OUT.with_suffix(".png"))
    print(f"floor (each worker alone): {floor['mean']:.3f} ± {floor['std']:.3f}")
    for name in ["none", *[label(a, n) for a, n in ATTACKS]]:
        row = "  ".join(
            f"{agg} {table[agg][name]['mean']:.3f} ± {table[agg][name]['std']:.3f}"
            for agg in table
            if name in table[agg]
        )
        print(f"{name:>24}: {row}")
    print(f"wrote {OUT} and {OUT.with_suffix('.png').name}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    aggregations = list(result["table"])
    played = {name for agg in aggregations for name in result["table"][agg]}
    labels = ["none", *[label(a, n) for a, n in ATTACKS if label(a, n) in played]]
    fig, ax = plt.subplots(figsize=(13, 4.5))
    width = 0.8 / len(aggregations)
    for k, agg in enumerate(aggregations):
        cells = [result["table"][agg].get(a, {"mean": float("nan"), "std": 0.0}) for a in labels]
        # a diverged swarm's loss dwarfs the rest: shown at the top edge, its value written on it
        top = result["floor"]["mean"] + 1.0
        heights = [min(c["mean"], top) for c in cells]
        xs = [i + (k - (len(aggregations) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, heights, width, yerr=[c["std"] for c in cells], capsize=3,
               label=agg + (" (default)" if agg == result["config"]["default"] else ""))  # fmt: skip
        for x, c in zip(xs, cells, strict=True):
            if c["mean"] > top:
                ax.text(x, top, f"{c['mean']:.1f}", ha="center", va="bottom", fontsize=8)
    floor = result["floor"]["mean"]
    ax.axhline(floor, color="black", linestyle="--", linewidth=1, label=f"each worker alone ({floor:.3f})")
    shown = result["config"]["default"] if result["config"]["default"] in result["table"] else aggregations[0]
    clean = result["table"][shown]["none"]["mean"]
    ax.axhline(clean * (1 + WITHIN), color="gray", linestyle=":", linewidth=1, label="no attack + 5%")
    lows = [result["table"][a]["none"]["mean"] for a in aggregations]
    ax.set_ylim(min(lows) - 0.3, floor + 1.1)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.set_ylabel("honest workers' held-out loss after 30 rounds")
    ax.set_title("attackers among 8 workers, random delay up to 4 rounds (mean ± std over 3 seeds)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
