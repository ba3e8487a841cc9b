"""One owner per decision: where a daemon and the simulator take the same decision, they take it
through the same code. Each test names the decision and shows that both sides reach the one owner."""

import pytest
from pydantic import ValidationError

from cgad.node.config import JoinConfig, RoundOptions
from cgad.node.sim.config import SimConfig
from cgad.protocol.config import ExchangeOptions


def test_the_exchange_and_the_round_are_one_part_each_that_join_and_simulate_share():
    for part in (ExchangeOptions, RoundOptions):
        assert issubclass(JoinConfig, part) and issubclass(SimConfig, part)
        for name in part.model_fields:  # declared once: both take the part's own field
            fields = (JoinConfig.model_fields[name], SimConfig.model_fields[name], part.model_fields[name])
            assert len({repr(field) for field in fields}) == 1, name


@pytest.mark.parametrize("model", [JoinConfig, SimConfig])
def test_an_apply_delay_past_the_block_is_refused_by_one_rule(model):
    with pytest.raises(ValidationError, match=r"--apply-delay \(10\) must be under a block \(10 steps\)"):
        model(inner_steps=10, apply_delay=10)
    assert model(inner_steps=10, apply_delay=9).apply_delay == 9


@pytest.mark.parametrize("model", [JoinConfig, SimConfig])
def test_a_sparse_codec_without_error_feedback_is_refused_by_one_rule(model):
    with pytest.raises(ValidationError, match="needs --error-feedback"):
        model(codec="sparse", error_feedback=False)


def test_the_simulators_record_counts_what_a_daemons_status_counts():
    """``Counters.totals`` is the one list: the daemon's status spreads it (tests/test_daemon.py
    asserts its keys), and so does the simulator's record, summed over the honest workers."""
    from cgad.node.member.ledger import COUNTED
    from cgad.node.sim.simulate import simulate
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    config = SimConfig(workers=3, inner_steps=4, rounds=2, batch_size=2, seq_len=32, eval_batches=1)
    record = simulate(config, load_dataset(tokenizer), tokenizer.vocab_size)
    assert set(COUNTED) <= set(record)
    assert record["published"] == 3 * 2 and record["applied"] == 3 * 2 * 2  # every peer's, every round


def test_the_daemon_and_the_simulator_choose_a_snapshot_by_one_order():
    """``swarm.snapshot_order`` ranks the snapshots on offer for both: the one nearest the swarm's
    low median wins over a newer one (the highest claim is an attacker's favourite), more holders
    win among those near it, and a publisher whose download failed comes last."""
    import inspect

    from cgad.node.daemon import joining
    from cgad.node.member.swarm import snapshot_order
    from cgad.node.sim import simulate

    rank = lambda offers, median: sorted(offers, key=lambda o: snapshot_order(*o, median, 4))  # noqa: E731
    # (version, holders, misses)
    assert rank([(12, 1, 0), (10, 1, 0), (11, 1, 0)], median=10)[0] == (10, 1, 0)
    assert rank([(10, 1, 0), (11, 3, 0)], median=10)[0] == (11, 3, 0)  # both near: more holders
    assert rank([(10, 4, 1), (13, 1, 0)], median=10)[0] == (13, 1, 0)  # its publisher failed once
    for side in (joining.StateSync._worth_adopting, simulate._PeersInMemory.adopt_state):
        assert "snapshot_order(" in inspect.getsource(side)


def test_the_fan_in_draws_offers_in_one_order_for_a_daemon_and_the_simulator():
    """``fan_in.fan_in_order``: at random, then publishers that delivered before first. The
    daemon's offer selector and the simulator's network both draw through it."""
    import inspect
    import random

    from cgad.node.sim.memory import VirtualNetwork
    from cgad.protocol.fan_in import fan_in_order
    from cgad.protocol.selection import OfferSelector

    drawn = fan_in_order(list("abcdef"), random.Random(0), lambda p: p in "ce")
    assert set(drawn[:2]) == {"c", "e"} and sorted(drawn) == list("abcdef")
    orders = {"".join(fan_in_order(list("abcdef"), random.Random(s), lambda p: False)) for s in range(20)}
    assert len(orders) > 10  # drawn, not fixed
    for side in (OfferSelector.choose, VirtualNetwork._draw):
        assert "fan_in_order(" in inspect.getsource(side)


def test_the_fan_in_auto_is_cut_to_the_model_by_one_function_for_a_daemon_and_the_simulator():
    """``--fan-in auto`` (the default): as many peers as 2 GiB holds a Δ and a first moment of
    each decoded, 4 to 16. A daemon's transport cuts it from the fragments it receives, the
    simulator from its model, both through ``fan_in.fan_in_for``; a number or none stands."""
    import inspect

    from cgad.node.sim import simulate
    from cgad.node.training.model import model_config, parameter_count
    from cgad.protocol.fan_in import fan_in_for
    from cgad.protocol.network import NetworkTransport

    sizes = {name: parameter_count(model_config(name, 1024)) for name in ("tiny", "small", "1b")}
    caps = {name: fan_in_for("auto", numel) for name, numel in sizes.items()}
    assert caps == {"tiny": 16, "small": 10, "1b": 4}, (caps, sizes)
    assert fan_in_for(3, 10**9) == 3 and fan_in_for(None, 10) is None
    for side in (NetworkTransport.__init__, simulate.simulate):
        assert "fan_in_for(" in inspect.getsource(side)


