"""Hostile peers among real `cgad-node join` daemons on 127.0.0.1: two honest nodes keep
training while one node publishes pseudo-gradients scaled by 1e6 (and offers snapshots of NaN
parameters) and another claims (in its fragments and in its progress records) to be 1000
versions ahead; a late joiner never adopts the poisoned snapshot. In a second swarm, peers that
reverse their pseudo-gradients, replace them with noise ten times their size, or claim a trillion
tokens for each block while it shifts its pseudo-gradients along one direction (mirror, hidden
inside the clip) are refused, clipped and capped while the honest ones train on. With the data
score on (``--data-score on``), the scaler's clipped deltas are refused as harmful on each honest
node's held-out windows and the honest peer's are taken."""

import math
import subprocess
from collections.abc import Callable

import pytest
from _daemons import CLI, FRESH_LOSS, NodeProcess  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.integration

ROUNDS = 5
UNDER_ATTACK = 6  # rounds each honest node trains on while judged, after the attackers send
# how far below its loss before the attack an honest node must end: two nodes alone fell 0.24 to
# 0.8 over the rounds the attackers take to join and be judged (the first node trains alone while
# the second starts, so "before" may already be round 20), and an attack that gets through lifts
# the loss by tenths
LEARNED = 0.1
# how far the held-out loss may rise over six rounds by chance: at the plateau one evaluation (4
# batches) jumps by up to 0.5 now and then, in swarms with and without attackers. Where it ends is
# the best of its last three evaluations: beside a x1e6 scaler (a third of the deltas, clipped to
# two norms of the own Δ) one round now and then jumps by 0.5-1.6 and is back within two rounds
# (docs/SECURITY.md); ground lost for good lifts all three
SPIKES = 0.25
# half the usual block: five daemons share the machine, and what is tested is per round
SHORT = ["--inner-steps", "8"]
# the attackers send fp32, so that nothing in the encoding stops what they send
FP32 = [*SHORT, "--codec", "fp32"]
# the data score on, at half a block's compute: these blocks (8 steps of 2 × 32 tokens) are too
# small for one test at the default share, which a daemon's default block holds many times over
SCORED = [*SHORT, "--data-score", "on", "--score-share", "0.5"]
# a trillion tokens per block, and each Δ shifted a norm along one direction (node/sim/attacks.py)
INFLATING_MIRROR = "tokens:1000000000000+mirror:1"


def _two_honest(workdir, started: list, flags: list[str] = SHORT) -> tuple[list[str], list[float]]:
    """Start two honest nodes (``flags``), the second joining the first, and let them train ROUNDS
    rounds together; return the first's addresses and each one's held-out loss by then (the mean
    of its last three evaluations), before any attacker exists. Two are enough: a delivery is
    judged against the node's own Δ, not a vote."""
    first = NodeProcess("honest0", workdir, [], flags)
    started.append(first)
    peers = first.maddrs()
    started.append(NodeProcess("honest1", workdir, peers, flags))
    before = []
    for node in started[:2]:
        status = node.wait(
            lambda s: len(s["eval_history"]) >= 3 and s["round"] >= ROUNDS, "training", timeout=300
        )
        before.append(sum(loss for _, loss in status["eval_history"][-3:]) / 3)
    return peers, before


def _rounds_under_attack(
    honest: list, before_attack: list[float], judged: Callable[[dict], bool], what: str
) -> list[dict]:
    """Each honest node's status once it has trained ``UNDER_ATTACK`` more rounds, the attackers
    sending all along, and ``judged`` holds of it. Its held-out losses (each of 4 batches) are all
    finite; the best of its last three at most ``SPIKES`` above the mean of the three before
    those rounds (an attack that gets through lifts all three, at once, by more); and ``LEARNED``
    below what the node had reached before any attacker started (``before_attack``), so that harm
    done while the attackers joined shows too."""
    marks = [node.status()["round"] for node in honest]
    finals = []
    for i, (node, mark) in enumerate(zip(honest, marks, strict=True)):
        goal = mark + UNDER_ATTACK
        status = node.wait(lambda s, goal=goal: s["round"] >= goal and judged(s), what, timeout=600)
        losses = [loss for _, loss in status["eval_history"]]
        assert all(math.isfinite(loss) for loss in losses), f"{node.name}: {losses}"
        before = [loss for round_, loss in status["eval_history"] if round_ <= mark][-3:]
        assert len(before) == 3, f"{node.name}: evaluations by round {mark}: {status['eval_history']}"
        assert losses[-1] < FRESH_LOSS - 0.5, f"{node.name} never learned: {losses}"
        end, start = min(losses[-3:]), sum(before) / 3
        assert end < start + SPIKES, f"{node.name} lost ground under attack: {before} -> {losses[-3:]}"
        assert end < before_attack[i] - LEARNED, f"{node.name}: {before_attack[i]:.3f} before, {losses}"
        finals.append(status)
    return finals


