"""What N volunteers are worth: the swarm between each member alone and a datacenter.

Two measures, at equal inner steps per member, each per round (curves, not one point):

- **G, the gain captured**: (floor − swarm) / (floor − ceiling). The floor is each member training
  alone on its own shard (the mean over members); the ceiling the same N machines synchronised at
  every inner step: data-parallel AdamW on the N members' batches at once (``node/sim/ceiling.py``),
  at the members' own inner lr. G = 1: the swarm is as good as a datacenter. The ceiling at its own
  best inner lr (of ``CEILING_LRS`` × the members', the lowest mean final loss) is reported beside
  it as ``G_best``, and never chosen to make G larger.
- **W, the worth**: the inner steps one member alone (the whole training split, the members' inner
  lr) needs to reach the swarm's held-out loss, over the swarm's inner steps per member. W = N:
  every volunteer counts in full. Where the lone member does not get there within its
  ``ALONE_ROUNDS`` × N rounds, W is a lower bound (``w_at_least``).

The swarm runs the simulator (the daemon's member engine on a virtual clock) with every flag at
its default but the scale's: the sweep scale (bench/sweep_model.json, a 1024-token BPE, H = 10,
batch 4 × 64, inner lr 1e-3) at N = 4, 8 and 16, and `tiny` at N = 4 (H, batch and lr at their
defaults). Conditions: τ = 0, random delays of 0-4 and 0-8 rounds, stragglers (half the members
2-3× slower) and churn (5% a round, 10% of deliveries lost); every size runs τ = 0, ``--full``
every condition at every size (8 runs them all by default). Ablations beside the default at N = 8,
τ = 0: the defaults before the square-root rule (the inner lr as given, CGA's momentum 0.5), the
rule with that momentum, a fan-in of 4 (``--fan-in 4``, the default before ``auto``), and each member's own
inner first moment (``--moments own``, the default before it was shared). 3 seeds.

Runs go to bench/results/worth.runs.jsonl (``bench/runner/sweep.py``), so the sweep resumes where it
stopped; ``--report`` writes bench/results/worth.json and worth.png from what the log holds.

    .venv/bin/python bench/worth.py [--scale sweep|tiny] [--jobs 2] [--full] [--report]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from cgad.bench.runner.sweep import Run, run_sweep
from cgad.node.front.report import load_runs, rounds_to_reach
from cgad.node.sim.config import SimConfig

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LOG = RESULTS / "worth.runs.jsonl"
SWEEP_MODEL = str(ROOT / "bench" / "sweep_model.json")

SCALES: dict[str, dict[str, Any]] = {
    "sweep": {
        "vocab": 1024,
        "base": dict(
            model=SWEEP_MODEL, inner_steps=10, batch_size=4, seq_len=64, eval_batches=4, inner_lr=1e-3
        ),
        "sizes": (4, 8, 16),
        "rounds": 60,
    },
    "tiny": {"vocab": None, "base": {}, "sizes": (4,), "rounds": 20},
}
CONDITIONS: dict[str, Any] = {
    "τ=0": lambda n: {"delay": "0"},
    "random:4": lambda n: {"delay": "random:4"},
    "random:8": lambda n: {"delay": "random:8"},
    "stragglers": lambda n: {"stragglers": [1.0] * (n - n // 2) + [2.0 + (i % 2) for i in range(n // 2)]},
    "churn": lambda n: {"churn": 0.05, "drop": 0.1},
}
ALL_CONDITIONS_AT = 8  # the size every condition runs at by default
ABLATIONS: dict[str, dict[str, Any]] = {
    # the defaults before the square-root rule: the inner lr as given, CGA's momentum 0.5, each
    # member's own first moment (the rule came first)
    "inner lr as given": {"inner_lr_scaling": "none", "cga_momentum": 0.5, "moments": "own"},
    "CGA momentum 0.5": {"cga_momentum": 0.5},
    # the fixed cap before --fan-in auto (which takes every peer's delta up to 16 at this scale)
    "fan-in 4": {"fan_in": 4},
    # the defaults before the shared first moment: each member's inner m its own
    "own first moment": {"moments": "own"},
}
CEILING_LRS = (1.0, 2.0, 3.0)  # × the members' inner lr
ALONE_ROUNDS = 1  # the lone member trains N × rounds × this many rounds
SEEDS = (0, 1, 2)


def base_config(scale: str, n: int, seed: int, **extra: Any) -> SimConfig:
    s = SCALES[scale]
    return SimConfig(**{**s["base"], **extra}, workers=n, rounds=s["rounds"], seed=seed)


def _data(scale: str, c: SimConfig) -> tuple[Any, int]:
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    vocab = SCALES[scale]["vocab"]  # None: the default tokenizer's own
    tokenizer = load_tokenizer(c.tokenizer, **({"vocab_size": vocab} if vocab else {}))
    return load_dataset(tokenizer, c.data), tokenizer.vocab_size


def swarm_run(scale: str, n: int, seed: int, settings: dict[str, Any]) -> dict:
    """The simulator's record of N members (``optimizer: local`` is the floor)."""
    from cgad.node.sim.simulate import simulate

    c = base_config(scale, n, seed, **settings)
    dataset, vocab = _data(scale, c)
    record = simulate(c, dataset, vocab)
    keep = ("initial_loss", "losses", "final_loss", "worker_final_losses", "rejected", "mean_age", "applied",
            "mean_outer_momentum", "diverged", "bytes_sent", "utilization")  # fmt: skip
    return {k: record[k] for k in keep}


