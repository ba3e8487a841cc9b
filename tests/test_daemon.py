"""Real `cgad-node join` processes on 127.0.0.1: a swarm trains, survives SIGKILL, takes a late
joiner from its own state, and lets a node leave cleanly."""

import json
import os
import subprocess

import pytest
from _daemons import CLI, FRESH_LOSS, SETTINGS, NodeProcess  # tests/ is on sys.path under pytest

from cgad.node.daemon.admin import call_admin, check_health
from cgad.node.front.export import export_checkpoint
from cgad.node.member.ledger import COUNTED
from cgad.optim.defaults import DEFAULT_CUTOFF

pytestmark = pytest.mark.integration

HOSTILE = {
    "bad_shape", "bad_dtype", "bad_length", "bad_header", "bad_chunk", "non_finite", "norm_too_large",
    "bad_checksum", "bad_hash", "forged", "garbage", "oversized", "replay", "truncated",
}  # fmt: skip
STATUS_KEYS = {
    "peer_id", "run_id", "versions", "inner_step", "loss", "eval_loss", "tokens_per_second", "peers",
    "fan_in", "published", "applied", "rejected", "dropped_stale", "mean_age", "clipped", "skipped",
    "cpu_seconds_by_thread", "outer_momentum", "tokens_capped", "inner_lr", *COUNTED,
}  # fmt: skip


def first_and_last_eval(status: dict) -> tuple[float, float]:
    history = status["eval_history"]
    return history[0][1], history[-1][1]


@pytest.mark.timeout(900)
def test_swarm_trains_survives_sigkill_takes_a_late_joiner_and_lets_a_node_leave(daemons):
    workdir, nodes = daemons
    # b and c start with a and join it once it is up, side by side (neither needs the other)
    a = NodeProcess("a", workdir, [], wait=False)
    nodes.append(a)
    b, c = (NodeProcess(name, workdir, [], after=[a], wait=False) for name in "bc")
    nodes += [b, c]
    assert check_health(a.admin)
    status_json = subprocess.run(
        [CLI, "status", "--admin", a.admin, "--json"], capture_output=True, text=True, timeout=120
    )
    assert status_json.returncode == 0, status_json.stderr
    assert STATUS_KEYS <= set(json.loads(status_json.stdout))
    assert json.loads(status_json.stdout)["fan_in"] == 16  # --fan-in auto, cut to the tiny model

    # 1. three nodes train: held-out loss falls, and each applies both others' fragments
    ids = {n.name: n.status()["peer_id"] for n in nodes}
    for node in (a, b, c):
        others = {ids[o.name] for o in (a, b, c) if o is not node}
        status = node.wait(
            lambda s, others=others: (
                len(s["eval_history"]) >= 8 and others <= set(s["applied_by_peer"]) and s["peers"] == 2
            ),
            "eight evaluations, two live peers, fragments from both",
        )
        start, end = first_and_last_eval(status)
        if node is a:  # from scratch: the swarm learns
            assert end < start - 1.0, status["eval_history"]
        else:  # b and c start from the state a had when they joined (late on a loaded machine)
            # and keep up with it: near a's loss, far below an untrained model's
            a_loss = a.status()["eval_loss"]
            assert end < FRESH_LOSS - 1.0 and end < a_loss + 0.3, (node.name, a_loss, status["eval_history"])
        # its outer steps average its peers' deltas: it trains above the given lr (2e-3), at most √3 ×
        assert 2.2e-3 < status["inner_lr"] <= 2e-3 * 3**0.5 + 1e-9, status["inner_lr"]
        # its peers' inner first moments came beside their deltas and were averaged into its own
        assert status["moments_mixed"] >= 1, status
        # peers run at about the same cadence: fragments arrive well inside the cutoff (4 rounds)
        assert 0 <= status["mean_age"] < 4, status
        # honest peers: fetches may time out ("unavailable"), but nothing is malformed or forged
        assert not set(status["rejected"]) & HOSTILE, status["rejected"]

    # 2. SIGKILL mid-round, restart from the same checkpoint dir and identity: it catches up
    killed_round = c.status()["round"]
    c.kill()
    c = NodeProcess("c", workdir, a.maddrs())
    nodes.append(c)
    status = c.wait(lambda s: s["round"] >= killed_round + 2, "the restarted node to train on")
    assert status["peer_id"] == ids["c"]
    assert status["resumed"]  # from its own checkpoint, then caught up with the swarm
    # the re-sync rule: a member more than the cutoff behind adopts a peer's state; within it, it
    # trains on from its checkpoint (a round may pass between the two reads)
    swarm_round = a.status()["round"]
    lag = swarm_round - status["round"]
    assert lag <= DEFAULT_CUTOFF + 1, (status["round"], swarm_round, status["resyncs"])

    # 3. a late joiner starts from the swarm's model, not from scratch
    swarm_loss = a.status()["eval_loss"]
    d = NodeProcess("d", workdir, a.maddrs())
    nodes.append(d)
    status = d.wait(lambda s: len(s["eval_history"]) >= 1, "the late joiner's first evaluation")
    assert status["started_from"].startswith("peer ")
    # the swarm's fragments it saw while catching up were ahead of it, not its peers' faults
    assert "future" not in status["rejected"], status["rejected"]
    first = status["eval_history"][0][1]
    # near the swarm's loss over the while it joined (it adopts the state the swarm has then: the
    # swarm's loss read before it started can be a round or two old, falling fast this early)
    since = a.status()["eval_loss"]
    low, high = min(swarm_loss, since), max(swarm_loss, since)
    assert first < FRESH_LOSS - 1.0 and low - 0.5 < first < high + 0.5, (first, swarm_loss, since)

    # 4. leave: exit 0 after a final checkpoint; the others keep training
    b_round = b.status()["round"]
    call_admin(b.admin, "Leave")
    assert b.proc.wait(timeout=120) == 0
    assert (b.dir / "ckpt" / "node.safetensors").exists()
    a_round = a.status()["round"]
    a.wait(lambda s: s["round"] >= a_round + 2, "training to go on after a leave")
    assert b_round >= 6

    # 5. the checkpoint exports to a Hugging Face directory that loads and generates
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_checkpoint(b.dir / "ckpt", workdir / "export")
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids_in = tokenizer("ROMEO:", return_tensors="pt").input_ids
    generated = model.generate(ids_in, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > ids_in.shape[1]


def test_a_node_of_another_run_is_refused(daemons):
    workdir, nodes = daemons
    a = NodeProcess("a", workdir, [])
    nodes.append(a)
    a.wait(lambda s: s["round"] >= 1, "the first round")
    other = subprocess.run(
        [CLI, "join", *SETTINGS[2:], "--run-id", "other-run", "--peers", *a.maddrs(), "--max-rounds", "1"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert other.returncode == 2
    assert "different run id" in other.stderr
