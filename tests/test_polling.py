"""When a poll looks up the snapshots on offer (``polling.states_due``): each key a poll names is
a search of its own, answered by other nodes, and the snapshots are read only by joiners and
re-syncs."""

from __future__ import annotations

import math

from cgad.protocol.polling import STATE_REFRESH, STATE_WANTED, states_due

NEVER = -math.inf


def test_the_first_poll_looks_at_the_snapshots() -> None:
    assert states_due(100.0, NEVER, NEVER, [3, 3], [[3, 3]])


def test_routine_polls_leave_the_snapshots_out_until_the_refresh_is_due() -> None:
    looked = 100.0
    assert not states_due(looked + 1.0, looked, NEVER, [3, 3], [[3, 3], [4, 3]])
    assert not states_due(looked + STATE_REFRESH - 0.1, looked, NEVER, [3, 3], [])
    assert states_due(looked + STATE_REFRESH, looked, NEVER, [3, 3], [])


def test_a_read_of_the_offers_keeps_every_poll_looking_for_a_while() -> None:
    looked = 100.0
    assert states_due(looked + 1.0, looked, looked + 0.5, [3], [[3]])
    read = looked + 1.0
    assert states_due(read + STATE_WANTED - 0.1, read, read, [3], [[3]])
    assert not states_due(read + STATE_WANTED, read + STATE_WANTED - 1, read, [3], [[3]])


def test_a_peer_trailing_the_swarm_by_more_than_a_version_looks_every_poll() -> None:
    looked = 100.0
    # one version behind is the swarm's ordinary spread: no re-sync near
    assert not states_due(looked + 1.0, looked, NEVER, [5, 5], [[6, 6], [6, 6], [5, 5]])
    # two behind on one fragment, by the low median of the reports (one peer cannot claim it)
    assert states_due(looked + 1.0, looked, NEVER, [5, 4], [[6, 6], [6, 6], [5, 5]])
    assert not states_due(looked + 1.0, looked, NEVER, [5, 4], [[60, 60], [5, 5]])
