"""The virtual swarm: determinism, DiLoCo equivalence, ages, at-most-once delivery, and errors."""

import copy
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cgad.node.config import JoinConfig, OuterOptions
from cgad.node.member.moments import CODEC as MOMENTS_CODEC
from cgad.node.member.outer import OuterLoop
from cgad.node.member.sender import Sender
from cgad.node.sim.config import SimConfig, parse_stragglers
from cgad.node.sim.memory import Delay, VirtualNetwork
from cgad.node.sim.simulate import simulate, worker_batches
from cgad.node.training.data import load_dataset
from cgad.node.training.model import build_model
from cgad.node.training.tokenizer import load_tokenizer
from cgad.node.training.trainer import InnerTrainer, evaluate
from cgad.optim import CGAD
from cgad.protocol.codec import encoded_size
from cgad.protocol.scheduling import AUTO_LINK_SHARE
from cgad.protocol.transport import Fragment, FragmentKey, Kind

CLI = str(Path(sys.executable).with_name("cgad-node"))
SMALL = dict(batch_size=2, seq_len=32, eval_batches=2, inner_lr=1e-3)


@pytest.fixture(scope="module")
def corpus():
    tokenizer = load_tokenizer(None)
    return tokenizer, load_dataset(tokenizer)


def run(corpus, **overrides):
    tokenizer, dataset = corpus
    config = SimConfig(**{**dict(workers=3, inner_steps=4, rounds=4, **SMALL), **overrides})
    return simulate(config, dataset, tokenizer.vocab_size)


@pytest.mark.slow
def test_same_seed_same_numbers(corpus):
    a = run(corpus, optimizer="cgad", delay="random:2", drop=0.2, seed=3)
    b = run(corpus, optimizer="cgad", delay="random:2", drop=0.2, seed=3)
    assert a["losses"] == b["losses"]
    assert a["age_counts"] == b["age_counts"]
    c = run(corpus, optimizer="cgad", delay="random:2", drop=0.2, seed=4)
    assert c["losses"] != a["losses"]


@pytest.mark.slow
def test_one_worker_at_age_zero_is_diloco_with_adam_outer_step(corpus):
    tokenizer, dataset = corpus
    h, rounds = 4, 3
    record = run(corpus, optimizer="cgad", workers=1, inner_steps=h, rounds=rounds, outer_lr=0.02)

    model = build_model("tiny", tokenizer.vocab_size, seed=0)
    batches = dataset.shard(0, 1).batches(SMALL["batch_size"], SMALL["seq_len"], seed=0)
    trainer = InnerTrainer(model, batches, lr=SMALL["inner_lr"])
    phi = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    outer = CGAD(phi, lr=0.02, betas=(0.9, 0.95))
    evals = dataset.eval_batches(SMALL["eval_batches"], SMALL["batch_size"], SMALL["seq_len"])
    losses = []
    for _ in range(rounds):
        for _ in range(h):
            trainer.step()
        with torch.no_grad():
            for p, theta in zip(phi, model.parameters(), strict=True):
                p.grad = p - theta
            outer.step(age=0)
            for p, theta in zip(phi, model.parameters(), strict=True):
                theta.copy_(p)
        losses.append(evaluate(model, evals))
    assert record["losses"] == pytest.approx(losses, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [1, 3])
def test_ages_match_a_fixed_delay(corpus, delay):
    record = run(corpus, optimizer="nesterov", delay=str(delay), rounds=delay + 3)
    assert set(record["age_counts"]) == {str(delay)}
    # each worker receives 2 peers' fragments from every round but the last `delay` ones
    assert record["age_counts"][str(delay)] == 3 * 2 * 3
    assert record["mean_age"] == delay


@pytest.mark.slow
def test_random_delay_ages_stay_in_range_and_vary(corpus):
    record = run(corpus, optimizer="pa-cgad", fragments=2, delay="random:3", rounds=6, cutoff=8.0)
    ages = {int(a) for a in record["age_counts"]}
    assert ages <= {0, 1, 2, 3} and len(ages) >= 3


@pytest.mark.slow
def test_cgad_gate_drops_deliveries_at_the_cutoff(corpus):
    record = run(corpus, optimizer="cgad", delay="2", rounds=5, cutoff=2.0)
    assert record["dropped_stale"] == 3 * 2 * 3  # every peer fragment arrives at age 2 = cutoff
    assert record["applied"] == 0
    decayed = run(corpus, optimizer="adam-decay", delay="2", rounds=5)
    assert decayed["applied"] == 3 * 2 * 3 and decayed["dropped_stale"] == 0


