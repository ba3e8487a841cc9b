"""Progress off a terminal: plain lines with what is done, the time so far and left, the latest result."""

import io
import re

from cgad.node.front.progress import LineProgress


def test_lines_say_how_far_how_long_and_the_latest_result() -> None:
    out = io.StringIO()
    with LineProgress(4, "sweep", "run", every=0.0, stream=out) as bar:
        bar.update()
        bar.set_postfix_str("cga: 4.123")
        bar.update(3)
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"sweep: 1/4 run \(25%\) in 0:00, about 0:00 left", lines[0]), lines
    assert re.fullmatch(r"sweep: 1/4 run \(25%\) in 0:00, about 0:00 left; cga: 4\.123", lines[1]), lines
    assert re.fullmatch(r"sweep: 4/4 run \(100%\) in 0:00; cga: 4\.123", lines[2]), lines
    assert len(lines) == 3  # closing adds nothing new


def test_lines_are_rare_and_an_interrupted_run_still_ends_with_one() -> None:
    out = io.StringIO()
    bar = LineProgress(100, "simulate", "step", every=3600.0, stream=out)
    for _ in range(10):
        bar.update()
        bar.set_postfix_str("run 3: 40 of 800 inner steps")
    assert out.getvalue() == ""
    bar.close()
    assert out.getvalue().startswith("simulate: 10/100 step (10%)")
