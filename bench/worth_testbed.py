"""What N daemons on the namespace testbed are worth: the gain they capture against the
simulator's ceiling at their own inner steps, and the inner steps they complete against their
floor's in the same minutes.

Reads the repeats file of a testbed swarm (``bench/wan/run.py --repeats``: its runs and the floor,
the same nodes each training alone for the same minutes, with the same data orders), and runs the
simulator's ceiling (``node/sim/ceiling.py``: one member with N times the batch, synchronised at
every inner step) at the scenario's model and H for as many rounds as the daemons trained, seed
0, at the members' inner lr (kept in bench/results/worth_testbed.runs.jsonl, the sweep runner's
log, so a second report reads it back). For each run, by round (H inner steps each, the daemons'
held-out loss every round, the mean over nodes):

- **G** = (floor − swarm) / (floor − ceiling) at the swarm's last round every node evaluated (the
  ceiling a mean over the rounds within 2 of it: ``smoothed``);
- **steps**: the swarm's mean inner steps over the floor's mean inner steps, both at the end of
  the same minutes (what the exchange cost the trainers).

Several repeats files (settings of one scenario, oldest first) make one table. A repeats file
names its floor's run (``floor_run``), or it is the scenario's floor with the file's tag.

Writes bench/results/worth_testbed.json and worth_testbed.png (loss against inner steps: the last
setting's runs, the floor, the ceiling).

    python bench/worth_testbed.py bench/results/wan/10mbit-4-dec07-repeats.json [...] [--jobs 1] [--report]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from cgad.bench.runner.sweep import Run, run_sweep
from cgad.bench.wan.runlog import find_run, read_run
from cgad.bench.worth import write_between
from cgad.node.front.report import load_runs
from cgad.node.sim.config import SimConfig

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LOG = RESULTS / "worth_testbed.runs.jsonl"
OUT = RESULTS / "worth_testbed.json"
# the scenario flags the simulator's ceiling follows; any other flag would make it another setting
FLAGS = {"--model": "model", "--inner-steps": "inner_steps"}
IGNORED = {"--run-id", "--seed"}  # the run's name, and φ₀'s seed (the ceiling starts from seed 0)


def sim_settings(args: list[str]) -> dict[str, Any]:
    """The simulator's settings of a scenario's daemon flags (``FLAGS``); a flag the ceiling does
    not follow is refused, so that no G is taken against another setting's ceiling."""
    settings: dict[str, Any] = {}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        if flag in FLAGS:
            settings[FLAGS[flag]] = int(value) if flag == "--inner-steps" else value
        elif flag not in IGNORED:
            raise ValueError(f"the ceiling does not follow {flag}: no G for this scenario")
    return settings


def ceiling_run(settings: dict[str, Any], workers: int, rounds: int) -> dict:
    """The simulator's ceiling for ``workers`` daemons of ``settings``, ``rounds`` rounds."""
    from cgad.node.sim.ceiling import ceiling_curve
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    c = SimConfig(**settings, workers=workers, rounds=rounds, seed=0)
    tokenizer = load_tokenizer(c.tokenizer)
    return ceiling_curve(c, load_dataset(tokenizer, c.data), tokenizer.vocab_size)


def curve(final: dict[str, dict]) -> tuple[dict[int, float], float]:
    """The nodes' mean held-out loss by round (rounds every node evaluated) and their mean inner
    steps, from a run's final statuses."""
    histories = [{int(r): loss for r, loss in status["eval_history"]} for status in final.values()]
    rounds = set.intersection(*(set(h) for h in histories))
    mean = {r: statistics.fmean(h[r] for h in histories) for r in sorted(rounds)}
    return mean, statistics.fmean(status["inner_step"] for status in final.values())


CEILING_SMOOTHING = 2  # rounds each side: the ceiling is one model read on 4 held-out batches


def smoothed(curve: list[float], r: int) -> float:
    """``curve`` (``curve[r - 1]``: after r rounds) at round r, the mean over the rounds within
    ``CEILING_SMOOTHING`` of it: one evaluation of one model moves by a few hundredths from round
    to round, where the swarm's and the floor's are means over their nodes."""
    window = curve[max(r - 1 - CEILING_SMOOTHING, 0) : r + CEILING_SMOOTHING]
    return statistics.fmean(window)