def ceiling_run(scale: str, n: int, seed: int, lr_factor: float) -> dict:
    from cgad.node.sim.ceiling import ceiling_curve

    c = base_config(scale, n, seed)
    dataset, vocab = _data(scale, c)
    return ceiling_curve(c, dataset, vocab, lr=c.inner_lr * lr_factor)


def alone_run(scale: str, rounds: int, seed: int) -> dict:
    from cgad.node.sim.ceiling import alone_curve

    c = base_config(scale, 1, seed)
    dataset, vocab = _data(scale, c)
    return alone_curve(c, dataset, vocab, rounds)


def conditions_at(n: int, full: bool) -> list[str]:
    return list(CONDITIONS) if full or n == ALL_CONDITIONS_AT else ["τ=0"]


def key(scale: str, *parts: Any) -> str:
    return json.dumps([scale, *parts])


def runs(scale: str, full: bool) -> list[Run]:
    """Every run the report needs, the headline's first."""
    s = SCALES[scale]
    sizes, rounds = s["sizes"], s["rounds"]
    steps = rounds * (s["base"].get("inner_steps") or SimConfig.model_fields["inner_steps"].default)
    alone = max(sizes) * rounds * ALONE_ROUNDS
    first, later = [], []

    def swarm(kind: str, n: int, name: Any, seed: int, settings: dict[str, Any]) -> Run:
        args = dict(scale=scale, n=n, seed=seed, settings=settings)
        return Run(key(scale, kind, n, name, seed), swarm_run, args, n * steps)

    def ceiling(n: int, factor: float, seed: int) -> Run:
        args = dict(scale=scale, n=n, seed=seed, lr_factor=factor)
        return Run(key(scale, "ceiling", n, factor, seed), ceiling_run, args, n * steps)

    for seed in SEEDS:
        for n in sizes:
            first.append(Run(key(scale, "floor", n, seed), swarm_run, dict(scale=scale, n=n, seed=seed,
                             settings={"optimizer": "local"}), n * steps))  # fmt: skip
            first += [swarm("swarm", n, "τ=0", seed, {}), ceiling(n, 1.0, seed)]
        lone = dict(scale=scale, rounds=alone, seed=seed)
        first.append(Run(key(scale, "alone", alone, seed), alone_run, lone, alone * steps / rounds))
        for n in sizes:
            later += [swarm("swarm", n, c, seed, CONDITIONS[c](n)) for c in conditions_at(n, full)[1:]]
            later += [ceiling(n, factor, seed) for factor in CEILING_LRS[1:]]
        n = ALL_CONDITIONS_AT if ALL_CONDITIONS_AT in sizes else sizes[0]
        later += [swarm("ablation", n, name, seed, settings) for name, settings in ABLATIONS.items()]
    return first + later


