"""`cgad-node demo`'s comparison of the swarm with a node training alone: by round, by
wall-clock, in words, and in a PNG."""

from __future__ import annotations

import pytest

from cgad.node.front.report import by_round, by_time, gain_in_words, plot_demo, rounds_to_reach, thin


def test_by_round_means_the_swarm_where_the_lone_node_evaluated_too() -> None:
    swarm = [{0: 8.0, 1: 6.0, 2: 5.0}, {1: 6.5, 2: 5.5, 3: 5.0}]  # the second joined at round 1
    alone = {0: 8.0, 1: 7.0, 2: 6.0}
    assert by_round(swarm, alone) == [(0, 8.0, 8.0), (1, 6.25, 7.0), (2, 5.25, 6.0)]
    assert by_round(swarm, {}) == [] and by_round([], alone) == []
    # the words take only rounds the whole swarm evaluated: never one node standing for the mean
    assert by_round(swarm, {**alone, 3: 5.5}, every=True) == [(1, 6.25, 7.0), (2, 5.25, 6.0)]


def test_by_time_takes_each_nodes_latest_loss_at_evenly_spaced_moments() -> None:
    swarm = [[(0.0, 8.0), (60.0, 6.0)], [(30.0, 7.0), (90.0, 5.0)]]
    alone = [(0.0, 8.0), (50.0, 7.5), (120.0, 7.0)]
    rows = by_time(swarm, alone, instants=4)
    assert [r[0] for r in rows] == [30.0, 60.0, 90.0, 120.0]  # from when both have a loss to the end
    assert rows[0] == (30.0, pytest.approx(7.5), 8.0)  # 8.0 and 7.0 against 8.0
    assert rows[-1] == (120.0, pytest.approx(5.5), 7.0)  # 6.0 and 5.0 against 7.0
    assert by_time([[]], alone) == [] and by_time(swarm, []) == []


def test_thin_keeps_the_last_row_and_at_most_so_many() -> None:
    rows = list(range(23))
    kept = thin(rows, 8)
    assert len(kept) == 8 and kept[-1] == 22 and kept == sorted(set(kept))
    assert thin(rows[:5], 8) == rows[:5]


def test_the_gain_in_words_says_ahead_behind_or_level() -> None:
    ahead = gain_in_words([(0, 8.0, 8.0), (12, 4.5, 5.0)], [(300.0, 4.5, 5.2)], nodes=3)
    assert "after 12 rounds" in ahead and "the mean of 3 nodes" in ahead
    assert "the swarm is ahead by 0.500 (10.0% lower)" in ahead and "after 5.0 minutes" in ahead
    assert "behind by 0.200" in gain_in_words([(4, 5.2, 5.0)], [], nodes=2)
    assert "level" in gain_in_words([(4, 5.0, 5.0)], [], nodes=2)
    assert "nothing to compare" in gain_in_words([], [], nodes=2)


def test_the_worth_is_the_rounds_one_node_alone_took_to_get_there() -> None:
    alone = {0: 8.0, 1: 6.0, 2: 5.5, 3: 5.0, 4: 5.2, 5: 4.6}
    assert rounds_to_reach(alone, 5.75) == pytest.approx(1.5)
    assert rounds_to_reach(alone, 5.0) == 3.0
    # its running best: a worse evaluation after a better one is not where it first got there
    assert rounds_to_reach(alone, 4.8) == pytest.approx(4.5)
    assert rounds_to_reach(alone, 4.0) is None
    words = gain_in_words([(2, 5.0, 5.5)], [], nodes=3, alone=alone)
    assert "one node alone got there after 3.0 rounds: the 3 nodes were worth 1.5 nodes alone" in words
    more = gain_in_words([(2, 4.0, 5.5)], [], nodes=3, alone=alone)
    assert "has not reached 4.000 in its 5 rounds: the 3 nodes were worth more than 2.5 nodes alone" in more


def test_the_picture_shows_both_by_round_and_by_wall_clock(tmp_path) -> None:
    swarm = [{0: 8.0, 1: 6.0, 2: 5.0}, {1: 6.5, 2: 5.5}]
    timed = [[(0.0, 8.0), (60.0, 6.0), (120.0, 5.0)], [(70.0, 6.5), (130.0, 5.5)]]
    png = plot_demo(
        swarm, timed, {0: 8.0, 1: 7.0, 2: 6.0}, [(0.0, 8.0), (65.0, 7.0), (125.0, 6.0)], tmp_path / "d.png"
    )
    assert png.stat().st_size > 20_000
    # a demo stopped before anything was evaluated still draws its (empty) picture
    assert plot_demo([{}], [[]], {}, [], tmp_path / "empty.png").exists()


def test_a_sweeps_runs_come_from_its_gzipped_archive_and_then_its_log(tmp_path) -> None:
    import gzip
    import json

    from cgad.node.front.report import load_runs

    log = tmp_path / "sweep.runs.jsonl"
    assert load_runs(log) == {}
    archived = [{"key": "a", "loss": 1.0}, {"key": "b", "loss": 2.0}]
    (tmp_path / "sweep.runs.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps(r) + "\n" for r in archived).encode())
    )
    appended = [{"key": "b", "loss": 3.0}, {"key": "c", "loss": 4.0}]
    log.write_text("\n\n".join(json.dumps(r) for r in appended) + "\n")
    runs = load_runs(log)
    assert {k: r["loss"] for k, r in runs.items()} == {"a": 1.0, "b": 3.0, "c": 4.0}  # the log's later b