def measure(swarm: dict[int, float], floor: dict[int, float], ceiling: list[float]) -> dict[str, Any]:
    """G by round where the floor, the swarm and the ceiling (``ceiling[r - 1]``: after r rounds,
    ``smoothed``) all have one, and at the swarm's last such round."""
    rounds = [r for r in swarm if r in floor and 1 <= r <= len(ceiling)]
    by_round = {}
    for r in rounds:
        f, s, c = floor[r], swarm[r], smoothed(ceiling, r)
        by_round[r] = (f - s) / (f - c) if f > c else None
    last = max(rounds)
    return {"round": last, "G": by_round[last], "G_by_round": by_round}


def ceiling_of(settings: dict[str, Any], workers: int, rounds: int) -> list[float] | None:
    """The shortest ceiling curve in the log of these settings with at least ``rounds`` rounds."""
    found = []
    for key, record in (
        load_runs(LOG) if LOG.exists() or LOG.with_suffix(".jsonl.gz").exists() else {}
    ).items():
        kind, their_settings, their_workers, their_rounds = json.loads(key)
        if (kind, their_settings, their_workers) == ("ceiling", settings, workers) and their_rounds >= rounds:
            found.append((their_rounds, record["losses"]))
    return min(found)[1] if found else None


def report(
    repeats_path: Path, jobs: int, run: bool, rounds: int | None = None
) -> tuple[dict[str, Any], dict, int]:
    """One setting's rows, G and steps share (and its runs' curves and H, for the plot)."""
    repeats = json.loads(repeats_path.read_text())
    scenario, directory = repeats["scenario"], repeats_path.parent
    settings, workers = sim_settings(scenario["args"]), scenario["nodes"]
    h = settings.get("inner_steps") or SimConfig.model_fields["inner_steps"].default
    records = {r["record"]: read_run(find_run(directory, r["record"])) for r in repeats["runs"]}
    tag = repeats_path.name.removesuffix("-repeats.json").removeprefix(scenario["name"])
    floor_name = repeats.get("floor_run") or f"{scenario['floor']}{tag}"
    floor_record = read_run(find_run(directory, floor_name))
    floor, floor_steps = curve(floor_record["final"])
    runs = {name: curve(record["final"]) for name, record in records.items()}
    rounds = max(rounds or 0, max(max(c) for c, _ in runs.values()))
    if run and ceiling_of(settings, workers, rounds) is None:
        key = json.dumps(["ceiling", settings, workers, rounds])
        run_sweep(LOG, [Run(key, ceiling_run, dict(settings=settings, workers=workers, rounds=rounds),
                            workers * rounds * h)], jobs, "worth_testbed")  # fmt: skip
    ceiling = ceiling_of(settings, workers, rounds)
    if ceiling is None:
        raise SystemExit(f"no ceiling of {rounds} rounds in {LOG.name}: run without --report")
    rows = []
    for name, (swarm, steps) in runs.items():
        m = measure(swarm, floor, ceiling)
        rows.append({
            "run": name, "commit": records[name]["commit"][:10], "clean": records[name]["clean"],
            "round": m["round"], "inner_steps": round(steps), "floor_inner_steps": round(floor_steps),
            "steps_share": steps / floor_steps, "swarm": swarm[m["round"]], "floor": floor[m["round"]],
            "ceiling": smoothed(ceiling, m["round"]), "G": m["G"], "G_by_round": m["G_by_round"],
        })  # fmt: skip
    gains, shares = [r["G"] for r in rows], [r["steps_share"] for r in rows]
    result = {
        "what": __doc__.splitlines()[0] + " " + __doc__.splitlines()[1],
        "repeats": str(repeats_path.relative_to(ROOT)),
        "scenario": scenario,
        "ceiling": {"settings": settings, "workers": workers, "rounds": rounds, "seed": 0, "losses": ceiling},
        "floor": {"run": floor_name, "commit": floor_record["commit"][:10], "curve": floor},
        "runs": rows,
        "G": {"mean": statistics.fmean(gains), "range": [min(gains), max(gains)], "runs": len(gains)},
        "steps_share": {"mean": statistics.fmean(shares), "range": [min(shares), max(shares)]},
    }
    return result, runs, h