# -- the measures ----------------------------------------------------------------------------


def gain_captured(floor: list[float], swarm: list[float], ceiling: list[float]) -> list[float | None]:
    """G per round: (floor − swarm) / (floor − ceiling); None where the ceiling is not below the floor."""
    return [(f - s) / (f - c) if f - c > 0 else None for f, s, c in zip(floor, swarm, ceiling, strict=True)]


def worth(swarm: list[float], alone: list[float], initial: float) -> list[tuple[float, bool]]:
    """W per round: the rounds the lone member needs to reach each swarm loss (``rounds_to_reach``:
    on its running best, linear between evaluations), over the swarm's rounds; (W, exact). Where
    it never gets there, (its rounds / the swarm's, False): W is at least that."""
    curve = {0: initial, **{k: loss for k, loss in enumerate(alone, start=1)}}
    out = []
    for r, target in enumerate(swarm, start=1):
        reached = rounds_to_reach(curve, target)
        out.append((reached / r, True) if reached is not None else (len(alone) / r, False))
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def _curve_spread(curves: list[list[float | None]]) -> list[dict[str, float] | None]:
    out = []
    for values in zip(*curves, strict=True):
        finite = [v for v in values if v is not None and math.isfinite(v)]
        out.append(_spread(finite) if len(finite) == len(values) else None)
    return out


def _mean_curve(curves: list[list[float]]) -> list[float]:
    return [statistics.fmean(v) for v in zip(*curves, strict=True)]


def report(scale: str, full: bool) -> dict[str, Any]:
    """G and W per round and condition, per size, from what the log holds (complete seeds only)."""
    done = load_runs(LOG)
    s = SCALES[scale]
    alone_rounds = max(s["sizes"]) * s["rounds"] * ALONE_ROUNDS
    settings = {k: (str(Path(v).relative_to(ROOT)) if k == "model" and Path(v).is_absolute() else v)
                for k, v in s["base"].items()}  # fmt: skip
    out: dict[str, Any] = {"scale": scale, "rounds": s["rounds"], "settings": settings, "sizes": {}}
    commits = set()
    for n in s["sizes"]:
        floors = {seed: done.get(key(scale, "floor", n, seed)) for seed in SEEDS}
        alones = {seed: done.get(key(scale, "alone", alone_rounds, seed)) for seed in SEEDS}
        ceilings = {
            f: {seed: done.get(key(scale, "ceiling", n, f, seed)) for seed in SEEDS} for f in CEILING_LRS
        }
        complete = {f: all(ceilings[f].values()) for f in CEILING_LRS}
        finals = {
            f: statistics.fmean(r["final_loss"] for r in ceilings[f].values())
            for f in CEILING_LRS
            if complete[f]
        }
        # the best of every lr tried, or none: the best of those run so far is not the ceiling's best
        best = min(finals, key=finals.get) if len(finals) == len(CEILING_LRS) else None
        size: dict[str, Any] = {
            "floor": _mean_curve([r["losses"] for r in floors.values()]) if all(floors.values()) else None,
            "ceiling": _mean_curve([r["losses"] for r in ceilings[1.0].values()]) if complete[1.0] else None,
            "ceiling_final_by_lr_factor": {str(f): v for f, v in finals.items()},
            "ceiling_best_lr_factor": best,
            "alone": _mean_curve([r["losses"] for r in alones.values()]) if all(alones.values()) else None,
            "conditions": {},
        }
        named = [("swarm", c) for c in conditions_at(n, full)] + [("ablation", a) for a in ABLATIONS]
        for kind, condition in named:
            swarms = {seed: done.get(key(scale, kind, n, condition, seed)) for seed in SEEDS}
            if not all(swarms.values()) or not all(floors.values()) or not complete[1.0]:
                continue
            commits |= {r["commit"] for r in swarms.values()}
            g = [
                gain_captured(floors[sd]["losses"], swarms[sd]["losses"], ceilings[1.0][sd]["losses"])
                for sd in SEEDS
            ]
            row: dict[str, Any] = {
                "kind": kind,
                "loss": _mean_curve([r["losses"] for r in swarms.values()]),
                "final_loss": _spread([r["final_loss"] for r in swarms.values()]),
                "G": _curve_spread(g),
            }
            if best is not None:
                gb = [gain_captured(floors[sd]["losses"], swarms[sd]["losses"], ceilings[best][sd]["losses"])
                      for sd in SEEDS]  # fmt: skip
                row["G_best"] = _curve_spread(gb)
            if all(alones.values()):
                w = [
                    worth(swarms[sd]["losses"], alones[sd]["losses"], alones[sd]["initial_loss"])
                    for sd in SEEDS
                ]
                row["W"] = _curve_spread([[v for v, _ in seed_w] for seed_w in w])
                row["w_at_least"] = [
                    not all(exact for _, exact in per_round) for per_round in zip(*w, strict=True)
                ]
            size["conditions"][condition] = row
        out["sizes"][str(n)] = size
    out["commits"] = sorted(commits)
    out["seeds"] = list(SEEDS)
    return out