@pytest.mark.timeout(900)
def test_honest_nodes_train_on_beside_a_scaling_and_a_future_claiming_peer(daemons):
    workdir, started = daemons
    peers, before_attack = _two_honest(workdir, started)
    # the scaler also offers snapshots of NaN parameters that claim the newest version
    scaler = NodeProcess("scaler", workdir, peers, FP32, hostile="scale:1e6+poison-state")
    claimer = NodeProcess("claimer", workdir, peers, FP32, hostile="future:1000")
    started += [scaler, claimer]
    scaler_id, claimer_id = scaler.status()["peer_id"], claimer.status()["peer_id"]
    honest = started[:2]

    # both attackers joined (from an honest snapshot) and have sent forged fragments for a while
    claimer.wait(lambda status: status["published"] >= 2, "the claimer publishing", timeout=600)
    scaler.wait(lambda status: status["published"] >= 2, "the scaler publishing", timeout=600)
    finals = _rounds_under_attack(honest, before_attack, lambda s: s["clipped"] >= 2, "six more rounds")
    for node, status in zip(honest, finals, strict=True):
        assert status["applied_by_peer"].get(scaler_id, 0) >= 2, f"{node.name}: {status['applied_by_peer']}"
        assert status["rejected"].get("future", 0) >= 1, f"{node.name}: {status['rejected']}"
        assert claimer_id not in status["applied_by_peer"], "a far-future delta was applied"
        assert status["rejected_by_peer"].get(claimer_id, 0) >= 1, status["rejected_by_peer"]
        assert claimer_id not in status["started_from"]  # never adopted the claimer's state
        assert node.proc.poll() is None
    # a joiner never adopts the poisoned snapshot, which claims the newest version. Whether it is
    # tried at all here is timing (with one-second rounds its record may name a blob already
    # replaced, or honest ones may have caught up with its claim); the refusal itself, counted
    # bad_state, is tested deterministically in test_joining.py.
    joiner = NodeProcess("joiner", workdir, peers, SHORT)
    started.append(joiner)
    joined = joiner.wait(lambda s: s["round"] >= 1, "the joiner training", timeout=300)
    # a sound snapshot: an honest node's, or the claimer's (it forges fragments and progress
    # records, not its state), never the poisoner's
    assert joined["started_from"].startswith("peer ") and scaler_id not in joined["started_from"], joined
    assert all(math.isfinite(loss) for _, loss in joined["eval_history"]), joined["eval_history"]

    # what a volunteer reads: the refusals and where the applied fragments came from, and their ages
    summary = subprocess.run(
        [CLI, "status", "--admin", honest[0].admin], capture_output=True, text=True, timeout=120
    )
    assert summary.returncode == 0, summary.stderr
    assert "future" in summary.stdout and scaler_id in summary.stdout, summary.stdout
    assert "ages of applied fragments" in summary.stdout, summary.stdout