def write(results: list[tuple[dict[str, Any], dict, int]]) -> None:
    """worth_testbed.json (each setting), the last setting's plot, and docs/WAN.md's table."""
    OUT.write_text(
        json.dumps({"what": __doc__.splitlines()[0], "settings": [r for r, _, _ in results]}, indent=1) + "\n"
    )
    plot(*results[-1], OUT.with_suffix(".png"))
    blocks = "\n\n".join(table(result) for result, _, _ in results)
    write_between(ROOT / "docs" / "WAN.md", "worth-testbed", blocks, by="bench/worth_testbed.py")


def table(result: dict[str, Any]) -> str:
    """The generated block of docs/WAN.md: one row per run, and the means with their ranges."""
    rows = ["| run | commit | round | swarm | floor | ceiling | G | inner steps (swarm / floor) |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["runs"]:
        g = "–" if r["G"] is None else f"{r['G']:.2f}"
        rows.append(
            f"| {r['run']} | {r['commit'][:7]}{'' if r['clean'] else '+changes'} | {r['round']}"
            f" | {r['swarm']:.3f} | {r['floor']:.3f} | {r['ceiling']:.3f} | {g}"
            f" | {r['inner_steps']} / {r['floor_inner_steps']} ({r['steps_share']:.3f}) |"
        )
    g, s = result["G"], result["steps_share"]
    rows.append(
        f"\n{result['scenario']['name']}: G {g['mean']:.2f} [{g['range'][0]:.2f}-{g['range'][1]:.2f}] over"
        f" {g['runs']} runs, against the simulator's ceiling at the same inner steps"
        f" ({result['ceiling']['workers']} members' batches at once, seed 0, the members' inner lr, the"
        f" mean over the rounds within {CEILING_SMOOTHING} of the swarm's last);"
        f" the swarm's nodes completed"
        f" {s['mean']:.3f} [{s['range'][0]:.3f}-{s['range'][1]:.3f}] of their floor's inner steps in the same"
        f" minutes (floor `{result['floor']['run']}`, {result['floor']['commit'][:7]}). From"
        f" `{result['repeats']}`; bench/results/worth_testbed.json."
    )
    return "\n".join(rows)


def plot(result: dict[str, Any], runs: dict[str, tuple[dict[int, float], float]], h: int, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    floor = result["floor"]["curve"]
    ax.plot([r * h for r in floor], list(floor.values()), "k--", label="floor (each node alone)")
    for name, (swarm, _) in runs.items():
        ax.plot([r * h for r in swarm], list(swarm.values()), alpha=0.8, label=name)
    ceiling = result["ceiling"]["losses"]
    ax.plot([(i + 1) * h for i in range(len(ceiling))], ceiling, "g:", label="ceiling (simulator, N x batch)")
    g = result["G"]
    ax.set_title(f"{result['scenario']['name']}: G {g['mean']:.2f} [{g['range'][0]:.2f}-{g['range'][1]:.2f}]")
    ax.set_xlabel("inner steps")
    ax.set_ylabel("held-out loss")
    ax.set_ylim(top=min(6.0, max(floor.values())))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "repeats", type=Path, nargs="+", help="bench/results/wan/<name>-repeats.json, oldest first"
    )
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--report", action="store_true", help="only report from the log (no ceiling run)")
    parser.add_argument("--rounds", type=int, help="run the ceiling for at least this many rounds")
    args = parser.parse_args(argv)
    results = [report(path.resolve(), args.jobs, not args.report, args.rounds) for path in args.repeats]
    write(results)
    for result, _, _ in results:
        g, s = result["G"], result["steps_share"]
        print(
            f"{result['repeats']}: G {g['mean']:.3f} [{g['range'][0]:.3f}-{g['range'][1]:.3f}] over"
            f" {g['runs']} runs; inner steps {s['mean']:.3f} of the floor's"
            f" [{s['range'][0]:.3f}-{s['range'][1]:.3f}]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
