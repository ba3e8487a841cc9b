"""The benches' sweep runner: named runs, each a picklable call, run in processes of one torch
thread each and appended to a JSON-lines log as they finish, so a sweep resumes where it stopped.

Each record gets its ``key``, the code it ran at (``commit``, ``+changes`` when the tree held
edits beside it) and its wall seconds. ``node.front.report.load_runs`` reads the log back (a
gzipped copy beside it first).

    from cgad.bench.runner.sweep import Run, run_sweep
    run_sweep(LOG, [Run("floor 8 0", simulate_floor, {"seed": 0}, cost=8)], jobs=2, desc="worth")
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, NamedTuple

from cgad.bench.wan.provenance import describe, tree_state
from cgad.node.front.progress import progress_bar
from cgad.node.front.report import load_runs

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["Run", "run_sweep"]


class Run(NamedTuple):
    """One run of a sweep.

    Args:
        key: its name in the log (a run whose key the log holds is not run again).
        call: a module-level function returning the run's record (a dict).
        kwargs: its arguments.
        cost: its expected cost in any unit (the progress bar's), e.g. inner steps.
    """

    key: str
    call: Callable[..., dict]
    kwargs: dict[str, Any]
    cost: float = 1.0


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # two single-threaded runs beat one two-threaded run on small models


def _timed(call: Callable[..., dict], kwargs: dict[str, Any]) -> dict:
    started = time.monotonic()
    record = call(**kwargs)
    record["wall_seconds"] = time.monotonic() - started
    return record


def run_sweep(log: Path, runs: list[Run], jobs: int, desc: str) -> dict[str, dict]:
    """Run every run the log lacks, ``jobs`` at a time, in the order given; the log's runs after.

    Args:
        log: the JSON-lines log (appended to under a lock: several sweeps may share one).
        runs: what the sweep needs, most wanted first.
        jobs: processes at once.
        desc: the progress bar's name.
    """
    done = load_runs(log)
    todo = [r for r in runs if r.key not in done]
    print(f"{desc}: {len(runs) - len(todo)} of {len(runs)} run(s) in {log.name}, {len(todo)} to go")
    if not todo:
        return done
    commit = describe(tree_state(ROOT), short=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with (
        progress_bar(round(sum(r.cost for r in todo)), desc, "cost") as bar,
        ProcessPoolExecutor(jobs, initializer=_one_thread) as pool,
    ):
        futures = {pool.submit(_timed, r.call, r.kwargs): r for r in todo}
        for future in as_completed(futures):
            run = futures[future]
            record = future.result()
            record.update(key=run.key, commit=commit)
            with log.open("a") as out:
                fcntl.flock(out, fcntl.LOCK_EX)
                out.write(json.dumps(record) + "\n")
            done[run.key] = record
            bar.write(
                f"{run.key}: {record.get('final_loss', float('nan')):.4f} ({record['wall_seconds']:.0f} s)"
            )
            bar.update(round(run.cost))
    return done
