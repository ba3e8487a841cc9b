"""What a WAN run ran: the code (the commit, and whether the tree held changes beside it) and each
node's data order (its ``--data-seed``).

The daemons import the code in the tree when they start, so a run records ``git rev-parse HEAD``
and ``git status --porcelain``; the runner refuses a tree with changes (anything but what sits under
bench/results/, where runs write) unless it is told the run is an experiment, and says so in the
run's record.

Each node's training batches are drawn in an order seeded by its ``--data-seed``; the runner gives
node i of every scenario run with the same run seed the same value, so that runs compared with each
other, and a swarm with its floor (the same nodes, each training alone), see the same batches in
the same order, and differ by what the scenario changes alone.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["IGNORED", "data_seed", "describe", "refusal", "tree_state", "what_ran"]

# where runs write their records: a change there is not a change to the code that ran
IGNORED = "bench/results/"


def tree_state(root: str | Path) -> dict[str, Any]:
    """``{"commit": HEAD's full hash, "clean": bool, "changes": [porcelain lines]}``: the
    changes are tracked files changed, staged or not, and untracked files, all but those under
    bench/results/ (``clean`` when there are none)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode:
        raise RuntimeError(f"git rev-parse HEAD in {root}: {head.stderr.strip()}")
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=root, capture_output=True, text=True
    )
    if status.returncode:
        raise RuntimeError(f"git status in {root}: {status.stderr.strip()}")
    changes = [line for line in status.stdout.splitlines() if line and not _under_results(line)]
    return {"commit": head.stdout.strip(), "clean": not changes, "changes": changes}


def _under_results(line: str) -> bool:
    """A porcelain line ("XY path", or "XY old -> new" for a rename) whose paths are all under
    bench/results/."""
    paths = [p.strip('"') for p in line[3:].split(" -> ")]
    return all(p.startswith(IGNORED) for p in paths)


def refusal(state: dict[str, Any], experiment: str | None) -> str | None:
    """Why a run must not start on this tree (None: it may)."""
    if state["clean"] or experiment:
        return None
    shown = "\n  ".join(state["changes"][:20])
    more = f"\n  ... and {len(state['changes']) - 20} more" if len(state["changes"]) > 20 else ""
    return (
        f"the tree has changes beside commit {state['commit'][:12]}, so a run would not say what ran:\n"
        f"  {shown}{more}\ncommit them, or run with --experiment NOTE (recorded in each run's record)"
    )


def data_seed(index: int, run_seed: int) -> int:
    """Node ``index``'s ``--data-seed`` in runs with run seed ``run_seed``: the same in every
    scenario (a swarm's node i and its floor's node i alike), a different stream for each node and
    each run seed (the first 4 bytes of a SHA-256, as the daemon draws its own from its peer id)."""
    digest = hashlib.sha256(f"cgad-wan data order: run seed {run_seed}, node {index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def what_ran(result: dict[str, Any]) -> dict[str, Any]:
    """What a run's record says of the code and data order it ran (None where a record made
    before the runner recorded it says nothing: ``commit`` was then ``git describe --dirty``); the
    list of changed paths stays in the record."""
    keys = ("commit", "clean", "experiment", "started_at", "run_seed", "data_seeds")
    return {key: result.get(key) for key in keys}


def describe(result: dict[str, Any], short: bool = False) -> str:
    """One line for a figure: the commit, whether the tree had changes, the experiment's note,
    the run seed (``short``: the commit and two marks only, for a legend)."""
    ran = what_ran(result)
    commit = ran["commit"] or "commit unknown"
    commit = commit[:10] if len(commit) == 40 else commit  # a full hash, or what git describe said
    if short:
        return (
            commit
            + ("+changes" if ran["clean"] is False else "")
            + (" experiment" if ran["experiment"] else "")
        )
    parts = [commit + (" with uncommitted changes" if ran["clean"] is False else "")]
    if ran["experiment"]:
        parts.append(f"experiment: {ran['experiment']}")
    if ran["run_seed"] is not None:
        parts.append(f"run seed {ran['run_seed']}" + ("" if ran["data_seeds"] else ", nodes' own data order"))
    return "; ".join(parts)
