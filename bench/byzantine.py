"""One hostile worker among five: what each attack does to the honest workers, with the plain
mean of the deliveries (``--aggregation mean``) and with the default (``clip``: each peer's Δ
clipped around the receiver's own), beside the same swarm without an attacker and beside the
floor (each worker training alone).

5 workers of the sweep model (bench/sweep_model.json, 1024-token BPE of the bundled corpus), the
last of them the attacker (it trains, then forges what it publishes: protocol/attacks.py); `cga` at
its defaults, random delays up to 4 rounds, H = 10, batch 4 × 64, inner lr 1e-3, 30 rounds,
seeds 0-2. The loss is the honest workers' mean held-out loss at the end. Writes
bench/results/byzantine.json and byzantine.png; docs/SECURITY.md quotes the table.

    python bench/byzantine.py [--jobs 2] [--seeds 0 1 2] [--only clip]

``--only AGG`` runs that aggregation's cells and keeps the floor's and the other aggregation's
runs from the last results file (for a change that touches one aggregation only).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from cgad.node.front.progress import progress_bar

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "byzantine.json"
MODEL = ROOT / "bench" / "sweep_model.json"
BASE = dict(workers=5, inner_steps=10, rounds=30, batch_size=4, seq_len=64, eval_batches=4, inner_lr=1e-3,
            delay="random:4")  # fmt: skip
# a blatant and a subtle scale, and every other kind the simulator plays; tokens and future at
# amounts an attacker would pick (a huge claim; far past the cutoff)
ATTACKS = [
    "scale:1e6",
    "scale:10",
    "signflip",
    "noise:10",
    "nan",
    "inf",
    "tokens:1000000000000",
    "future:1000",
]
AGGREGATIONS = ["mean", "clip"]
WITHIN = 0.05  # the target: every attack's mean loss within 5% of the same swarm without one


def run_cell(cell: tuple[str, str | None, str, int]) -> dict[str, Any]:
    optimizer, attack, aggregation, seed = cell
    import torch

    from cgad.node.config import SimConfig
    from cgad.node.sim.simulate import simulate
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(None, vocab_size=1024)
    config = SimConfig(
        **BASE, optimizer=optimizer, aggregation=aggregation, seed=seed, model=str(MODEL),
        attackers=1 if attack else 0, attack=attack,
    )  # fmt: skip
    record = simulate(config, load_dataset(tokenizer), tokenizer.vocab_size)
    keep = ("final_loss", "initial_loss", "diverged", "rejected", "clipped", "applied", "losses")
    return {"optimizer": optimizer, "attack": attack, "aggregation": aggregation, "seed": seed,
            **{k: record[k] for k in keep}}  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    losses = [r["final_loss"] for r in runs]
    return {
        "mean": statistics.fmean(losses),
        "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
        "seeds": len(losses),
        "rejected": dict(sum((Counter(r["rejected"]) for r in runs), Counter())),
        "clipped": sum(r["clipped"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", choices=AGGREGATIONS, help="run only this aggregation's cells")
    args = parser.parse_args()
    cells = [("local", None, "clip", seed) for seed in args.seeds]
    cells += [("cga", attack, agg, seed) for seed in args.seeds for agg in AGGREGATIONS
              for attack in [None, *ATTACKS]]  # fmt: skip
    runs = []
    if args.only:
        previous = json.loads(OUT.read_text())["runs"] if OUT.exists() else []
        kept = [
            r
            for r in previous
            if r["seed"] in args.seeds and (r["optimizer"] == "local" or r["aggregation"] != args.only)
        ]
        cells = [c for c in cells if c[0] != "local" and c[2] == args.only]
        if len(kept) != len(args.seeds) * (1 + len(ATTACKS) + 1):
            raise SystemExit(f"{OUT} lacks the runs --only {args.only} keeps; run without --only")
        runs.extend(kept)
    with (
        ProcessPoolExecutor(args.jobs, max_tasks_per_child=1) as pool,
        progress_bar(len(cells), "byzantine", "run") as bar,
    ):
        for future in as_completed([pool.submit(run_cell, cell) for cell in cells]):
            run = future.result()
            runs.append(run)
            bar.set_postfix_str(f"{run['attack']} {run['aggregation']}: {run['final_loss']:.3f}")
            bar.update()
    floor = summarize([r for r in runs if r["optimizer"] == "local"])
    table: dict[str, dict[str, Any]] = {}
    for agg in AGGREGATIONS:
        ours = [r for r in runs if r["optimizer"] == "cga" and r["aggregation"] == agg]
        clean = summarize([r for r in ours if not r["attack"]])
        table[agg] = {"none": clean}
        for attack in ATTACKS:
            cell = summarize([r for r in ours if r["attack"] == attack])
            cell["vs_no_attack"] = cell["mean"] / clean["mean"] - 1
            cell["within_target"] = cell["vs_no_attack"] <= WITHIN
            cell["vs_floor"] = cell["mean"] - floor["mean"]
            table[agg][attack] = cell
    runs.sort(key=lambda r: (str(r["attack"]), r["aggregation"], r["seed"]))
    config = {**BASE, "model": MODEL.name, "attackers": 1, "seeds": args.seeds, "within": WITHIN}
    result = {"config": config, "floor": floor, "table": table, "runs": runs}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, OUT.with_suffix(".png"))
    print(f"floor (each worker alone): {floor['mean']:.3f} ± {floor['std']:.3f}")
    for attack in ["none", *ATTACKS]:
        cells = "  ".join(
            f"{agg} {table[agg][attack]['mean']:.3f} ± {table[agg][attack]['std']:.3f}"
            for agg in AGGREGATIONS
        )
        print(f"{attack:>22}: {cells}")
    print(f"wrote {OUT} and {OUT.with_suffix('.png').name}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["none", *ATTACKS]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.38
    for k, agg in enumerate(AGGREGATIONS):
        cells = [result["table"][agg][a] for a in labels]
        # a diverged swarm's loss dwarfs the rest: shown at the top edge, its value written on it
        top = result["floor"]["mean"] + 1.0
        heights = [min(c["mean"], top) for c in cells]
        xs = [i + (k - 0.5) * width for i in range(len(labels))]
        ax.bar(xs, heights, width, yerr=[c["std"] for c in cells], capsize=3,
               label=f"--aggregation {agg}" + (" (default)" if agg == "clip" else ""))  # fmt: skip
        for x, c in zip(xs, cells, strict=True):
            if c["mean"] > top:
                ax.text(x, top, f"{c['mean']:.1f}", ha="center", va="bottom", fontsize=8)
    floor = result["floor"]["mean"]
    ax.axhline(floor, color="black", linestyle="--", linewidth=1, label=f"each worker alone ({floor:.3f})")
    clean = result["table"]["clip"]["none"]["mean"]
    ax.axhline(clean * (1 + WITHIN), color="gray", linestyle=":", linewidth=1, label="no attack + 5%")
    lows = [result["table"][a]["none"]["mean"] for a in AGGREGATIONS]
    ax.set_ylim(min(lows) - 0.3, floor + 1.1)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.set_ylabel("honest workers' held-out loss after 30 rounds")
    ax.set_title("one attacker among 5 workers, random delay up to 4 rounds (mean ± std over 3 seeds)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
