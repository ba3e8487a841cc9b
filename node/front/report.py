"""Pictures and tables of simulation records (the JSON of `cgad-node simulate` and the sweep)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no screen on servers and CI
import matplotlib.pyplot as plt

__all__ = ["delay_sort_key", "plot_long_sweep", "plot_records", "summarize"]


def delay_sort_key(delay: str) -> tuple[int, int]:
    """Fixed delays first in order, then random:MAX in order."""
    if delay.startswith("random:"):
        return (1, int(delay.split(":", 1)[1]))
    return (0, int(delay))


def summarize(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value); inf when any value is not finite."""
    values = list(values)
    if not all(math.isfinite(v) for v in values):
        return math.inf, math.inf
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _mean_curve(runs: list[dict], key: str) -> list[float]:
    length = min(len(r.get(key) or []) for r in runs)
    return [statistics.fmean(r[key][i] for r in runs) for i in range(length)]


def plot_records(records: list[dict], path: str | Path, title: str = "") -> Path:
    """Left: held-out loss per round per optimizer (mean over seeds, at the largest delay when
    there are several; dashed: the loss of the workers' mean φ). Middle: final loss against delay,
    with the spread over seeds. Right: consensus distance per round at that delay."""
    path = Path(path)
    by_opt_delay: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        by_opt_delay[(r["optimizer"], r["delay"])].append(r)
    optimizers = list(dict.fromkeys(r["optimizer"] for r in records))
    delays = sorted({r["delay"] for r in records}, key=delay_sort_key)
    shown_delay = delays[-1]
    initial = statistics.fmean(r["initial_loss"] for r in records)

    fig, (curves, finals, drift) = plt.subplots(1, 3, figsize=(18, 5))
    for opt in optimizers:
        runs = by_opt_delay.get((opt, shown_delay), [])
        if not runs:
            continue
        rounds = range(1, len(runs[0]["losses"]) + 1)
        per_round = [summarize(r["losses"][i] for r in runs) for i in range(len(runs[0]["losses"]))]
        means = [m for m, _ in per_round]
        spread = [s for _, s in per_round]
        (line,) = curves.plot(rounds, means, label=opt)
        lo = [m - s for m, s in zip(means, spread, strict=True)]
        hi = [m + s for m, s in zip(means, spread, strict=True)]
        curves.fill_between(rounds, lo, hi, color=line.get_color(), alpha=0.15)
        if all(r.get("mean_phi_losses") for r in runs):
            phi_bar = _mean_curve(runs, "mean_phi_losses")
            curves.plot(range(1, len(phi_bar) + 1), phi_bar, color=line.get_color(), linestyle="--", lw=0.8)
            consensus = _mean_curve(runs, "consensus")
            drift.plot(range(1, len(consensus) + 1), consensus, color=line.get_color(), label=opt)
    curves.axhline(initial, color="grey", linestyle=":", label="initial")
    curves.set(xlabel="outer round", ylabel="held-out loss", title=f"loss per round, delay {shown_delay}")
    curves.set_ylim(top=initial * 1.05)
    curves.legend(fontsize=8)

    x = range(len(delays))
    width = 0.8 / max(1, len(optimizers))
    for k, opt in enumerate(optimizers):
        stats = [summarize(r["final_loss"] for r in by_opt_delay.get((opt, d), [])) for d in delays]
        xs = [i + (k - (len(optimizers) - 1) / 2) * width for i in x]
        ys = [m if math.isfinite(m) else initial * 1.04 for m, _ in stats]
        errs = [s if math.isfinite(s) else 0.0 for _, s in stats]
        finals.errorbar(xs, ys, yerr=errs, fmt="o", capsize=3, label=opt)
    finals.set_xticks(list(x), delays)
    finals.axhline(initial, color="grey", linestyle=":")
    finals.set(xlabel="delay (rounds)", ylabel="final held-out loss (mean ± std over seeds)")
    finals.set_ylim(top=initial * 1.05)
    finals.set_title("final loss against delay (diverged runs drawn at the top)")
    drift.set(
        xlabel="outer round", ylabel="mean ‖φ_i − φ̄‖ / ‖φ̄‖", title=f"consensus distance, delay {shown_delay}"
    )
    drift.set_yscale("symlog", linthresh=1e-4)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_long_sweep(result: dict, path: str | Path) -> Path:
    """Top: held-out loss per round in each condition, every method (mean over seeds). Bottom:
    each method's gain over training alone (local) per condition, with the spread over seeds."""
    path = Path(path)
    conditions = list(result["config"]["conditions"])
    methods = list(result["cells"])
    by_cell: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in result["records"]:
        by_cell[(r["method"], r["condition"])].append(r)
    fig = plt.figure(figsize=(4 * len(conditions), 9))
    grid = fig.add_gridspec(2, len(conditions))
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    for k, condition in enumerate(conditions):
        ax = fig.add_subplot(grid[0, k])
        for method in methods:
            runs = by_cell.get((method, condition))
            if runs:
                curve = _mean_curve(runs, "losses")
                ax.plot(range(1, len(curve) + 1), curve, color=colors[method], label=method, lw=1)
        ax.set(title=condition, xlabel="outer round", ylabel="held-out loss" if k == 0 else None)
        if k == 0:
            ax.legend(fontsize=7)
    gains = fig.add_subplot(grid[1, :])
    width = 0.8 / max(1, len(methods))
    for j, method in enumerate(methods):
        xs, ys, errs = [], [], []
        for i, condition in enumerate(conditions):
            gain = result["gain_over_local"].get(method, {}).get(condition)
            if gain is not None and math.isfinite(gain):
                xs.append(i + (j - (len(methods) - 1) / 2) * width)
                ys.append(gain)
                errs.append(result["cells"][method][condition]["std"])
        gains.bar(xs, ys, width=width, yerr=errs, capsize=2, color=colors[method], label=method)
    gains.axhline(0, color="black", lw=0.8)
    gains.set_xticks(range(len(conditions)), conditions)
    gains.set(ylabel="final loss of local − final loss (higher is better)",
              title="gain over each worker training alone (mean over seeds; bars: std)")  # fmt: skip
    if methods:
        gains.legend(fontsize=7, ncol=min(6, len(methods)))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
