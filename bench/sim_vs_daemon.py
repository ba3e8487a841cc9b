"""Does the simulator predict the daemon? One scenario through both, side by side (issue 26).

The scenario: M members (4), the daemon's defaults (tiny model, its batch, sequence length, inner
lr and warm-up, codec, outer method) but H = 10 inner steps, R rounds (30), every member drawing
from the whole corpus (``data_split="shared"``, what daemons do). It runs

- through the simulator (``simulate``), for the outer method and for ``local`` (every member
  training alone: the floor);
- through M real ``cgad-node join`` processes on 127.0.0.1 (node 0 starts the swarm, the others
  join it through its multiaddr), and the same M nodes with ``--optimizer local`` and no peers.

Both sides get the same model seed and the same data order: the simulator's worker w draws its
batches with seed ``seed * 1_000_003 + w`` (``worker_batches``), and node w is given that value
as ``--data-seed`` (checked before anything runs). The floors of the two sides are then the same
computation, and agree to rounding.

What differs, and is recorded as it is: the simulator's workers all start from the same weights at
round 0 and keep exactly in step; a daemon that joins adopts node 0's snapshot (its outer state in
float16, at whatever round node 0 has reached by then: ``joined_at_round``), keeps the block after
adopting to itself (it warms up its inner optimizer), and then runs on the wall clock, where the
apply delay ends when the peers' fragments are in or half a block later.

The gain of a side is its floor's mean final held-out loss minus its swarm's (positive: the swarm
helps). The issue's goal: the daemons keep at least 80% of the simulator's gain, ``ratio >= 0.8``.

Each daemon's status (admin API) is read at the end of round R: its held-out loss at round R
(``eval_history``), what it applied by age, replays, re-syncs. Every node is then asked to leave.
``--max-rounds R + 1`` only bounds a node the bench fails to stop (a node that stops by itself
exits before its last status can be read).

With ``--testbed MBIT`` the swarm's daemons run on the namespace testbed instead (bench/wan/testbed.py:
a network namespace per node, every link shaped to MBIT megabits per second each way), and the
simulator is given what was measured there: the link's goodput (a TCP transfer between two of the
nodes' namespaces, timed before the daemons start) as its uplink bandwidth, and the daemons'
seconds per inner step (their median round time over H, evaluation included) as its step time.
The floor is then the simulator's alone: nodes training alone never use the network, and on
127.0.0.1 the two floors agree to rounding in every run (``floor_difference``). It writes
bench/results/sim_vs_daemon_<MBIT>mbit.json and .png.

Writes bench/results/sim_vs_daemon.json (the commit and whether the tree was clean, the
settings, both sides per run, and with ``--repeats N`` the mean and range over runs with seeds
seed, seed + 1, ...) and bench/results/sim_vs_daemon.png (held-out loss by round: both swarms,
both floors).

    .venv/bin/python bench/sim_vs_daemon.py [--repeats N] [--members 4] [--rounds 30] [--seed 0]
        [--testbed MBIT]   (as root)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cgad.bench.sim_vs_daemon_sides import (
    _mean,
    check_data_order,
    measure_link,
    run_daemons,
    run_simulator,
)
from cgad.bench.wan.provenance import tree_state
from cgad.node.config import JoinConfig
from cgad.node.sim.config import SimConfig

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "bench" / "results"
GOAL = 0.8  # the share of the simulator's gain the daemons keep (issue 26)
POLL_SECONDS = 0.25
START_TIMEOUT = 240.0  # seconds for a node to print its admin address (imports, p2pd) on a busy machine

Say = Callable[[str], None]


class Scenario:
    """What differs from the daemon's defaults (``overrides``: any ``join`` option that the
    simulator has too), how many members, for how many rounds, which outer method.

    (Plain classes here, not dataclasses: tests/test_bench.py loads this file without
    registering it as a module, which dataclasses need.)"""

    def __init__(
        self,
        members: int = 4,
        rounds: int = 30,
        optimizer: str = "cga",
        seed: int = 0,
        overrides: dict[str, Any] | None = None,
        daemon_flags: list[str] | None = None,
    ) -> None:
        self.members, self.rounds, self.optimizer, self.seed = members, rounds, optimizer, seed
        self.overrides = dict(overrides) if overrides is not None else {"model": "tiny", "inner_steps": 10}
        # flags only the daemons take (the network's: the simulator has no DHT to poll); the
        # comparison reads every round's held-out loss (evaluation does not change training)
        self.daemon_flags = ["--eval-every", "1", *(daemon_flags or [])]

    def join_config(self, optimizer: str | None = None) -> JoinConfig:
        """The daemon's configuration: its defaults, the overrides, the method and the seed."""
        return JoinConfig(**self.overrides, optimizer=optimizer or self.optimizer, seed=self.seed)

    def sim_config(self, optimizer: str | None = None) -> SimConfig:
        """The simulator at the daemon's settings: every option both have, as the daemon has it
        (what follows the method, as ``mixing``, is decided again for ``optimizer``)."""
        join = self.join_config(optimizer)
        shared = {
            k: getattr(join, k)
            for k in SimConfig.model_fields
            if k in JoinConfig.model_fields and k != "mixing"
        }
        return SimConfig(**shared, workers=self.members, rounds=self.rounds, data_split="shared")

    def data_seed(self, member: int) -> int:
        """Member ``member``'s batch order: the simulator's shared-split stream (worker_batches)."""
        return self.seed * 1_000_003 + member

    def join_flags(self, optimizer: str | None = None) -> list[str]:
        """The flags that make a daemon's configuration ``join_config``: the overrides, the
        method and the seed (everything else is the default both sides took)."""
        options = {**self.overrides, "optimizer": optimizer or self.optimizer, "seed": self.seed}
        flags = [arg for key, value in options.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
        return [*flags, *self.daemon_flags]

    def settings(self) -> dict[str, Any]:
        join = self.join_config()
        sim = self.sim_config()
        return {
            "members": self.members,
            "rounds": self.rounds,
            "optimizer": self.optimizer,
            "overrides": self.overrides,
            "simulator": sim.model_dump(),
            "daemon_flags": self.join_flags(),
            "daemon": {
                k: v for k, v in join.model_dump().items() if k in SimConfig.model_fields or k == "fan_in"
            },
            "data_seeds": [self.data_seed(w) for w in range(self.members)],
        }


# ---------------------------------------------------------------------------------- one comparison


def compare(
    scenario: Scenario,
    workdir: Path,
    say: Say = print,
    dataset: Any = None,
    vocab_size: int = 0,
    mbit: float | None = None,
) -> dict[str, Any]:
    """The scenario through the simulator and through real daemons, each with its floor.

    Args:
        mbit: run the daemons' swarm on the namespace testbed with links of this rate each way,
            and give the simulator the goodput and step time measured there (module doc).
    """
    if dataset is None:
        from cgad.node.training.data import load_dataset
        from cgad.node.training.tokenizer import load_tokenizer

        c = scenario.sim_config()
        tokenizer = load_tokenizer(c.tokenizer)
        dataset, vocab_size = load_dataset(tokenizer, c.data), tokenizer.vocab_size
    check_data_order(scenario, dataset)
    opt = scenario.optimizer
    if mbit is None:
        sim = {
            "swarm": run_simulator(scenario, opt, dataset, vocab_size, say),
            "floor": run_simulator(scenario, "local", dataset, vocab_size, say),
        }
        daemon = {
            "swarm": run_daemons(scenario, opt, workdir / f"seed{scenario.seed}-{opt}", say),
            "floor": run_daemons(scenario, "local", workdir / f"seed{scenario.seed}-local", say),
        }
    else:
        from cgad.bench.wan.testbed import Link, Testbed

        with Testbed([Link(mbit, mbit) for _ in range(scenario.members)]) as bed:
            goodput = measure_link(bed)
            say(f"testbed: {mbit} Mbit links, measured goodput {goodput * 8 / 1e6:.2f} Mbit/s")
            swarm = run_daemons(scenario, opt, workdir / f"seed{scenario.seed}-{opt}", say, bed=bed)
        if swarm["step_seconds"] is None:
            raise RuntimeError("the daemons' rounds were not seen often enough to time an inner step")
        wire = {"bandwidth": goodput, "step_time": swarm["step_seconds"]}
        swarm["testbed"] = {"mbit": mbit, "goodput_bytes_per_second": goodput}
        sim = {
            "swarm": run_simulator(scenario, opt, dataset, vocab_size, say, wire=wire),
            "floor": run_simulator(scenario, "local", dataset, vocab_size, say),
        }
        sim["swarm"]["wire"] = wire
        # nodes training alone never touch the network: the floor is one computation (on 127.0.0.1
        # the daemons' and the simulator's agree to rounding), run once, in the simulator
        daemon = {"swarm": swarm, "floor": {**sim["floor"], "note": "the simulator's floor"}}
    for side in (sim, daemon):
        side["gain"] = side["floor"]["mean_final_loss"] - side["swarm"]["mean_final_loss"]
    ratio = daemon["gain"] / sim["gain"] if sim["gain"] > 0 else None
    result = {
        "seed": scenario.seed,
        "simulator": sim,
        "daemon": daemon,
        "ratio": ratio,
        # the floors are the same computation on both sides: how far apart they end is rounding
        # (and, should it be large, a sign that the two sides do not train the same)
        "floor_difference": daemon["floor"]["mean_final_loss"] - sim["floor"]["mean_final_loss"],
        "swarm_difference": daemon["swarm"]["mean_final_loss"] - sim["swarm"]["mean_final_loss"],
        # the same model at round 0 on the same held-out batches: 0 unless init or data differ
        "initial_difference": daemon["swarm"]["initial_loss"] - sim["swarm"]["initial_loss"],
    }
    say(
        f"seed {scenario.seed}: gain simulator {sim['gain']:.4f}, daemons {daemon['gain']:.4f}, "
        f"ratio {'-' if ratio is None else f'{ratio:.2f}'}"
    )
    return result


# ---------------------------------------------------------------------------------- the record


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(values: list[float | None]) -> dict[str, Any]:
        known = [v for v in values if v is not None]
        if not known:
            return {"mean": None, "min": None, "max": None, "n": 0}
        return {"mean": _mean(known), "min": min(known), "max": max(known), "n": len(known)}

    out: dict[str, Any] = {}
    for side in ("simulator", "daemon"):
        out[side] = {
            "swarm_final_loss": stats([r[side]["swarm"]["mean_final_loss"] for r in runs]),
            "floor_final_loss": stats([r[side]["floor"]["mean_final_loss"] for r in runs]),
            "gain": stats([r[side]["gain"] for r in runs]),
            "mean_age": stats([r[side]["swarm"]["mean_age"] for r in runs]),
            "applied": stats([r[side]["swarm"]["applied"] for r in runs]),
        }
    out["ratio"] = stats([r["ratio"] for r in runs])
    # the ratio of the mean gains: the goal's measure when runs are repeated
    sim_gain, daemon_gain = out["simulator"]["gain"]["mean"], out["daemon"]["gain"]["mean"]
    out["ratio_of_mean_gains"] = daemon_gain / sim_gain if sim_gain and sim_gain > 0 else None
    out["goal"] = GOAL
    out["goal_met"] = out["ratio_of_mean_gains"] is not None and out["ratio_of_mean_gains"] >= GOAL
    return out


DIFFERENCES = [
    "joiners adopt node 0's snapshot (phi in float16, outer moments in bfloat16) at the round node 0 has "
    "reached by then (daemon swarm's joined_at_round); the simulator's workers all start from the same "
    "weights at round 0, in step",
    "a joiner keeps the block after adopting to itself (it warms up its inner optimizer: 'discarded'), "
    "and then replays the peers' deltas of the rounds its snapshot lacked ('replayed')",
    "the daemons run on the wall clock of one shared machine: the apply delay ends when every live peer's "
    "fragment is in or half a block later, so ages can exceed the simulator's 0",
    "the outer loop's own random seed differs (simulator: seed * 31 + w, daemon: its --data-seed); it "
    "drives only randomised choices (gossip partners), not training",
    "a member's held-out loss at round r is that of its model right after the round's outer step, "
    "inner steps carried over the step included: in the simulator's lock step there are none, a daemon "
    "carries those it trained while it waited for its peers' fragments (up to half a block)",
    "mean_age here is over peers' deliveries on both sides (from the applied-by-age counts); the "
    "daemon's status mean_age also counts its own delta, at age 0, in every step (status_mean_age)",
]


TESTBED_DIFFERENCES = [
    "the simulator's link is its sender's uplink alone, a queue the sender's bytes for every receiver go "
    "through one after another at the measured goodput; the daemons' links are shaped both ways, and "
    "receivers pull from any holder of a fragment (one that fetched it serves it onward)",
    "the simulator's step time is the daemons' median round time over H, evaluation included, the same "
    "for every member and every round; the daemons' rounds vary with what else the two cores do",
    "the floor is the simulator's alone (members training alone use no link): the daemons' floor on "
    "127.0.0.1 matches it to rounding in every loopback run",
]


def plot(record: dict[str, Any], path: Path) -> Path:
    """Left: held-out loss by round, both swarms and both floors (each daemon's own curve
    faint); right: each side's gain over its floor by round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, settings, summary = record["runs"], record["settings"], record["summary"]
    fig, (ax, gain_ax) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    colors = {"simulator": "tab:blue", "daemon": "tab:red"}
    names = {"simulator": "simulator", "daemon": f"{settings['members']} daemons"}
    for k, run in enumerate(runs):
        alpha = 1.0 if k == 0 else 0.5
        for side, color in colors.items():
            for kind, ls in (("swarm", "-"), ("floor", "--")):
                losses = run[side][kind]["loss_by_round"]
                xs = [r for r, v in enumerate(losses) if v is not None]
                what = settings["optimizer"] if kind == "swarm" else "local (floor)"
                label = f"{names[side]}, {what}" if k == 0 else None
                ax.plot(xs, [losses[r] for r in xs], color=color, ls=ls, lw=1.6, alpha=alpha, label=label)
            swarm, floor = run[side]["swarm"]["loss_by_round"], run[side]["floor"]["loss_by_round"]
            xs = [r for r in range(1, len(swarm)) if swarm[r] is not None and floor[r] is not None]
            label = names[side] if k == 0 else None
            gain_ax.plot(xs, [floor[r] - swarm[r] for r in xs], color=color, lw=1.6, alpha=alpha, label=label)
        for member in run["daemon"]["swarm"]["loss_by_round_per_member"]:
            xs = [r for r, v in enumerate(member) if v is not None]
            ax.plot(xs, [member[r] for r in xs], color="tab:red", lw=0.6, alpha=0.3)
    lowest = min(r["simulator"]["swarm"]["mean_final_loss"] for r in runs)
    ax.set_ylim(lowest - 0.1, lowest + 1.6)  # the rounds where the curves part; round 0 is off the top
    ax.set(xlabel="outer round", ylabel="held-out loss (mean over members)", title="held-out loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if record.get("testbed_mbit") is not None:  # one floor, the simulator's, serves both sides
        ax.text(0.98, 0.6, "floor: the simulator's (nodes alone use no link)", transform=ax.transAxes,
                ha="right", color="0.3")  # fmt: skip
    elif all(abs(run["floor_difference"]) < 1e-3 for run in runs):
        ax.text(0.98, 0.6, "the two floors coincide", transform=ax.transAxes, ha="right", color="0.3")
    gain_ax.axhline(0, color="k", lw=0.8)
    gain_ax.set(xlabel="outer round", ylabel="floor − swarm (held-out loss)", title="gain over the floor")
    gain_ax.grid(alpha=0.3)
    gain_ax.legend()
    ratio = summary["ratio_of_mean_gains"]
    gains = summary["simulator"]["gain"]["mean"], summary["daemon"]["gain"]["mean"]
    joined = sorted({r for run in runs for r in run["daemon"]["swarm"]["joined_at_round"][1:]})
    h = settings["simulator"]["inner_steps"]
    mbit = record.get("testbed_mbit")
    where = "127.0.0.1" if mbit is None else f"{mbit:g} Mbit links (simulator: their goodput, step time)"
    fig.suptitle(
        f"simulator vs {settings['members']} daemons on {where}, H = {h}, {len(runs)} run(s), "
        f"commit {record['commit'][:10]}{'' if record['clean'] else ' + changes'}\n"
        f"final gain over the floor: simulator {gains[0]:.3f}, daemons {gains[1]:.3f}, "
        f"ratio {'-' if ratio is None else f'{ratio:.2f}'} (goal {GOAL}); "
        f"joiners adopted node 0's state at round(s) {joined}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs, with seeds seed, seed + 1, ...")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--optimizer", default="cga")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of the simulator (daemons: 1 each)"
    )
    parser.add_argument(
        "--testbed",
        type=float,
        default=None,
        metavar="MBIT",
        help="run the swarm's daemons on the namespace testbed, links shaped to MBIT each way (root)",
    )
    parser.add_argument("--out", default=None, help="default: bench/results/sim_vs_daemon[_<MBIT>mbit].json")
    parser.add_argument("--keep-logs", default=None, help="keep the daemons' logs in this folder")
    parser.add_argument("--replot", action="store_true", help="only draw the PNG again from --out's JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.out is None:
        mbit = "" if args.testbed is None else f"_{args.testbed:g}mbit"
        args.out = str(RESULTS / f"sim_vs_daemon{mbit}.json")
    if args.testbed is not None:
        from cgad.bench.wan.testbed import available

        why_not = available()
        if why_not:
            parser.error(f"--testbed: {why_not}")
    if args.replot:
        out = Path(args.out)
        print(f"wrote {plot(json.loads(out.read_text()), out.with_suffix('.png'))}")
        return 0

    import torch

    torch.set_num_threads(args.threads)
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    state = tree_state(ROOT)
    t0 = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f} s] {line}", flush=True)

    overrides = {"model": "tiny", "inner_steps": args.inner_steps}
    base = Scenario(args.members, args.rounds, args.optimizer, args.seed, overrides)
    tokenizer = load_tokenizer(base.sim_config().tokenizer)
    dataset = load_dataset(tokenizer, base.sim_config().data)
    workdir = Path(args.keep_logs) if args.keep_logs else Path(tempfile.mkdtemp(prefix="sim-vs-daemon-"))
    runs = []
    try:
        for k in range(args.repeats):
            scenario = Scenario(args.members, args.rounds, args.optimizer, args.seed + k, overrides)
            say(f"run {k + 1} of {args.repeats}, seed {scenario.seed}")
            runs.append(compare(scenario, workdir, say, dataset, tokenizer.vocab_size, mbit=args.testbed))
    finally:
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "what": "the simulator vs real daemons on "
        + ("127.0.0.1" if args.testbed is None else f"the namespace testbed, {args.testbed:g} Mbit links")
        + ", same scenario (issue 26)",
        "testbed_mbit": args.testbed,
        **state,
        "started_at": started_at,
        "wall_seconds": time.monotonic() - t0,
        "cpus": os.cpu_count(),
        "settings": {
            **base.settings(),
            "repeats": args.repeats,
            "seeds": [args.seed + k for k in range(args.repeats)],
        },
        "differences": DIFFERENCES + (TESTBED_DIFFERENCES if args.testbed is not None else []),
        "summary": summarize(runs),
        "runs": runs,
    }
    out.write_text(json.dumps(record, indent=1))
    png = plot(record, out.with_suffix(".png"))
    s = record["summary"]
    say(
        f"simulator gain {s['simulator']['gain']['mean']:.4f}, "
        f"daemons gain {s['daemon']['gain']['mean']:.4f}, "
        f"ratio {s['ratio_of_mean_gains']}, goal (>= {GOAL}) {'met' if s['goal_met'] else 'NOT met'}"
    )
    say(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