@pytest.mark.timeout(900)
def test_the_data_score_refuses_a_scalers_deltas_and_takes_the_honest_ones(daemons):
    """The ×1e6 scaler of the test above, clipped to two norms of the own Δ, is a step the shape
    screens take and that now and then lifts a round's loss by 0.5-1.6 (docs/SECURITY.md). With
    ``--data-score on`` each delivery is also judged on held-out windows: the scaler's record of
    scores weighs it at less than half (some of its deltas refused as harmful outright), no round
    loses ground, and the honest peer's deltas are taken, at half their weight or more (at most
    one in three refused, for any reason)."""
    workdir, started = daemons
    peers, before_attack = _two_honest(workdir, started, SCORED)
    honest = started[:2]
    honest_ids = [node.status()["peer_id"] for node in honest]
    scaler = NodeProcess("scaler", workdir, peers, FP32, hostile="scale:1e6")
    started.append(scaler)
    scaler_id = scaler.status()["peer_id"]
    scaler.wait(lambda status: status["published"] >= 2, "the scaler publishing", timeout=600)
    judged = lambda s: (s["distrusted"] or {}).get(scaler_id, 1.0) < 0.5  # noqa: E731
    finals = _rounds_under_attack(honest, before_attack, judged, "six more rounds, the scaler distrusted")
    for node, other, status in zip(honest, reversed(honest_ids), finals, strict=True):
        refused = status["rejected_by_peer"].get(scaler_id, 0)
        taken = status["applied_by_peer"].get(scaler_id, 0)
        # refused beyond chance now and then, and weighed at less than half by its record
        weight, honest_weight = status["distrusted"].get(scaler_id, 1.0), status["distrusted"].get(other, 1.0)
        assert weight < 0.5, f"{node.name}: {refused} refused, {taken} taken at {weight}"
        assert honest_weight >= 0.5 and honest_weight > weight, (node.name, status["distrusted"])
        honest_taken = status["applied_by_peer"].get(other, 0)
        honest_refused = status["rejected_by_peer"].get(other, 0)
        assert honest_taken >= 5, (node.name, status["applied_by_peer"])
        # for any reason: the direction screen refuses honest deltas at the plateau now and then too
        assert honest_refused <= max(2, honest_taken // 3), (node.name, honest_refused, status["rejected"])
        assert status["probed"] > 0 and status["probe_tokens"] > 0


@pytest.mark.timeout(900)
def test_honest_nodes_train_on_beside_a_reversing_a_noisy_and_a_token_inflating_peer(daemons):
    workdir, started = daemons
    peers, before_attack = _two_honest(workdir, started)
    attackers = {
        kind: NodeProcess(kind.split(":")[0], workdir, peers, FP32, hostile=kind)
        for kind in ("signflip", "noise:10", INFLATING_MIRROR)
    }
    started += attackers.values()
    ids = {kind: node.status()["peer_id"] for kind, node in attackers.items()}
    honest = started[:2]
    for node in attackers.values():
        node.wait(lambda status: status["published"] >= 2, f"{node.name} publishing", timeout=600)

    def judged(status: dict) -> bool:
        flipped = status["rejected_by_peer"].get(ids["signflip"], 0)
        return flipped >= 2 and status["applied_by_peer"].get(ids[INFLATING_MIRROR], 0) >= 2

    finals = _rounds_under_attack(honest, before_attack, judged, "six more rounds of judged deliveries")
    for node, status in zip(honest, finals, strict=True):
        # a reversed Δ points against the node's own: refused, counted 'opposed'
        assert status["rejected"].get("opposed", 0) >= 2, f"{node.name}: {status['rejected']}"
        # noise ten times a Δ's norm: what of it passes the cosine test is clipped to the radius
        noisy = ids["noise:10"]
        judged_noise = status["applied_by_peer"].get(noisy, 0) + status["rejected_by_peer"].get(noisy, 0)
        assert judged_noise >= 1 and status["clipped"] >= status["applied_by_peer"].get(noisy, 0), status
        # a mirrored Δ (shifted a norm along the attacker's fixed direction) hides inside the clip
        # and the screen: it is taken (two of them at least, above), and its trillion-token claim
        # weighs twice the node's own block at most
        assert status["tokens_capped"] >= 2, f"{node.name}: {status['tokens_capped']}"
        assert status["started_from"] == "scratch" or status["started_from"].startswith("peer ")
        assert not any(peer in status["started_from"] for peer in ids.values()), status["started_from"]
        assert node.proc.poll() is None
