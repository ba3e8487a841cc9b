"""The WAN testbed's short scenario: 3 real daemons in network namespaces on 10 Mbit links, one
SIGKILLed and restarted. Skipped, with the reason, where namespaces cannot be made."""

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench" / "wan"))

from run import load_scenario, run  # noqa: E402
from testbed import available  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.skipif(available() is not None, reason=str(available()))]


@pytest.mark.timeout(600)
def test_three_nodes_on_10_mbit_train_and_a_killed_node_catches_up(tmp_path, monkeypatch):
    monkeypatch.setenv("CGAD_CACHE_DIR", str(tmp_path / "cache"))
    scenario = load_scenario(ROOT / "bench" / "wan" / "scenarios" / "smoke-3.json")
    executable = shutil.which("cgad-node", path=str(Path(sys.executable).parent))
    result = run(scenario, tmp_path, executable)
    final = result["final"]
    assert all(final[i] is not None for i in range(3)), result["log_tails"]
    # judged against the untrained model (node 0's first evaluation): a joiner's own history
    # starts wherever the swarm was when it joined, late on a slow machine
    untrained = final[0]["eval_history"][0][1]
    for index in range(3):
        status = final[index]
        history = status["eval_history"]
        assert history[-1][1] < untrained - 0.3, (index, untrained, history)
        assert status["rejected"].get("non_finite", 0) == 0
        assert status["applied"] > 0, (index, status)
    restarted = final[2]
    assert restarted["resumed"], restarted
    swarm_version = min(final[0]["versions"])
    assert min(restarted["versions"]) >= swarm_version - 4, (restarted["versions"], final[0]["versions"])
    # how far apart the nodes' φ ended, read back from their three final checkpoints
    spread = result["phi_spread"]
    assert spread is not None and spread["nodes"] == 3, spread
    assert all(0 <= d < 1 for d in spread["relative_distance_to_mean"]), spread