@pytest.mark.slow
def test_slow_worker_fragments_arrive_older_and_it_replays_to_keep_up(corpus):
    record = run(corpus, optimizer="cgad", stragglers=[1.0, 1.0, 2.0], rounds=6)
    ages = {int(a) for a in record["age_counts"]}
    # a worker at half speed publishes a round late; it takes the versions it missed by replaying
    # its peers' deltas (as a daemon behind the swarm's median does), so it stays a round behind
    # instead of falling further back each round
    assert max(ages) >= 1 and record["replayed"] >= 1
    assert max(ages) <= 2, record["age_counts"]


@pytest.mark.slow
def test_loss_falls_and_bytes_are_counted(corpus):
    record = run(corpus, optimizer="sgd", outer_lr=0.7, rounds=5, codec="fp32")  # exact bytes
    assert record["final_loss"] < record["initial_loss"] - 0.5
    assert not record["diverged"]
    numel = sum(p.numel() for p in build_model("tiny", corpus[0].vocab_size, seed=0).parameters())
    # rounds x workers x peers x (the fp32 Δ and the inner first moment beside it in 4-bit blocks)
    assert record["bytes_sent"] == 5 * 3 * 2 * (numel * 4 + encoded_size(numel, MOMENTS_CODEC))
    alone = run(corpus, optimizer="sgd", outer_lr=0.7, rounds=2, codec="fp32", moments="own")
    assert alone["bytes_sent"] == 2 * 3 * 2 * numel * 4  # --moments own: the deltas alone
    assert record["sent_as"] == {}  # whole float32 deltas: none went out encoded (sent_as counts those)
    lossy = run(corpus, optimizer="sgd", outer_lr=0.7, rounds=2, codec="4bit")
    assert lossy["sent_as"] == {"4bit": 2 * 3}  # rounds x workers, each own delta in the codec it went out in


@pytest.mark.slow
def test_narrow_uplink_costs_utilization(corpus):
    numel = sum(p.numel() for p in build_model("tiny", corpus[0].vocab_size, seed=0).parameters())
    # two copies of the model per round through an uplink that moves one per 4 s of compute
    # a fixed fp32 codec (auto would shrink the deltas to fit the link, which is its point)
    slow = run(corpus, optimizer="cgad", bandwidth=numel * 4 / 8.0, rounds=4, codec="fp32")
    fast = run(corpus, optimizer="cgad", rounds=4, codec="fp32")
    assert fast["utilization"] == 1.0
    assert slow["utilization"] < 0.9
    # the default codec chooses what the link carries in time: the same link costs less
    auto = run(corpus, optimizer="cgad", bandwidth=numel * 4 / 8.0, rounds=4)
    assert auto["utilization"] > slow["utilization"]


def test_dropped_and_churned_fragments_are_applied_at_most_once():
    network = VirtualNetwork(delay=Delay(1, random=True), drop=0.3, seed=1)
    transports = [network.join(f"p{i}") for i in range(4)]
    loops = [
        OuterLoop([torch.zeros(6), torch.zeros(3)], OuterOptions(optimizer="sgd"), t, "run")
        for t in transports
    ]
    for rnd in range(12):
        for i, (t, loop) in enumerate(zip(transports, loops, strict=True)):
            t.advance(float(rnd), rnd)
            t.set_alive((rnd + i) % 5 != 0)  # every peer drops out now and then
            if t.alive:
                loop.publish(0, tokens=10)
        for t, loop in zip(transports, loops, strict=True):
            if t.alive:
                loop.apply(0)
    for loop in loops:
        keys = [(d.publisher, d.fragment, d.base_version) for d in loop.history]
        assert len(keys) == len(set(keys))
    assert sum(t.stats.rejected["dropped_in_flight"] for t in transports) > 0


