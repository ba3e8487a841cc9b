"""When a round's end evaluates: a fixed period, or the 'auto' share of the run's time."""

import itertools

from cgad.node.training.trainer import EVAL_SHARE, EvalSchedule


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(schedule: EvalSchedule, clock: _Clock, rounds: int, round_s: float, eval_s: float) -> list[int]:
    evaluated = []
    for round_ in range(1, rounds + 1):
        clock.now += round_s
        if schedule.due(round_):
            with schedule.timed():
                clock.now += eval_s
            evaluated.append(round_)
    return evaluated


def test_a_fixed_period_evaluates_every_nth_round_whatever_it_costs():
    clock = _Clock()
    assert _run(EvalSchedule(3, clock), clock, 10, 1.0, 5.0) == [3, 6, 9]


def test_auto_keeps_evaluation_within_its_share_of_the_run():
    clock = _Clock()
    schedule = EvalSchedule("auto", clock)
    # one evaluation costs 13% of a round (26M parameters at H = 10): not every round
    evaluated = _run(schedule, clock, 400, 1.0, 0.13)
    assert evaluated[0] == 1  # the first is due: its cost is not known before
    assert schedule.spent <= EVAL_SHARE * clock.now + 0.13
    assert 0.8 * EVAL_SHARE * clock.now <= schedule.spent  # and it does use its share
    gaps = {b - a for a, b in itertools.pairwise(evaluated[1:])}
    assert gaps <= {12, 13}, gaps  # 0.13 / 0.01 = 13 s of run apart (evaluations included), evenly


def test_auto_evaluates_every_round_when_evaluation_is_cheap():
    clock = _Clock()
    assert _run(EvalSchedule("auto", clock), clock, 50, 1.0, 0.005) == list(range(1, 51))


def test_auto_counts_an_evaluation_made_before_the_first_round():
    clock = _Clock()
    schedule = EvalSchedule("auto", clock)
    with schedule.timed():  # the daemon's evaluation of its starting point
        clock.now += 0.13
    evaluated = _run(schedule, clock, 40, 1.0, 0.13)
    assert evaluated and evaluated[0] >= 24  # (0.13 + 0.13) / 0.01 seconds of run first
