"""``mixing.Mixer``: which rounds send and pull φ, whether φ fits the link, how a peer's φ is held.
Freshness (``lateness``) is read only under ``--mixing late`` (methods other than CGA keep none)."""

import random

import pytest
import torch

from cgad.node.config import OuterOptions
from cgad.node.member.ledger import Counters
from cgad.node.member.mixing import LATE_SHARE, Mixer
from cgad.protocol.codec import encoded_size
from cgad.protocol.config import wire_codec


def _mixer(mixes_params: bool = False, **options: object) -> Mixer:
    return Mixer(OuterOptions(**options), mixes_params, "fp32", Counters(), random.Random(0))


def _unread() -> float:
    raise AssertionError("lateness read where the mixing does not use it")


def test_which_rounds_send_phi():
    assert not _mixer(optimizer="nesterov", mixing="none").due(4, _unread)
    assert not _mixer(mixes_params=True, optimizer="nesterov", mixing="gossip").due(4, _unread)
    gossip = _mixer(optimizer="nesterov", mixing="gossip", mixing_period=2)
    assert gossip.due(4, _unread) and not gossip.due(5, _unread)
    late = _mixer(optimizer="cga", mixing="late")
    assert late.due(5, lambda: LATE_SHARE) and not late.due(4, lambda: LATE_SHARE / 2)
    # late mixing pulls where its φ went out at this version; gossip at its period
    late.published[0] = {7: torch.zeros(2)}
    assert late.now(0, 7, _unread) and not late.now(0, 8, _unread)


def test_phi_goes_out_under_late_mixing_only_where_the_link_has_room():
    numel, total = 1000, 4000
    phi_bytes = encoded_size(numel, wire_codec("fp32"))
    late = _mixer(optimizer="cga", mixing="late")
    assert not late.room(numel, 100, None, total)  # the link not measured yet
    budget_for_all = (phi_bytes + 100) * total / numel
    assert late.room(numel, 100, budget_for_all, total)
    assert not late.room(numel, 101, budget_for_all, total)
    assert _mixer(optimizer="nesterov", mixing="gossip").room(numel, 10**9, 1.0, total)


def test_a_peers_phi_is_held_within_the_radius_of_the_own_delta():
    anchor, far = torch.zeros(64), torch.full((64,), 100.0)
    mean = _mixer(optimizer="nesterov", aggregation="mean")
    assert torch.equal(mean.hold(0, anchor, far, lambda: None), far)
    clip = _mixer(optimizer="nesterov", aggregation="clip", clip_radius=2.0)
    assert torch.equal(clip.hold(0, anchor, far, lambda: None), anchor)  # no own Δ: no pull
    held = clip.hold(0, anchor, far, lambda: 1.0)
    assert held.norm() == pytest.approx(2.0, rel=1e-5) and clip.counters.clipped_params == 1
    near = torch.full((64,), 0.01)  # within the radius: as sent
    assert torch.allclose(clip.hold(0, anchor, near, lambda: 1.0), near)