def test_a_receiver_takes_at_most_fan_in_publishers_per_version_and_only_those_are_sent():
    """The daemon's fan-in cap on the virtual wire: per (fragment, kind, base version) a receiver
    takes at most ``fan_in`` publishers; of what one instant offers it, a draw of its own (the
    publishers it heard from before first), so that each publisher reaches about ``fan_in`` peers;
    what is not taken is never sent. A publisher sending again takes no second slot; a delivery
    lost in flight frees its slot, as a fetch that failed does."""
    network = VirtualNetwork(fan_in=2, seed=3)
    peers = [network.join(f"p{i}") for i in range(8)]

    def instant(base: int) -> list[list[str]]:
        network.hold()
        for p in peers:
            p.publish(Fragment(FragmentKey("run", 0, base, p.peer_id), torch.ones(4), tokens=1))
        network.flush()
        return [sorted(f.key.publisher for f in p.receive(0)) for p in peers]

    first = instant(5)
    assert all(len(got) == 2 for got in first)  # 2 of the 7 others each
    assert sum(p.stats.skipped["fan_in"] for p in peers) == 8 * 5
    sent = [p.stats.bytes_sent // 16 for p in peers]  # 16 bytes per delivery
    assert sum(sent) == 16 and max(sent) < 7  # drawn per receiver: not the same two for everyone
    assert len({tuple(got) for got in first}) > 1
    # the next version: each takes the publishers it heard from first
    assert instant(6) == first
    # sent one at a time (not one instant): the first with room left; a second send of a version
    # takes no second slot
    late = VirtualNetwork(fan_in=1)
    a, b, c = (late.join(n) for n in "abc")
    for sender in (a, b, a):
        sender.publish(Fragment(FragmentKey("run", 0, 1, sender.peer_id), torch.ones(4), tokens=1))
    assert [f.key.publisher for f in c.receive(0)] == ["a"]  # a's second send is a replay
    assert c.stats.rejected["replay"] == 1 and c.stats.skipped["fan_in"] == 1
    # a lost delivery frees its slot for the next publisher
    lossy = VirtualNetwork(fan_in=1, drop=0.999999, seed=0)
    a, b, c = (lossy.join(n) for n in "abc")
    a.publish(Fragment(FragmentKey("run", 0, 1, "a"), torch.ones(4), tokens=1))
    lossy.drop = 0.0
    b.publish(Fragment(FragmentKey("run", 0, 1, "b"), torch.ones(4), tokens=1))
    assert [f.key.publisher for f in c.receive(0)] == ["b"]


@pytest.mark.slow
def test_the_simulator_caps_fan_in_as_a_daemon_does(corpus):
    capped = run(corpus, workers=6, rounds=3, fan_in=2)
    uncapped = run(corpus, workers=6, rounds=3, fan_in=None)
    # per worker and round at most 2 peers' fragments against 5 without the cap
    assert capped["applied"] <= 6 * 3 * 2 < uncapped["applied"]
    assert capped["bytes_sent"] < uncapped["bytes_sent"]
    # the default, --fan-in auto, cut to the tiny model as a daemon's transport cuts it: 16, so
    # every one of the 5 peers' fragments is taken, as without a cap
    auto = run(corpus, workers=6, rounds=3)
    assert auto["config"]["fan_in"] == 16 and auto["applied"] == uncapped["applied"]


def test_a_republished_key_is_rejected_as_replay():
    network = VirtualNetwork()
    a, b = network.join("a"), network.join("b")
    frag = Fragment(FragmentKey("run", 0, 5, "a"), torch.ones(4), tokens=1)
    a.publish(frag)
    assert len(b.receive(0)) == 1
    a.publish(frag)
    assert b.receive(0) == []
    assert b.stats.rejected["replay"] == 1


def test_a_lossy_codec_on_the_virtual_wire_sends_fewer_bytes_and_feeds_its_error_back():
    # the member's sender encodes and keeps the error feedback; the wire carries its bytes
    network = VirtualNetwork()
    a, b = network.join("a"), network.join("b")
    sender = Sender("4bit")
    sent = [torch.randn(4096, generator=torch.Generator().manual_seed(r)) for r in range(8)]
    received = []
    for version, delta in enumerate(sent):
        data, codec, _ = sender.send(0, delta)
        a.publish_encoded(FragmentKey("run", 0, version, "a"), data, codec=codec, numel=4096, tokens=1)
        (got,) = b.receive(0)
        received.append(got.tensor)
    assert a.stats.bytes_sent == b.stats.bytes_received < 8 * 4096 * 4 / 6  # 4-bit values + scales
    # each delivery is lossy, but what one round drops a later one sends: the sums agree closely
    one_error = float((received[0] - sent[0]).norm() / sent[0].norm())
    summed_error = float((sum(received) - sum(sent)).norm() / sum(sent).norm())
    assert one_error > 0.02 and summed_error < one_error / 2


def test_outer_state_round_trip_continues_identically():
    t1, t2 = VirtualNetwork().join("a"), VirtualNetwork().join("b")  # two swarms of one
    params = [torch.randn(5), torch.randn(2, 3)]
    first = OuterLoop([p.clone() for p in params], OuterOptions(optimizer="cgad", outer_lr=1e-2), t1, "run")
    for _ in range(3):
        for th in first.theta:
            th.add_(torch.randn_like(th) * 0.1)
        first.sync(0, tokens=1)
    second = OuterLoop([p.clone() for p in params], OuterOptions(optimizer="cgad", outer_lr=1e-2), t2, "run")
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    assert second.versions == first.versions == [3]
    step = [torch.randn_like(th) * 0.1 for th in first.theta]
    for loop in (first, second):
        for th, s in zip(loop.theta, step, strict=True):
            th.add_(s)
        loop.publish(0, tokens=1)
    first.apply(0)
    second.apply(0)
    for x, y in zip(first.phi, second.phi, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"delay": "-1"}, "delay"),
        ({"delay": "soon"}, "delay"),
        ({"optimizer": "adamw"}, "optimizer"),
        ({"drop": 1.5}, "drop"),
        ({"inner_steps": 6, "optimizer": "pa-cgad", "fragments": 4}, "multiple"),
        ({"workers": 0}, "workers"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SimConfig(**kwargs)


def test_bad_stragglers():
    assert parse_stragglers("1:3", 3) == [1.0, 1.0, 3.0]
    for text in ("1,2", "x", "5:2"):
        with pytest.raises(ValueError, match="stragglers"):
            parse_stragglers(text, 3)


def cli(*args, cwd=None):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.slow
def test_cli_simulate_with_a_users_text_file(tmp_path, monkeypatch):
    text = tmp_path / "mine.txt"
    text.write_text("All the world's a stage, and all the men and women merely players.\n" * 400)
    cache = tmp_path / "cache"
    out = tmp_path / "r.json"
    result = subprocess.run(
        [CLI, "simulate", "--workers", "2", "--rounds", "2", "--inner-steps", "2", "--delay", "1",
         "--optimizer", "cga", "--optimizer", "nesterov", "--batch-size", "2", "--seq-len", "16",
         "--eval-batches", "1", "--threads", "1", "--data", str(text), "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={"CGAD_CACHE_DIR": str(cache), "PATH": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert [r["optimizer"] for r in doc["records"]] == ["cga", "nesterov"]
    # the default mixing follows each optimizer: late gossip with cga, none with Nesterov
    assert [r["config"]["mixing"] for r in doc["records"]] == ["late", "none"]
    for key in ("optimizer", "delay", "seed", "final_loss", "initial_loss", "losses", "diverged",
                "bytes_sent", "virtual_seconds", "utilization"):  # fmt: skip
        assert key in doc["records"][0]
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--delay", "-2"], "delay must be >= 0"),
        (["--optimizer", "nesterof"], "did you mean 'nesterov'"),
        (["--data", "does/not/exist.txt"], "does not exist"),
        (["--wrokers", "2"], "--workers"),
    ],
)
def test_cli_simulate_bad_options(args, match, tmp_path):
    result = cli("simulate", *args, "--rounds", "1", "--out", str(tmp_path / "r.json"), cwd=tmp_path)
    assert result.returncode == 2
    assert match in result.stderr


@pytest.mark.slow
def test_cli_simulate_empty_corpus(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("   \n")
    result = cli("simulate", "--data", str(empty), "--rounds", "1", "--out", str(tmp_path / "r.json"))
    assert result.returncode == 2
    assert str(empty) in result.stderr


@pytest.mark.slow
def test_churned_workers_are_away_then_resync_when_far_behind(corpus):
    # the daemon's rule: a member more than the cutoff behind the median of its live peers re-syncs
    record = run(corpus, optimizer="cgad", workers=4, churn=0.2, rounds=8, cutoff=1.0, seed=4)
    assert len(record["losses"]) == 8
    assert record["resyncs"] >= 1
    assert record["utilization"] == 1.0  # time away is not counted as idle
    steady = run(corpus, optimizer="cgad", workers=4, rounds=8, cutoff=1.0, seed=4)
    assert record["applied"] < steady["applied"]  # away workers neither send nor receive


def test_a_locally_diverged_block_is_discarded_not_published():
    network = VirtualNetwork()
    a, b = network.join("a"), network.join("b")
    loop = OuterLoop([torch.zeros(4)], OuterOptions(optimizer="sgd", outer_lr=1.0), a, "run")
    peer = OuterLoop([torch.zeros(4)], OuterOptions(optimizer="sgd", outer_lr=1.0), b, "run")
    for node in (loop, peer):  # a first round in which both agree: φ moves to 0.5
        node.theta[0].fill_(0.5)
        node.publish(0, tokens=1)
    for node in (loop, peer):
        node.apply(0)
    loop.theta[0].copy_(torch.tensor([1.0, float("nan"), 0.0, 0.0]))
    peer.theta[0].fill_(1.0)
    peer.publish(0, tokens=1)
    loop.publish(0, tokens=1)
    assert loop.counters.rejected["local_non_finite"] == 1
    assert b.receive(0) == []  # nothing non-finite left the node
    loop.apply(0)
    assert loop.versions == [2]  # the round still counts
    # the peer's progress applied, judged against this node's Δ of the round before
    torch.testing.assert_close(loop.theta[0], torch.full((4,), 1.0))


def test_loaded_state_keeps_this_peers_hyperparameters():
    src = OuterLoop(
        [torch.zeros(3)], OuterOptions(optimizer="cgad", outer_lr=0.05), VirtualNetwork().join("a"), "run"
    )
    src.theta[0].fill_(0.1)
    src.sync(0, tokens=1)
    dst = OuterLoop(
        [torch.zeros(3)], OuterOptions(optimizer="cgad", outer_lr=0.001), VirtualNetwork().join("b"), "run"
    )
    dst.load_state_dict(copy.deepcopy(src.state_dict()))
    assert dst.optimizer.param_groups[0]["lr"] == 0.001
    assert int(dst.optimizer.state[dst.phi[0]]["step"]) == 1


def test_bad_cgad_settings_fail_at_configuration():
    with pytest.raises(ValueError, match="cutoff"):
        OuterOptions(optimizer="cgad", cutoff=0)
    with pytest.raises(ValueError, match="alpha"):
        OuterOptions(optimizer="cgad", alpha=-1)


@pytest.mark.slow
def test_steps_carried_over_the_outer_step_change_nothing_for_a_lone_worker(corpus):
    # alone, averaging at lr 1 puts φ where θ was at publish, so carrying the steps taken since
    # on top of it is training straight on: a lone worker that carries 2 steps over each outer
    # step ends where a bare loop of its 3 × 4 + 2 steps does (the last round carries them too)
    tokenizer, dataset = corpus
    straight = run(corpus, optimizer="cga", workers=1, rounds=3, apply_delay=0)
    carried = run(corpus, optimizer="cga", workers=1, rounds=3, apply_delay=2)
    model = build_model("tiny", tokenizer.vocab_size, seed=0)
    batches = dataset.shard(0, 1).batches(SMALL["batch_size"], SMALL["seq_len"], seed=0)
    trainer = InnerTrainer(model, batches, lr=SMALL["inner_lr"])
    evals = dataset.eval_batches(SMALL["eval_batches"], SMALL["batch_size"], SMALL["seq_len"])
    bare = []
    for steps in (4, 4, 4, 2):
        for _ in range(steps):
            trainer.step()
        bare.append(evaluate(model, evals))
    assert straight["losses"] == pytest.approx(bare[:3], abs=1e-5)
    assert carried["final_loss"] == pytest.approx(bare[3], abs=1e-5)
    # in a swarm the carried steps do change the outcome, and compute stays what it was
    swarm = run(corpus, optimizer="cga", workers=3, rounds=3)
    swarm_carried = run(corpus, optimizer="cga", workers=3, rounds=3, apply_delay=2)
    assert swarm_carried["losses"] != swarm["losses"]
    assert swarm_carried["utilization"] == swarm["utilization"] == 1.0
    with pytest.raises(ValueError, match="apply_delay"):
        SimConfig(inner_steps=4, apply_delay=4)


@pytest.mark.slow
def test_local_is_each_worker_training_alone(corpus):
    tokenizer, dataset = corpus
    record = run(corpus, optimizer="local", workers=2, inner_steps=4, rounds=3)
    assert record["bytes_sent"] == 0 and record["applied"] == 0
    model = build_model("tiny", tokenizer.vocab_size, seed=0)
    batches = dataset.shard(1, 2).batches(SMALL["batch_size"], SMALL["seq_len"], seed=0)
    trainer = InnerTrainer(model, batches, lr=SMALL["inner_lr"])
    evals = dataset.eval_batches(SMALL["eval_batches"], SMALL["batch_size"], SMALL["seq_len"])
    alone = []
    for _ in range(3):
        for _ in range(4):
            trainer.step()
        alone.append(evaluate(model, evals))
    assert record["worker_final_losses"][1] == pytest.approx(alone[-1], rel=1e-5)
    assert record["consensus"][-1] > 0  # alone, the workers drift apart


@pytest.mark.slow
def test_consensus_distance_and_the_loss_of_the_mean(corpus):
    # synchronous averaging, exact on the wire (a lossy codec leaves each φ its own rounding)
    synced = run(corpus, optimizer="sgd", outer_lr=1.0, rounds=3, codec="fp32")
    assert len(synced["consensus"]) == len(synced["mean_phi_losses"]) == 3
    assert max(synced["consensus"]) < 1e-6  # every worker holds the same φ
    assert synced["mean_phi_losses"] == pytest.approx(synced["losses"], rel=1e-4)
    delayed = run(corpus, optimizer="sgd", outer_lr=1.0, rounds=3, delay="random:2", seed=1)
    assert min(delayed["consensus"][1:]) > 1e-4  # without a barrier the workers' φ differ


@pytest.mark.slow
def test_gossip_mixing_runs_in_the_simulator(corpus):
    mixed = run(corpus, optimizer="cgad", mixing="gossip", delay="1", rounds=4)
    assert mixed["mixed"] > 0
    plain = run(corpus, optimizer="cgad", delay="1", rounds=4)
    assert plain["mixed"] == 0 and plain["losses"] != mixed["losses"]
    # in lockstep every φ is the same: the drift is nil, and a peer's φ of the previous version
    # does not drag anyone back
    synced = run(corpus, optimizer="sgd", outer_lr=1.0, rounds=3, codec="fp32")
    synced_mixed = run(corpus, optimizer="sgd", outer_lr=1.0, rounds=3, mixing="gossip", codec="fp32")
    assert synced_mixed["mixed"] > 0
    assert synced_mixed["losses"] == pytest.approx(synced["losses"], rel=1e-5)


def test_late_mixing_sends_phi_while_peers_come_late_and_pulls_by_how_late():
    network = VirtualNetwork()
    me, peer = network.join("me"), network.join("peer")
    options = OuterOptions(optimizer="cga", mixing="late", cga_momentum=0.0)
    loop = OuterLoop([torch.zeros(4)], options, me, "run")

    def round_(fresh: bool, drift: float = 0.0) -> bool:
        """One round: own Δ −1; the peer's Δ −1 at age 0 (when ``fresh``) and its φ ``drift``
        away from this node's; whether this node's φ went out."""
        version = loop.versions[0]
        loop.theta[0].copy_(loop.phi[0] + 1.0)
        before = loop.phi[0].detach().clone()
        loop.publish(0, tokens=10)
        sent = bool(peer.receive(0, Kind.PARAMS))
        key = FragmentKey("run", 0, version, "peer")
        if fresh:
            peer.publish(Fragment(key, torch.full((4,), -1.0), tokens=10))
        peer.publish(Fragment(replace(key, kind=Kind.PARAMS), before + drift, tokens=10))
        loop.apply(0)
        return sent

    # nobody heard on time yet (r 0): φ goes out; the peer's Δ comes fresh (r ½), and the pull
    # is mixing_rate (½) × lateness (½) of the drift: the step to 1, then a quarter of −0.4
    assert round_(fresh=True, drift=0.4)
    torch.testing.assert_close(loop.phi[0].detach(), torch.full((4,), 1.1))
    assert loop.counters.mixed == 1
    assert round_(fresh=True) and round_(fresh=True)  # lateness ½, then ¼: still sent
    assert not round_(fresh=True)  # lateness ⅛: φ stays home, no mix
    assert loop.counters.mixed == 3
    assert not round_(fresh=False)  # the peer's Δ missing: lateness 1/16 → 0.53
    assert round_(fresh=True)


def test_momentum_follows_the_peers_the_fan_in_lets_in_and_late_mixing_every_live_peer():
    """Three live peers, all on time, and a fan-in of one: CGA's momentum follows the share of
    the one peer it may take (all of it: the full momentum), late mixing the share of all three
    (a third heard: lateness ⅔). Over all three, the momentum sat at a third of its setting."""
    network = VirtualNetwork(fan_in=1, seed=0)
    me = network.join("me")
    peers = [network.join(name) for name in ("a", "b", "c")]
    loop = OuterLoop([torch.zeros(4)], OuterOptions(optimizer="cga", cga_momentum=0.9), me, "run")
    for _ in range(12):
        version = loop.versions[0]
        loop.theta[0].copy_(loop.phi[0] + 1.0)
        loop.publish(0, tokens=10)
        for peer in peers:
            peer.publish(Fragment(FragmentKey("run", 0, version, peer.peer_id), -torch.ones(4), tokens=10))
        loop.apply(0)
    assert me.stats.skipped["fan_in"] == 2 * 12
    assert loop.method.momentum_now(loop.optimizer) == pytest.approx(0.9, abs=1e-3)
    assert loop._lateness(0) == pytest.approx(2 / 3, abs=1e-3)


def test_late_mixing_needs_cga_and_says_so():
    with pytest.raises(ValueError, match="--mixing late is made and measured for cga"):
        SimConfig(optimizer="nesterov", mixing="late")


def test_the_default_mixing_is_late_with_cga_and_none_elsewhere():
    assert SimConfig().mixing == "late" and SimConfig(mixing="auto").mixing == "late"
    assert SimConfig(optimizer="sgd").mixing == "none" and SimConfig(optimizer="nesterov").mixing == "none"
    assert SimConfig(mixing="gossip").mixing == "gossip"
    assert JoinConfig().mixing == "late" and JoinConfig(sync="allreduce").mixing == "none"


def test_late_mixing_sends_phi_only_where_the_link_has_room_for_it():
    """φ in fp32 is 8 times a 4-bit Δ: on a link whose round budget holds the Δ and not φ, a
    late round sends the Δ alone (φ would delay it); with room, φ goes out as before."""
    network = VirtualNetwork()
    me, peer = network.join("me"), network.join("peer")
    options = OuterOptions(optimizer="cga", mixing="late", cga_momentum=0.0)
    loop = OuterLoop([torch.zeros(4096)], options, me, "run", codec="auto", link_budget=me.round_budget)
    need = encoded_size(4096, "4bit") + encoded_size(4096, "fp32")
    sent = []
    for round_, budget in enumerate([None, need / 2, need * 2]):  # no limit, too small, room
        # bandwidth for one peer: the budget is AUTO_LINK_SHARE of a 10 s round
        network.bandwidth = None if budget is None else budget / (AUTO_LINK_SHARE * 10.0)
        me.advance(10.0 * round_, round_)
        loop.theta[0].add_(1.0)
        loop.publish(0, tokens=10)  # nobody heard on time: lateness 1
        peer.advance(1e9, round_)  # whatever was sent has landed
        sent.append(bool(peer.receive(0, Kind.PARAMS)))
        loop.apply(0)
    assert sent == [True, False, True]


def test_fragments_mean_one_thing_for_every_method():
    assert SimConfig(optimizer="cgad", fragments=2, inner_steps=4).fragments == 2
    with pytest.raises(ValueError, match="pa-cgad is CGAD synced fragment by fragment"):
        SimConfig(optimizer="pa-cgad", fragments=1)


def test_far_future_and_non_finite_deliveries_are_counted_and_dropped():
    network = VirtualNetwork()
    a, b = network.join("a"), network.join("b")
    loop = OuterLoop([torch.zeros(4)], OuterOptions(optimizer="cga", cutoff=4.0), a, "run")
    forged = [
        Fragment(FragmentKey("run", 0, 10**9, "b"), torch.full((4,), 5.0), tokens=1),  # far future
        Fragment(FragmentKey("run", 0, 0, "b"), torch.full((4,), float("inf")), tokens=1),
    ]
    for fragment in forged:
        b.publish(fragment)
    loop.theta[0].fill_(-0.5)
    loop.sync(0, tokens=1)
    assert loop.counters.rejected["future"] == 1 and loop.counters.rejected["non_finite"] == 1
    assert loop.counters.applied == 0 and loop.versions == [1]
    torch.testing.assert_close(loop.phi[0].detach(), torch.full((4,), -0.5))  # only its own step


def test_a_peer_claiming_huge_token_counts_weighs_at_most_twice_the_own_block():
    network = VirtualNetwork()
    a, b = network.join("a"), network.join("b")
    # the plain merge, so that only the token cap is at work (clipping would also hold 3.0 in)
    # and no momentum, so the step is the merge
    options = OuterOptions(optimizer="cga", aggregation="mean", cga_momentum=0.0)
    loop = OuterLoop([torch.zeros(1)], options, a, "run")
    b.publish(Fragment(FragmentKey("run", 0, 0, "b"), torch.full((1,), 3.0), tokens=2**62))
    loop.theta[0].fill_(-0.5)  # own Δ = +0.5, 100 tokens
    loop.sync(0, tokens=100)
    # weights 100 (own) and 200 (capped claim): Δ̄ = (100·0.5 + 200·3) / 300
    torch.testing.assert_close(loop.phi[0].detach(), torch.tensor([-(100 * 0.5 + 200 * 3.0) / 300]))
    assert loop.counters.tokens_capped == 1


@pytest.mark.slow
def test_a_straggler_far_behind_catches_up_instead_of_drifting_alone(corpus):
    # a daemon's rules: it replays the peers' deltas of the versions it missed, or, more than the
    # cutoff behind, adopts a peer's state
    record = run(corpus, optimizer="cga", stragglers=[1.0, 1.0, 4.0], rounds=8, cutoff=1.0)
    assert record["replayed"] + record["resyncs"] >= 3
    assert len(record["losses"]) == 8 and len(record["consensus"]) == 8


def test_a_late_outer_step_carries_the_inner_steps_taken_meanwhile():
    """apply(carry=True): θ ← φ' + (θ − θ at publish); a peer's fragment of the same version
    that arrived meanwhile counts at age 0."""
    network = VirtualNetwork()
    a, b = network.join("a"), network.join("b")
    params = [torch.zeros(4), torch.zeros(2)]
    loop = OuterLoop([p.clone() for p in params], OuterOptions(optimizer="sgd", outer_lr=1.0), a, "run")
    for th in loop.theta:
        th.add_(1.0)  # the block: Δ = φ − θ = −1 everywhere
    loop.publish(0, tokens=10)
    b.publish(Fragment(FragmentKey("run", 0, 0, "b"), torch.full((6,), -3.0), tokens=10))
    for th in loop.theta:
        th.add_(0.5)  # inner steps after publishing, before the late step
    [own, peer] = loop.apply(0, carry=True)
    assert peer.age == 0 and not peer.own and own.own
    # φ' = φ − mean(Δ) = 0 + 2; θ = φ' + 0.5
    assert all(torch.allclose(p, torch.full_like(p, 2.0)) for p in loop.phi)
    assert all(torch.allclose(th, torch.full_like(th, 2.5)) for th in loop.theta)
    # the next block's Δ counts the carried steps: φ' − θ = −0.5 before any more steps
    loop.publish(0, tokens=10)
    [again] = loop.apply(0)
    assert again.own and all(torch.allclose(p, torch.full_like(p, 2.5)) for p in loop.phi)


def test_shared_data_gives_each_worker_the_whole_corpus_and_its_own_stream(corpus):
    _, dataset = corpus
    config = SimConfig(workers=4, batch_size=2, seq_len=32)
    disjoint = [worker_batches(dataset, config, w) for w in range(4)]
    whole = config.model_copy(update={"data_split": "shared"})
    shared = [worker_batches(dataset, whole, w) for w in range(4)]
    assert all(abs(len(b._tokens) - dataset.split / 4) <= 1 for b in disjoint)  # a quarter each, apart
    assert all(len(b._tokens) == dataset.split for b in shared)  # everything, for everyone
    first = [next(b) for b in shared]
    assert not any(torch.equal(first[0], other) for other in first[1:])  # streams of their own


def test_cga_momentum_is_on_where_deliveries_are_fresh_and_off_where_every_one_is_late(corpus):
    fresh = run(corpus, optimizer="cga", cga_momentum=0.5, rounds=3)
    # every peer's delta two rounds old
    late = run(corpus, optimizer="cga", cga_momentum=0.5, delay="2", rounds=3)
    assert 0.2 < fresh["mean_outer_momentum"] <= 0.5 and late["mean_outer_momentum"] == 0.0
    assert run(corpus, optimizer="sgd", rounds=1)["mean_outer_momentum"] is None


def test_seconds_per_round_span_the_round_when_the_clock_moves_every_step():
    """The simulator advances a peer's clock at every inner step: the link budget's seconds per
    round must still be the whole round's, not the last step's."""
    me = VirtualNetwork().join("me")
    for step in range(1, 17):  # 8 steps of 1 s per round
        me.advance(float(step), step // 8)
    assert me.seconds_per_round == pytest.approx(8.0)
