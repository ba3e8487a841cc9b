"""How many of its own published φ a member keeps for late mixing: the two newest (the default,
``mixing.PHI_KEPT``) against every version up to the cutoff (what members kept before), in the
simulator at 8 workers x 150 rounds under random delays of up to 8 rounds, where late mixing
sends φ most. Each kept version is 4 bytes a parameter (docs/SCALE.md).

Settings are bench/defence_tax.py's (the long sweep's 8 x 150 base, every outer flag at its
default). Writes bench/results/phi_kept.json: per variant and seed the final loss of the
members, the loss of their mean φ, mixes taken, and the ages of the mixes (rounds between the
member's version and the newest peer φ it could mix with).

    .venv/bin/python bench/phi_kept.py [--seeds 0 1] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from cgad.bench import long_sweep

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "phi_kept.json"
VARIANTS = {"2 newest (default)": 2, "up to the cutoff (before)": 1_000}
CONDITION = "random:8"


def run(variant: str, seed: int) -> dict[str, Any]:
    """One simulator run with ``VARIANTS[variant]`` versions kept; the mixes' ages recorded."""
    import cgad.node.member.mixing as mixing
    import cgad.node.member.outer as outer
    from cgad.node.sim.config import SimConfig

    kept, ages = VARIANTS[variant], Counter()
    pull = mixing.gossip_pull

    def recording_pull(params, published, peers, *, version, **kw):
        numel = sum(p.numel() for p in params)
        usable = [
            p.key.base_version for p in peers if p.key.base_version in published and p.tensor.numel() == numel
        ]
        mixed = pull(params, published, peers, version=version, **kw)
        if mixed and usable:
            ages[version - max(usable)] += 1
        return mixed

    outer.gossip_pull = recording_pull
    outer.remember_phi = lambda published, version, phi: mixing.remember_phi(published, version, phi, kept)
    long_sweep._init_worker()
    config = SimConfig(**{**long_sweep.BASE, "workers": 8, "rounds": 150}, delay=CONDITION, seed=seed,
                       model=str(long_sweep.MODEL))  # fmt: skip
    record = long_sweep._run(config)
    return {
        "variant": variant, "seed": seed, "final_loss": record["final_loss"],
        "final_mean_phi_loss": record.get("final_mean_phi_loss"), "mixes_by_age": dict(sorted(ages.items())),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    jobs = [(v, s) for v in VARIANTS for s in args.seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(run, *zip(*jobs, strict=True)))
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    summary = {
        v: {
            "final_loss_mean": statistics.mean(r["final_loss"] for r in runs if r["variant"] == v),
            "final_loss_by_seed": [r["final_loss"] for r in runs if r["variant"] == v],
        }
        for v in VARIANTS
    }
    record = {
        "benchmark": "phi_kept", "commit": git("rev-parse", "HEAD"),
        "clean": not git("status", "--porcelain", "--untracked-files=no"),
        "settings": {**long_sweep.BASE, "workers": 8, "rounds": 150, "delay": CONDITION},
        "summary": summary, "runs": runs,
    }  # fmt: skip
    RESULT.write_text(json.dumps(record, indent=1) + "\n")
    for v, s in summary.items():
        print(f"{v:>28}: {s['final_loss_mean']:.4f}  {[round(x, 4) for x in s['final_loss_by_seed']]}")


if __name__ == "__main__":
    main()
