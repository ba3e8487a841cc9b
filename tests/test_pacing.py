"""Keeping a daemon's block boundaries in phase with its peers' (node/member/pacing.py)."""

from cgad.node.member.pacing import adopted_block_over, phase_nudge


def test_a_node_whose_wait_ends_short_of_its_peers_is_ahead_and_waits_longer_next_block():
    assert phase_nudge(block=50, early=0, arrived=2, awaited=3) == 12
    assert phase_nudge(block=10, early=1, arrived=1, awaited=3) == 2


def test_a_node_that_had_every_fragment_before_it_published_is_behind_and_hurries():
    assert phase_nudge(block=50, early=3, arrived=3, awaited=3) == -12


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
