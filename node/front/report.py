"""Pictures and tables of simulation records (the JSON of `cgad-node simulate` and the sweep), and
of `cgad-node demo`: the swarm's held-out loss against a lone node's."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no screen on servers and CI
import matplotlib.pyplot as plt

__all__ = [
    "by_round",
    "by_time",
    "delay_sort_key",
    "gain_in_words",
    "load_runs",
    "plot_demo",
    "plot_long_sweep",
    "plot_records",
    "rounds_to_reach",
    "summarize",
    "thin",
]


def load_runs(path: Path) -> dict[str, dict]:
    """A sweep's JSON-lines log of finished runs, by each record's ``key`` (a later record of a key
    replaces an earlier one); empty where there is no log yet. Runs archived beside it, gzipped
    (``<log>.gz``, what the repository keeps of a large log), come first, then the plain log
    the sweep appends to.

    Args:
        path: the log.
    """
    import gzip
    import json

    archive = path.with_name(path.name + ".gz")
    texts = [gzip.decompress(archive.read_bytes()).decode()] if archive.exists() else []
    texts += [path.read_text()] if path.exists() else []
    done: dict[str, dict] = {}
    for text in texts:
        for line in text.splitlines():
            if line.strip():
                record = json.loads(line)
                done[record["key"]] = record
    return done


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


# ---------------------------------------------------------------- the demo: the swarm and its floor


def by_round(
    swarm: list[dict[int, float]], alone: dict[int, float], every: bool = False
) -> list[tuple[int, float, float]]:
    """``(round, the swarm's mean, the lone node's)`` held-out loss at every round the lone node
    and at least one swarm node evaluated (the mean over those that did).

    Args:
        swarm: each swarm node's held-out loss by round.
        alone: the lone node's held-out loss by round.
        every: only the rounds every swarm node evaluated, so that a mean is never one node's
            loss standing for the swarm's (the last round is often reached by one node first).
    """
    rows = []
    for round_ in sorted(alone):
        losses = [node[round_] for node in swarm if round_ in node]
        if losses and (not every or len(losses) == len(swarm)):
            rows.append((round_, statistics.fmean(losses), alone[round_]))
    return rows


def _latest(points: list[tuple[float, float]], at: float) -> float | None:
    """The last loss of ``(seconds, loss)`` points (in time order) at or before ``at``."""
    seen = [loss for seconds, loss in points if seconds <= at]
    return seen[-1] if seen else None


def by_time(
    swarm: list[list[tuple[float, float]]], alone: list[tuple[float, float]], instants: int = 6
) -> list[tuple[float, float, float]]:
    """``(seconds, the swarm's mean, the lone node's)`` held-out loss at ``instants`` evenly
    spaced moments, from the first at which both have one to the last evaluation: each node's
    latest loss by then (a node with none yet left out of the mean).

    Args:
        swarm: each swarm node's ``(seconds, loss)`` evaluations, in time order, on one clock.
        alone: the lone node's, on the same clock.
        instants: how many moments.
    """
    firsts = [node[0][0] for node in swarm if node]
    if not firsts or not alone:
        return []
    start = max(min(firsts), alone[0][0])
    end = max([alone[-1][0], *(node[-1][0] for node in swarm if node)])
    rows = []
    for k in range(1, instants + 1):
        at = start + (end - start) * k / instants
        losses = [loss for node in swarm if (loss := _latest(node, at)) is not None]
        lone = _latest(alone, at)
        if losses and lone is not None:
            rows.append((at, statistics.fmean(losses), lone))
    return rows


def thin(rows: list, most: int) -> list:
    """At most ``most`` of ``rows``, evenly spaced, the last always among them."""
    if len(rows) <= most:
        return list(rows)
    step = len(rows) / most
    return [rows[min(len(rows) - 1, math.ceil((k + 1) * step) - 1)] for k in range(most)]


def _gain(swarm: float, alone: float) -> str:
    gain = alone - swarm
    if abs(gain) < 5e-4:
        return "level with it"
    side = "ahead" if gain > 0 else "behind"
    return f"{side} by {abs(gain):.3f} ({100 * abs(gain) / alone:.1f}% {'lower' if gain > 0 else 'higher'})"


def rounds_to_reach(curve: dict[int, float], target: float) -> float | None:
    """The round at which a held-out loss curve first gets down to ``target``: on its running
    best, linear between evaluations (so noise never makes it reach a loss early and then lose
    it); None where it never does. Round 0 is the initial loss where the curve has one.

    Args:
        curve: held-out loss by round.
        target: the loss to reach.
    """
    previous: tuple[int, float] | None = None
    best = math.inf
    for round_ in sorted(curve):
        loss = min(best, curve[round_])
        if loss <= target:
            if previous is None or previous[1] <= loss:
                return float(round_)
            return previous[0] + (round_ - previous[0]) * (previous[1] - target) / (previous[1] - loss)
        previous, best = (round_, loss), loss
    return None


def worth_in_words(round_: int, swarm: float, alone: dict[int, float], nodes: int) -> str:
    """What the swarm's N nodes were worth: how many rounds one node alone took to reach the
    loss the swarm had at ``round_``, over ``round_`` (or at least its rounds so far, over it)."""
    if round_ <= 0:
        return ""
    reached = rounds_to_reach(alone, swarm)
    if reached is None:
        most = max(alone, default=0)
        return (
            f"; one node alone has not reached {swarm:.3f} in its {most} rounds: the {nodes} nodes were worth"
            f" more than {most / round_:.1f} nodes alone"
        )
    return (
        f"; one node alone got there after {reached:.1f} rounds: the {nodes} nodes were worth"
        f" {reached / round_:.1f} nodes alone"
    )


def gain_in_words(
    rounds: list[tuple[int, float, float]],
    times: list[tuple[float, float, float]],
    nodes: int,
    alone: dict[int, float] | None = None,
) -> str:
    """What the swarm bought, in a sentence or two: at the last round both evaluated (equal inner
    steps), what that was worth in nodes alone (with ``alone``, the lone node's whole curve), and
    at the last moment of wall-clock.

    Args:
        rounds: ``by_round``'s rows.
        times: ``by_time``'s rows.
        nodes: how many nodes the swarm had.
        alone: the lone node's held-out loss by round, every round it evaluated.
    """
    if not rounds:
        return "the swarm and the lone node have no evaluated round in common: nothing to compare yet"
    round_, swarm, lone = rounds[-1]
    text = (
        f"after {round_} rounds (equal inner steps) the swarm's held-out loss is {swarm:.3f} (the mean of"
        f" {nodes} nodes), a node alone's {lone:.3f}: the swarm is {_gain(swarm, lone)}"
    )
    if alone:
        text += worth_in_words(round_, swarm, alone, nodes)
    if times:
        seconds, swarm, alone = times[-1]
        text += f"; after {seconds / 60:.1f} minutes, {swarm:.3f} against {alone:.3f}: {_gain(swarm, alone)}"
    return text


def plot_demo(
    swarm_rounds: list[dict[int, float]],
    swarm_times: list[list[tuple[float, float]]],
    alone_rounds: dict[int, float],
    alone_times: list[tuple[float, float]],
    path: str | Path,
) -> Path:
    """Left: held-out loss by round, each swarm node thin, the swarm's mean bold, the lone node
    dashed. Right: the same by wall-clock (minutes). The title says the gain at the last round.

    Args:
        swarm_rounds: each swarm node's held-out loss by round.
        swarm_times: each swarm node's ``(seconds, loss)`` evaluations, in time order.
        alone_rounds: the lone node's held-out loss by round.
        alone_times: the lone node's ``(seconds, loss)`` evaluations.
        path: where the PNG goes.
    """
    path = Path(path)
    fig, (rounds_ax, time_ax) = plt.subplots(1, 2, figsize=(13, 5))
    for i, node in enumerate(swarm_rounds):
        if node:
            rounds_ax.plot(sorted(node), [node[r] for r in sorted(node)], color="C0", alpha=0.35, lw=1,
                           label="each swarm node" if i == 0 else None)  # fmt: skip
    rows = by_round(swarm_rounds, alone_rounds)
    mean = {r: loss for r, loss in ((r, statistics.fmean(n[r] for n in swarm_rounds if r in n))
                                    for r in sorted({r for n in swarm_rounds for r in n}))}  # fmt: skip
    if mean:
        rounds_ax.plot(list(mean), list(mean.values()), color="C0", lw=2.5, marker=".",
                       label=f"the swarm ({len(swarm_rounds)} nodes, mean)")  # fmt: skip
    if alone_rounds:
        lone = sorted(alone_rounds)
        rounds_ax.plot(lone, [alone_rounds[r] for r in lone], color="black", ls="--", lw=2, marker=".",
                       label="one node alone (the floor)")  # fmt: skip
    rounds_ax.set(xlabel="outer round", ylabel="held-out loss", title="by round")
    if rounds_ax.get_legend_handles_labels()[0]:
        rounds_ax.legend()
    for i, node in enumerate(swarm_times):
        if node:
            time_ax.plot([s / 60 for s, _ in node], [loss for _, loss in node], color="C0", alpha=0.35, lw=1,
                         drawstyle="steps-post", label="each swarm node" if i == 0 else None)  # fmt: skip
    times = by_time(swarm_times, alone_times, instants=60)
    if times:
        time_ax.plot([s / 60 for s, _, _ in times], [m for _, m, _ in times], color="C0", lw=2.5,
                     label="the swarm (mean)")  # fmt: skip
    if alone_times:
        time_ax.plot([s / 60 for s, _ in alone_times], [loss for _, loss in alone_times], color="black",
                     ls="--", lw=2, drawstyle="steps-post", label="one node alone")  # fmt: skip
    time_ax.set(xlabel="minutes since the demo began", ylabel="held-out loss", title="by wall-clock")
    if time_ax.get_legend_handles_labels()[0]:
        time_ax.legend()
    if rows:
        round_, swarm, alone = rows[-1]
        gain = _gain(swarm, alone)
        fig.suptitle(
            f"cgad-node demo, round {round_}: the swarm {swarm:.3f}, one node alone {alone:.3f}: {gain}"
        )
    else:
        fig.suptitle(f"cgad-node demo: {len(swarm_rounds)} nodes on 127.0.0.1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
