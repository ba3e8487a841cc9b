"""The simulator predicts the daemon (issue 26): a short run of bench/sim_vs_daemon.py's scenario,
the same members, model, data order and settings through the simulator and through real
`cgad-node join` processes on 127.0.0.1, each with its floor (every member training alone).

The bench's own code runs it (one implementation); here it is shortened to 3 members, 8 rounds
and a batch of 4 x 64 tokens (the bench: 4 members, 30 rounds, the daemon's 8 x 128), about two
minutes on two cores.
"""

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BENCH = Path(__file__).resolve().parent.parent / "bench" / "sim_vs_daemon.py"

# Measured on a loaded 2-core machine (7 runs of this scenario, the simulator's side is
# deterministic): the daemons' mean final held-out loss was 0.03 to 0.09 above the simulator's
# (5.604), systematically: a joiner keeps its first block after adopting node 0's state to itself
# and runs on the wall clock, where some peers' deltas come a round late. 0.12 leaves room for a
# busier machine, and still fails when the daemons keep less than about half of the simulator's
# gain over the floor (0.23 here).
LOSS_TOLERANCE = 0.12
GAIN_KEPT = 0.6  # of the simulator's gain, the least the daemons keep in this short run
# The simulator's members are in lock step (every delta arrives at age 0); the daemons' mean age
# was 0.19 to 0.29 with the DHT polled every 0.25 s (0.27 to 0.51 at the default 1 s, where this
# scenario's half-block apply window, 5 steps of about 0.1 s, is shorter than a poll).
AGE_TOLERANCE = 0.5


def _bench():
    spec = importlib.util.spec_from_file_location("bench_sim_vs_daemon", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.system
@pytest.mark.timeout(900)
def test_the_daemons_keep_the_simulators_prediction(tmp_path, monkeypatch):
    monkeypatch.setenv("CGAD_CACHE_DIR", str(tmp_path / "cache"))
    bench = _bench()
    scenario = bench.Scenario(
        members=3,
        rounds=8,
        overrides={"model": "tiny", "inner_steps": 10, "batch_size": 4, "seq_len": 64},
        # steps a quarter of the bench's: the DHT polled 4x as often keeps the poll within the
        # apply window as it is at the bench's size
        daemon_flags=["--poll-interval", "0.25"],
    )
    lines: list[str] = []
    result = bench.compare(scenario, tmp_path / "runs", say=lines.append)
    sim, daemon = result["simulator"], result["daemon"]
    shown = "\n".join(lines)

    # the same model on the same held-out batches at round 0; both floors are the same
    # computation (same init, same batches, nobody to wait for)
    assert abs(result["initial_difference"]) < 1e-4, shown
    assert abs(result["floor_difference"]) < 1e-3, shown
    assert sim["floor"]["applied"] == daemon["floor"]["applied"] == 0, shown
    # both swarms apply their peers' fragments; every joiner took node 0's state
    assert sim["swarm"]["applied"] > 0 and daemon["swarm"]["applied"] > 0, shown
    assert all(s.startswith("peer ") for s in daemon["swarm"]["started_from"][1:]), shown
    # the ages of what they applied are close
    assert abs(daemon["swarm"]["mean_age"] - sim["swarm"]["mean_age"]) < AGE_TOLERANCE, shown
    # the swarm helps on both sides: each ends below its floor (a swarm behind it is a failure)
    sim_gain = sim["floor"]["mean_final_loss"] - sim["swarm"]["mean_final_loss"]
    daemon_gain = daemon["floor"]["mean_final_loss"] - daemon["swarm"]["mean_final_loss"]
    assert sim_gain > 0 and daemon_gain > 0, shown
    # and the daemons end where the simulator said they would: within a tolerance much smaller
    # than the gain, and keeping most of the simulator's gain (the bench's goal, over 30 rounds
    # and 3 runs, is 0.8 of it; 8 rounds of one run are noisier)
    assert abs(result["swarm_difference"]) < LOSS_TOLERANCE, shown
    assert daemon_gain >= GAIN_KEPT * sim_gain, shown


def test_step_seconds_is_the_median_round_over_h_after_the_first_rounds():
    from cgad.bench.sim_vs_daemon_sides import step_seconds

    ends = [(1, 0.0), (2, 50.0), (3, 60.0), (4, 70.0), (5, 95.0), (7, 115.0)]
    # the first two rounds (joining) left out: 10 s, 25 s, then 20 s over two rounds (10 s each)
    assert step_seconds(ends, 10) == pytest.approx(1.0)
    assert step_seconds(ends[:3], 10) is None  # one round after the skipped ones: no gap


def _testbed_why_not():
    from cgad.bench.wan.testbed import available

    return available()


@pytest.mark.skipif(_testbed_why_not() is not None, reason=str(_testbed_why_not()))
@pytest.mark.timeout(180)
def test_the_link_probe_measures_the_shaped_rate():
    """What the simulator is given on the testbed is the link's rate as it is: a 10 Mbit path
    measures a little under 10 Mbit/s of goodput (headers), a 5 Mbit one half of that."""
    bench = _bench()
    from cgad.bench.wan.testbed import Link, Testbed

    with Testbed([Link(10, 10), Link(10, 10)]) as bed:
        # the better of two transfers: the shaper's rate, not a moment when the machine was busy
        # (one transfer at the end of a full test run measured 8.2 Mbit/s)
        fast = max(bench.measure_link(bed, nbytes=2_000_000) for _ in range(2))
        bed.shape(1, Link(5, 10))  # node 1's uplink halved
        slow = max(bench.measure_link(bed, nbytes=1_000_000) for _ in range(2))
    assert 8.5e6 < fast * 8 <= 10.2e6, fast
    assert 4.2e6 < slow * 8 <= 5.1e6, slow