def test_the_fan_ins_slots_are_counted_by_one_ledger(monkeypatch):
    """``fan_in.FanInSlots`` holds the slots of a daemon's offer selector and of the simulator's
    peers: taken, spent when the bytes arrive, free again when they do not; half the slots at most
    for a version ahead. A delivery lost in flight frees its slot on the simulator's side as a
    failed fetch does on the daemon's."""
    import torch

    from cgad.node.sim.memory import VirtualNetwork
    from cgad.protocol.fan_in import FanInSlots
    from cgad.protocol.selection import OfferSelector
    from cgad.protocol.transport import Fragment, FragmentKey, Kind

    slots, key = FanInSlots(2, pending_seconds=10.0), (0, Kind.DELTA, 3)
    assert slots.room(key, 0.0) == 2 and slots.room(key, 0.0, ahead=True) == 1
    slots.take(key, "a", 0.0)
    assert slots.holds(key, "a", 1.0) and slots.room(key, 1.0) == 1 and slots.room(key, 1.0, ahead=True) == 0
    slots.release(key, "a")
    assert not slots.holds(key, "a", 1.0) and slots.room(key, 1.0) == 2
    slots.take(key, "a", 0.0), slots.take(key, "b", 0.0)
    assert slots.room(key, 5.0) == 0 and slots.room(key, 10.0) == 2  # a fetch that never reports back
    slots.take(key, "a", 20.0), slots.verify(key, "a")
    assert slots.room(key, 1e9) == 1  # spent for good
    assert FanInSlots(None).room(key, 0.0) > 1000

    selector = OfferSelector("run", "me", fan_in=4, history_versions=64, record_ttl=120.0)
    assert isinstance(selector.slots, FanInSlots) and selector.slots.fan_in == 4

    def taken(seed: int) -> int:
        """What one receiver takes of two publishers' 40 versions under fan-in 1, half the
        deliveries lost in flight."""
        network = VirtualNetwork(fan_in=1, drop=0.5, seed=seed)
        peers = [network.join(p) for p in "abc"]
        assert all(isinstance(p._slots, FanInSlots) and p._slots.fan_in == 1 for p in peers)
        for version in range(40):
            for sender in peers[1:]:
                sender.publish(
                    Fragment(FragmentKey("run", 0, version, sender.peer_id), torch.ones(4), tokens=1)
                )
        got = peers[0].receive(0)
        assert len({f.key.base_version for f in got}) == len(got)  # one publisher per version at most
        return len(got)

    freeing = [taken(seed) for seed in range(4)]
    monkeypatch.setattr(FanInSlots, "release", lambda self, key, publisher: None)
    keeping = [taken(seed) for seed in range(4)]
    # a version whose first send was lost takes the second publisher's: about 3/4 of the versions
    # against about 1/2 where a lost send kept its slot
    assert all(f > k for f, k in zip(freeing, keeping, strict=True)), (freeing, keeping)
    assert sum(freeing) > 1.3 * sum(keeping)


def test_the_codec_of_a_delta_is_the_senders_alone():
    """Neither transport picks a pseudo-gradient's codec: the simulator's network has no codec of
    its own, and a daemon's publisher sends a delta handed over whole in float32."""
    import inspect

    from cgad.node.sim.memory import VirtualNetwork
    from cgad.protocol.publishing import Publisher

    assert "codec" not in inspect.signature(VirtualNetwork).parameters
    assert "options.codec" not in inspect.getsource(Publisher)


def test_a_second_delivery_of_a_key_is_refused_by_one_ledger():
    """``selection.Deliveries`` keeps the keys taken for a daemon's offer selector and for the
    simulator's peers alike: a key's second delivery is a replay on both sides."""
    import torch

    from cgad.node.sim.memory import VirtualNetwork
    from cgad.protocol.selection import Deliveries, OfferSelector
    from cgad.protocol.transport import Fragment, FragmentKey

    ledger = Deliveries()
    key = FragmentKey("run", 0, 3, "peer")
    assert ledger.take(key, b"h") and not ledger.take(key, b"other") and ledger.get(key) == b"h"
    network = VirtualNetwork()
    a, b = network.join("a"), network.join("b")
    a.publish(Fragment(FragmentKey("run", 0, 1, "a"), torch.ones(4), tokens=1))
    a.publish(Fragment(FragmentKey("run", 0, 1, "a"), torch.ones(4), tokens=1))  # the same key again
    assert len(b.receive(0)) == 1 and b.stats.rejected["replay"] == 1
    assert isinstance(b._delivered, Deliveries)
    selector = OfferSelector("run", "me", fan_in=4, history_versions=64, record_ttl=120.0)
    assert isinstance(selector.delivered, Deliveries)


def test_which_versions_can_count_has_one_owner():
    """``methods.UsableVersions``: the member's step drops a delta further ahead than the cutoff,
    and a daemon's transport is built to fetch nothing outside the same window (stale or ahead)."""
    import inspect

    from cgad.node.config import OuterOptions
    from cgad.node.daemon import node
    from cgad.node.member.methods import UsableVersions
    from cgad.node.member.outer import OuterLoop

    usable = UsableVersions.of(OuterOptions(optimizer="cga", cutoff=4))
    assert usable.stale_after == 4 and usable.max_ahead == 4
    assert usable.too_far_ahead(15, 10) and not usable.too_far_ahead(14, 10)
    assert UsableVersions.of(OuterOptions(optimizer="nesterov")).stale_after is None  # every age counts
    assert "self.usable.too_far_ahead(" in inspect.getsource(OuterLoop.apply)
    built = inspect.getsource(node.Node)
    assert "UsableVersions.of(" in built and "stale_after=usable.stale_after" in built
    assert "max_ahead=usable.max_ahead" in built
