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
    # the scenario's own expectations (bench/wan/checks.py): losses finite, every node answering
    # and learning, the joiners joined, the restarted node back within 4 versions of the swarm
    failed = [v for v in result["checks"] if not v["ok"]]
    assert not failed, (failed, result["log_tails"])
    final = result["final"]
    for index in range(3):
        assert final[index]["rejected"].get("non_finite", 0) == 0
        assert final[index]["applied"] > 0, (index, final[index])
    assert final[2]["resumed"], final[2]
    # how far apart the nodes' φ ended, read back from their three final checkpoints
    spread = result["phi_spread"]
    assert spread is not None and spread["nodes"] == 3, spread
    assert all(0 <= d < 1 for d in spread["relative_distance_to_mean"]), spread
