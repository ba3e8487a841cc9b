"""How long the training thread stops training for the exchange: the trainer's stall.

Between two inner steps the training thread runs the member engine: publishing a fragment
(its encoding included), the outer step, the progress record, the status line. All of it is time
the model does not train. ``StallMeter`` adds it up per block (one outer step each) and reports
the median per outer step and the share of the block's wall time it took. Evaluation and
checkpoints stop training too, every few rounds, for reasons of their own: they are timed apart
(``apart``) and left out of the stall.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["StallMeter"]


class StallMeter:
    """The training thread's stall per outer step, over the latest ``window`` blocks.

    Args:
        window: blocks the figures are taken over.
    """

    def __init__(self, window: int = 20) -> None:
        self._block_start = time.monotonic()
        self._stalled = 0.0  # this block's time outside inner steps, so far
        self._apart = 0.0  # of it, evaluation and checkpoints
        self._blocks: deque[tuple[float, float]] = deque(maxlen=window)  # (stall, block) seconds

    @contextmanager
    def stalled(self) -> Iterator[None]:
        """Time spent not training (the engine's work between two inner steps)."""
        started = time.monotonic()
        try:
            yield
        finally:
            self._stalled += time.monotonic() - started

    @contextmanager
    def apart(self) -> Iterator[None]:
        """Time inside ``stalled`` that is not the exchange's (evaluation, checkpoints)."""
        started = time.monotonic()
        try:
            yield
        finally:
            self._apart += time.monotonic() - started

    def block_ended(self) -> None:
        """A block (and with it one outer step) is over: its figures are final."""
        now = time.monotonic()
        self._blocks.append((max(0.0, self._stalled - self._apart), now - self._block_start))
        self._block_start, self._stalled, self._apart = now, 0.0, 0.0

    def summary(self) -> dict[str, Any] | None:
        """``per_outer_step_s``: the median stall per outer step; ``fraction``: the stall's share
        of the blocks' wall time; ``max_s``: the longest. None before the first block ends."""
        if not self._blocks:
            return None
        stalls = [stall for stall, _ in self._blocks]
        wall = sum(block for _, block in self._blocks)
        return {
            "per_outer_step_s": statistics.median(stalls),
            "fraction": sum(stalls) / wall if wall > 0 else 0.0,
            "max_s": max(stalls),
            "blocks": len(stalls),
        }