def plot(result: dict[str, Any], path: Path) -> Path:
    """Per size: held-out loss against inner steps per member (floor, swarm at τ = 0, ceiling,
    one member alone), and G by round for each condition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [n for n, v in result["sizes"].items() if v["conditions"]]
    fig, axes = plt.subplots(2, max(len(sizes), 1), figsize=(5 * max(len(sizes), 1), 8), squeeze=False)
    h = result["settings"].get("inner_steps") or SimConfig.model_fields["inner_steps"].default
    for col, n in enumerate(sizes):
        size, ax, gx = result["sizes"][n], axes[0][col], axes[1][col]
        steps = lambda curve: [h * (r + 1) for r in range(len(curve))]  # noqa: E731
        lines = [
            ("each member alone (floor)", size["floor"], "grey"),
            ("data-parallel (ceiling)", size["ceiling"], "black"),
        ]
        lines.append(("swarm, τ = 0", size["conditions"].get("τ=0", {}).get("loss"), "tab:blue"))
        for label, curve, color in lines:
            if curve:
                ax.plot(steps(curve), curve, label=label, color=color)
        if size["alone"]:
            alone = size["alone"][: len(size["floor"] or []) * int(n)]
            ax.plot(steps(alone), alone, label="one member alone, longer", color="tab:orange", linestyle="--")
        ax.set_xscale("log")
        ax.set_title(f"N = {n}")
        ax.set_xlabel("inner steps per member")
        ax.set_ylabel("held-out loss (mean of 3 seeds)")
        ax.legend(fontsize=8)
        for condition, row in size["conditions"].items():
            g = [(r + 1, p["mean"]) for r, p in enumerate(row["G"]) if p is not None]
            if g:
                ablation = row["kind"] == "ablation"
                label = condition + (" (ablation)" if ablation else "")
                gx.plot(*zip(*g, strict=True), label=label, linestyle="--" if ablation else "-")
        gx.set_ylim(-0.5, 1.5)  # the first rounds' ratios of small differences swing far
        gx.axhline(1.0, color="black", linewidth=0.5)
        gx.axhline(0.0, color="grey", linewidth=0.5)
        gx.set_xlabel("round")
        gx.set_ylabel("G: share of the ceiling's gain (mean of 3 seeds)")
        gx.legend(fontsize=7)
    fig.suptitle(
        f"What N volunteers are worth ({result['scale']} scale, commits {', '.join(result['commits'])})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


TABLE_ROUNDS = (10, 20, 30, 60)
README = ROOT / "README.md"
RESULTS_MD = ROOT / "docs" / "RESULTS.md"


def _cell(curve: list[dict[str, float] | None] | None, r: int, at_least: list[bool] | None = None) -> str:
    if not curve or r > len(curve) or curve[r - 1] is None:
        return "–"
    p = curve[r - 1]
    bound = "≥ " if at_least and at_least[r - 1] else ""
    return f"{bound}{p['mean']:.2f} [{p['min']:.2f}-{p['max']:.2f}]"


def table(result: dict[str, Any]) -> str:
    """The Markdown table of G, G against the ceiling at its best lr, and W, by round."""
    rounds = [r for r in TABLE_ROUNDS if r <= result["rounds"]]
    heads = (
        [f"G@{r}" for r in rounds] + [f"G_best@{r}" for r in rounds[-2:]] + [f"W@{r}" for r in rounds[-2:]]
    )
    lines = ["| N | run | " + " | ".join(heads) + " |", "|---" * (len(heads) + 2) + "|"]
    for n, size in result["sizes"].items():
        for condition, row in size["conditions"].items():
            name = condition if row["kind"] == "swarm" else f"{condition} (τ = 0)"
            cells = [_cell(row["G"], r) for r in rounds] + [_cell(row.get("G_best"), r) for r in rounds[-2:]]
            cells += [_cell(row.get("W"), r, row.get("w_at_least")) for r in rounds[-2:]]
            lines.append(f"| {n} | {name} | " + " | ".join(cells) + " |")
    best = ", ".join(
        f"N = {n}: {v['ceiling_best_lr_factor']}×" if v["ceiling_best_lr_factor"] else f"N = {n}: not run"
        for n, v in result["sizes"].items()
    )
    lines.append("")
    lines.append(
        f"Means over seeds {result['seeds']} with [min-max]; commits {', '.join(result['commits'])}. "
        f"G against the ceiling at the members' inner lr; G_best against it at its own best of "
        f"{list(CEILING_LRS)} × that lr ({best}); W ≥ where one member alone did not get there in "
        "its rounds."
    )
    return "\n".join(lines)


def headline(result: dict[str, Any]) -> str:
    """The README's first figure: what N volunteers are worth, at τ = 0, at the last round."""
    r = result["rounds"]
    sizes, worths, gains = [], [], []
    for n, size in result["sizes"].items():
        row = size["conditions"].get("τ=0")
        if row and row.get("W") and row["G"][r - 1]:
            sizes.append(n)
            worths.append(
                ("more than " if row["w_at_least"][r - 1] else "") + f"{row['W'][r - 1]['mean']:.1f}"
            )
            gains.append(f"{row['G'][r - 1]['mean']:.2f}")
    return (
        f"**What a volunteer gets**: in the simulator at the sweep scale, after {r} rounds without delay,"
        f" {_listed(sizes)} volunteers are worth {_listed(worths)} of them training alone, and their swarm"
        f" captures {_listed(gains)} of a datacenter's gain (the same machines synchronised at every"
        " step); means of 3 seeds, with ranges, delays, stragglers and churn in"
        " [docs/RESULTS.md](docs/RESULTS.md#what-n-volunteers-are-worth)."
    )


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def write_between(path: Path, name: str, text: str, by: str = "bench/worth.py --report") -> None:
    """Replace what lies between ``<!-- name:begin (generated by BY) -->`` and ``<!-- name:end -->``
    in ``path``."""
    begin, end = f"<!-- {name}:begin (generated by {by}) -->", f"<!-- {name}:end -->"
    content = path.read_text()
    if begin not in content or end not in content:
        raise SystemExit(f"{path} has no {begin} ... {end} block")
    head, rest = content.split(begin, 1)
    path.write_text(head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=SCALES, default="sweep")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="every condition at every size")
    parser.add_argument("--report", action="store_true", help="only write the JSON and PNG from the log")
    args = parser.parse_args(argv)
    if not args.report:
        run_sweep(LOG, runs(args.scale, args.full), args.jobs, f"worth at the {args.scale} scale")
    result = report(args.scale, args.full)
    name = "worth" if args.scale == "sweep" else f"worth_{args.scale}"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, RESULTS / f"{name}.png")
    if args.scale == "sweep":
        write_between(RESULTS_MD, "worth", table(result))
        write_between(README, "worth", headline(result))
    else:
        write_between(
            RESULTS_MD,
            f"worth-{args.scale}",
            table(result),
            by=f"bench/worth.py --scale {args.scale} --report",
        )
    print(f"wrote {RESULTS / name}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
