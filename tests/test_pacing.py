"""Keeping a daemon's block boundaries in phase with its peers' (node/member/pacing.py)."""

import itertools

from test_consensus import _Alone  # tests/ is on sys.path under pytest

from cgad.node.member.pacing import adopted_block_over, phase_nudge


def test_a_node_whose_wait_ends_short_of_its_peers_is_ahead_and_waits_longer_next_block():
    assert phase_nudge(block=50, early=0, arrived=2, awaited=3) == 12
    assert phase_nudge(block=10, early=1, arrived=1, awaited=3) == 2


def test_a_node_that_had_every_fragment_before_it_published_is_behind_and_hurries():
    assert phase_nudge(block=50, early=3, arrived=3, awaited=3) == -12


def test_a_node_rounds_ahead_of_its_peers_lengthens_its_blocks_up_to_twice():
    """Two rounds or more past the swarm is speed, not phase: a quarter more per round of lead
    past the first, up to a whole block more; behind or in phase it is the plain nudge."""
    assert phase_nudge(block=16, early=0, arrived=0, awaited=3, lead=1) == 4
    assert phase_nudge(block=16, early=0, arrived=0, awaited=3, lead=2) == 8
    assert phase_nudge(block=16, early=0, arrived=0, awaited=3, lead=3) == 12
    assert phase_nudge(block=16, early=0, arrived=0, awaited=3, lead=4) == 16
    assert phase_nudge(block=16, early=0, arrived=0, awaited=3, lead=230) == 16
    assert phase_nudge(block=16, early=0, arrived=0, awaited=3, lead=-5) == 4
    # the peers' fragments all in: whatever the lead, the block keeps its length
    assert phase_nudge(block=16, early=1, arrived=3, awaited=3, lead=6) == 0


class _BehindPeers:
    """Three live peers stuck at version 0 whose fragments never arrive: a member faster than
    its swarm."""

    def live_peers(self) -> list[str]:
        return ["a", "b", "c"]

    def arrived(self, index: int, base_version: int) -> int:
        return 0

    def reports(self) -> dict[str, list[int]]:
        return {"a": [0], "b": [0], "c": [0]}


def test_a_member_ahead_of_its_swarm_slows_its_rounds_to_twice_the_block():
    """The engine gives the nudge its lead: the rounds of a member whose peers stay behind take
    a quarter block more, then more with each round of lead, then twice the block."""
    import torch

    from cgad.node.config import OuterOptions
    from cgad.node.member.engine import Member, Schedule
    from cgad.node.member.outer import OuterLoop
    from cgad.node.sim.memory import VirtualNetwork

    loop = OuterLoop([torch.zeros(4)], OuterOptions(optimizer="cga"), VirtualNetwork().join("me"), "run")
    member = Member(loop, _BehindPeers(), Schedule(fragments=1, inner_steps=8))
    rounds_at: list[int] = []
    for steps in range(1, 200):
        before = loop.versions[0]
        member.after_inner_step(steps)
        if loop.versions[0] > before:
            rounds_at.append(steps)
    lengths = [b - a for a, b in itertools.pairwise(rounds_at)]
    assert lengths[:2] == [10, 10]  # lead 0 and 1: a quarter block more (the plain nudge)
    assert lengths[4:] and set(lengths[4:]) == {16}, lengths  # lead 4 on: twice the block
    assert member.phase_nudges["longer"] == len(rounds_at)


def test_a_node_in_phase_keeps_its_block_and_a_tiny_block_still_moves():
    assert phase_nudge(block=50, early=1, arrived=3, awaited=3) == 0  # in by the step, not all early
    assert phase_nudge(block=2, early=0, arrived=0, awaited=1) == 1
    assert phase_nudge(block=50, early=0, arrived=0, awaited=0) == 0  # alone: nothing to align with


def test_the_first_block_after_adopting_a_state_ends_when_the_peers_end_theirs():
    assert adopted_block_over(steps=7, block=50, peers_in=1, peers_live=True)  # theirs arrived
    assert not adopted_block_over(steps=0, block=50, peers_in=2, peers_live=True)  # one step first
    assert not adopted_block_over(steps=60, block=50, peers_in=0, peers_live=True)  # still waiting
    assert adopted_block_over(steps=75, block=50, peers_in=0, peers_live=True)  # a block and a half
    assert adopted_block_over(steps=50, block=50, peers_in=0, peers_live=False)  # nobody to wait for


def test_the_outer_step_waits_for_the_own_send_while_training_goes_on_not_the_trainer():
    """The wait for peers ends early once they are all in, but not while the own Δ is still being
    encoded on the encoder thread: the outer step would wait for it there, and the trainer with it
    (a lone daemon at `small` stalled ~1 s per outer step so). At the apply delay's last step it
    is taken whatever."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from cgad.node.config import OuterOptions
    from cgad.node.member.engine import Member, Schedule
    from cgad.node.member.outer import OuterLoop
    from cgad.node.sim.memory import VirtualNetwork

    encoder = ThreadPoolExecutor(max_workers=1)
    gate, second = threading.Event(), threading.Event()
    threading.Timer(10.0, gate.set).start()  # a step that waits for the send fails, not hangs
    loop = OuterLoop(
        [torch.zeros(4)], OuterOptions(optimizer="cga"), VirtualNetwork().join("me"), "run", encoder=encoder
    )
    member = Member(loop, _Alone(), Schedule(fragments=1, inner_steps=4))  # apply delay: 2 steps
    try:
        encoder.submit(gate.wait)  # the send queues behind this: still under way
        for steps in (1, 2, 3, 4):
            member.after_inner_step(steps)
        assert member.due is not None and loop.versions == [0]  # published, waiting for its send
        gate.set()
        while loop.sending(0):
            threading.Event().wait(0.01)
        member.after_inner_step(5)
        assert member.due is None and loop.versions == [1]
        encoder.submit(second.wait)
        for steps in (6, 7, 8, 9):
            member.after_inner_step(steps)
        assert member.due is not None and loop.versions == [1]
        threading.Timer(0.2, second.set).start()
        member.after_inner_step(10)  # the delay's last step: taken, waiting out the send
        assert member.due is None and loop.versions == [2]
    finally:
        gate.set()
        second.set()
        encoder.shutdown()
