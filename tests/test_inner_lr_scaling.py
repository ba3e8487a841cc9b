"""The inner lr follows how many members the outer step averages (``cgad.optim.averaging``)."""

import math

import pytest
import torch

from cgad.node.config import OuterOptions
from cgad.node.member.outer import OuterLoop, inner_lr_scale
from cgad.node.sim.config import SimConfig
from cgad.node.sim.memory import VirtualNetwork
from cgad.node.training.trainer import InnerTrainer
from cgad.optim.averaging import MAX_AVERAGED, effective_count, running_count
from cgad.protocol.transport import Fragment, FragmentKey


def test_the_effective_count_is_kish_s_and_one_for_a_lone_delta():
    assert effective_count([10, 10, 10, 10]) == pytest.approx(4.0)
    assert effective_count([7]) == effective_count([]) == 1.0
    # a delivery at a tenth of the weight adds a little, not a whole member
    assert effective_count([1.0, 0.1]) == pytest.approx(1.21 / 1.01)
    assert running_count(1.0, 1e9) == MAX_AVERAGED and running_count(1.0, 0.0) == 1.0
    assert running_count(4.0, 0.0) == 2.0  # half the past's


def _rounds(loop: OuterLoop, peers: list, rounds: int, age: int = 0) -> None:
    """Rounds in which every peer's Δ of ``age`` rounds ago arrives beside the own one."""
    for _ in range(rounds):
        version = loop.versions[0]
        loop.theta[0].copy_(loop.phi[0] + 1.0)
        loop.publish(0, tokens=10)
        for peer in peers:
            key = FragmentKey("run", 0, version - age, peer.peer_id)
            peer.publish(Fragment(key, -torch.ones(4), tokens=10))
        loop.apply(0)


def test_a_member_averaging_three_peers_trains_at_twice_the_lr_and_alone_at_the_lr():
    network = VirtualNetwork(seed=0)
    me = network.join("me")
    peers = [network.join(name) for name in ("a", "b", "c")]
    loop = OuterLoop([torch.zeros(4)], OuterOptions(optimizer="cga"), me, "run")
    assert loop.inner_lr_scale() == 1.0  # nobody heard yet: the lr as given
    _rounds(loop, peers, 12)
    assert loop.inner_lr_scale() == pytest.approx(2.0, abs=1e-3)  # √4
    _rounds(loop, [], 12)  # the peers went quiet: back to alone
    assert loop.inner_lr_scale() == pytest.approx(1.0, abs=1e-3)


def test_peers_whose_deltas_are_all_too_old_leave_the_lr_as_alone():
    network = VirtualNetwork(seed=0)
    me = network.join("me")
    peers = [network.join(name) for name in ("a", "b", "c")]
    loop = OuterLoop([torch.zeros(4)], OuterOptions(optimizer="cga", cutoff=2.0), me, "run")
    _rounds(loop, [], 2)  # versions to be late against
    _rounds(loop, peers, 8, age=2)  # every peer's Δ at the cutoff: gated out
    assert loop.counters.dropped_stale == 3 * 8 and loop.inner_lr_scale() == 1.0


def test_the_floor_and_a_pair_never_scale():
    network = VirtualNetwork(seed=0)
    for name in ("local", "noloco", "delayed-nesterov"):
        loop = OuterLoop([torch.zeros(4)], OuterOptions(optimizer=name), network.join(name), "run")
        _rounds(loop, [network.join(f"{name}-peer")], 4)
        assert loop.inner_lr_scale() == 1.0, name


def test_the_trainer_takes_the_scale_and_keeps_the_weight_decay_per_step():
    model = torch.nn.Linear(4, 4)
    scale = [1.0]
    batches = iter(())
    trainer = InnerTrainer(model, batches, lr=1e-3, weight_decay=0.1, lr_scale=lambda: scale[0])
    trainer.step = _no_data_step(trainer)  # the lr is set before the batch is read
    scale[0] = 3.0
    trainer.step()
    group = trainer.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(3e-3)
    assert group["lr"] * group["weight_decay"] == pytest.approx(1e-4)


def _no_data_step(trainer: InnerTrainer):
    original = trainer.step

    def step() -> None:
        with pytest.raises(StopIteration):
            original()

    return step


def test_the_option_decides_for_the_daemon_and_the_simulator_alike():
    network = VirtualNetwork(seed=0)
    loop = OuterLoop([torch.zeros(4)], OuterOptions(optimizer="cga"), network.join("me"), "run")
    assert SimConfig().inner_lr_scaling == "sqrt"
    assert inner_lr_scale(SimConfig(), loop)() == 1.0
    assert inner_lr_scale(SimConfig(inner_lr_scaling="none"), loop) is None
    assert math.isclose(loop.inner_lr_scale(), 1.0)
