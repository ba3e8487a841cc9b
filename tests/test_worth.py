"""bench/worth.py's measures: G against the ceiling, W against one member alone, and the table."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "worth.py"


@pytest.fixture(scope="module")
def worth():
    spec = importlib.util.spec_from_file_location("bench_worth", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_g_is_the_share_of_the_ceilings_gain_the_swarm_captures(worth):
    floor, ceiling = [5.0, 4.0, 3.5], [4.0, 3.0, 3.5]
    g = worth.gain_captured(floor, [4.5, 3.0, 3.4], ceiling)
    assert g[:2] == [0.5, 1.0]
    assert g[2] is None  # a ceiling no better than the floor has no gain to share


def test_w_reads_the_lone_curve_and_says_where_it_is_only_a_bound(worth):
    alone = [5.0, 4.0, 3.6, 3.0]  # rounds 1-4, from 6.0
    w = worth.worth([4.5, 3.0, 2.0], alone, initial=6.0)
    assert w[0] == (1.5, True)  # halfway from round 1 to round 2, in the swarm's first round
    assert w[1] == (2.0, True)  # round 4, in the swarm's second
    assert w[2] == (4 / 3, False)  # never reached: at least its 4 rounds over the swarm's 3


def test_the_table_and_the_headline_come_from_the_result(worth):
    point = {"mean": 0.6, "min": 0.5, "max": 0.7}
    w = {"mean": 2.0, "min": 1.8, "max": 2.2}
    row = {"kind": "swarm", "G": [point] * 60, "G_best": [point] * 60, "W": [w] * 60}
    row["w_at_least"] = [False] * 60
    result = {"rounds": 60, "seeds": [0, 1, 2], "commits": ["abc"], "settings": {},
              "sizes": {"8": {"conditions": {"τ=0": row}, "ceiling_best_lr_factor": 2.0}}}  # fmt: skip
    table = worth.table(result)
    assert "| 8 | τ=0 | 0.60 [0.50-0.70]" in table and "2.00 [1.80-2.20] |" in table
    assert "8 volunteers are worth 2.0 of them training alone" in worth.headline(result)
    assert "captures 0.60 of a datacenter's gain" in worth.headline(result)
