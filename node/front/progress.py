"""Progress of long work (`simulate`, the benchmarks): a tqdm bar on a terminal; elsewhere (a log
file, CI) a plain line now and then, with what is done, the time so far, the time left and the
latest result, instead of a bar's carriage returns."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["LineProgress", "progress_bar"]


def progress_bar(total: int, desc: str, unit: str = "it", every: float = 30.0) -> Any:
    """A tqdm bar when stderr is a terminal, else a ``LineProgress`` writing a line every
    ``every`` seconds (and at the end)."""
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)
    return LineProgress(total, desc, unit, every)


class LineProgress:
    """The part of tqdm's interface the project uses, as plain lines."""

    def __init__(
        self, total: int, desc: str, unit: str = "it", every: float = 30.0, stream: TextIO | None = None
    ):
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.stream = stream or sys.stderr
        self.n = self._shown_n = 0
        self.postfix = ""
        self.started = self.shown = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.shown >= self.every or self.n >= self.total:
            self._show()

    def set_postfix_str(self, text: str) -> None:
        # a long item (a run of minutes) shows its own progress here: a line at most every `every`
        self.postfix = text
        if time.monotonic() - self.shown >= self.every:
            self._show()

    def write(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.n != self._shown_n:  # the last line, unless it was just written
            self._show()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _show(self) -> None:
        now = time.monotonic()
        self.shown, self._shown_n = now, self.n
        elapsed = now - self.started
        left = elapsed / self.n * (self.total - self.n) if self.n else None
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        eta = "" if left is None or self.n >= self.total else f", about {_clock(left)} left"
        postfix = f"; {self.postfix}" if self.postfix else ""
        self.write(
            f"{self.desc}: {self.n}/{self.total} {self.unit}{share} in {_clock(elapsed)}{eta}{postfix}"
        )


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
