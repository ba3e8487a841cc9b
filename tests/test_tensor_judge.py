"""Peers' deltas judged tensor by tensor as well as whole (``Yardstick`` with ``segments``): a push
the whole clip lets through, concentrated on one small tensor, is cut there; an honest peer's
delta, whose tensors lie about as far from the own Δ's as the whole does, passes as sent. And a
near copy (of the own Δ, or of another peer's) is marked, and refused by the outer step."""

from __future__ import annotations

import math

import pytest
import torch

from cgad.node.config import OuterOptions
from cgad.node.member.outer import OuterLoop
from cgad.node.member.sender import Sender, Yardstick
from cgad.node.sim.memory import VirtualNetwork
from cgad.optim import FLOAT64_CHUNK, AroundOwn
from cgad.protocol.codec import Codec, decode, encode
from cgad.protocol.transport import Fragment, FragmentKey

BIG, SMALL = FLOAT64_CHUNK + 5000, 96  # the big tensor straddles a chunk; the small one lies past it


def _yardstick(own: torch.Tensor, segments: list[int] | None) -> Yardstick:
    whole = own.reshape(-1)
    return Yardstick(lambda _, a, b: whole[a:b], None, own.numel(), segments=segments)


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    common = torch.randn(BIG + SMALL)
    own, theirs = common + 2 * torch.randn(BIG + SMALL), common + 2 * torch.randn(BIG + SMALL)
    own[BIG:] *= 0.01  # the small tensor's own Δ is tiny beside the whole (a norm's gains)
    theirs[BIG:] *= 0.01
    return own, theirs


def test_a_push_on_one_small_tensor_is_cut_there_and_the_rest_passes_as_sent() -> None:
    own, theirs = _pair()
    forged = theirs.clone()
    forged[BIG:] += 1.5 * float(own.norm()) / math.sqrt(SMALL)  # 1.5 ‖own‖, all on 96 values
    whole = AroundOwn(own, 2.0).judge(forged)
    assert not whole[2] and whole[0] > 0  # the whole clip and the direction screen (0) take it as sent

    judged = _yardstick(own, [BIG, SMALL]).judge([(forged, None), (theirs, None)], 2.0)
    cut, honest = judged
    assert cut.tensors_cut == 1 and not cut.clipped
    assert torch.equal(cut.delta[:BIG], forged[:BIG])  # the big tensor as sent
    bound = 2.0 * (float(own[BIG:].norm()) + float(own.norm()) * math.sqrt(SMALL / (BIG + SMALL)))
    assert float((cut.delta[BIG:] - own[BIG:]).norm()) == pytest.approx(bound, rel=1e-4)
    assert float((cut.delta[BIG:] - own[BIG:]).norm()) < 0.05 * float(forged[BIG:].norm())
    assert honest.tensors_cut == 0 and not honest.clipped and honest.delta is theirs

    # judged whole only (one tensor, or no segments), the push passes: what the cut adds
    for stick in (_yardstick(own, None), _yardstick(own, [BIG + SMALL])):
        assert stick.judge([(forged, None)], 2.0)[0].delta is forged


def test_a_delta_cut_in_a_tensor_and_then_whole_is_cut_by_both() -> None:
    """The whole verdict is taken on what the tensors' cuts left: a delta far off everywhere is
    held within the whole radius, and its pushed tensor within its own bound too."""
    own, theirs = _pair()
    forged = 10 * theirs
    forged[BIG:] += 1.5 * float(own.norm()) / math.sqrt(SMALL)
    (judged,) = _yardstick(own, [BIG, SMALL]).judge([(forged, None)], 2.0)
    assert judged.clipped and judged.tensors_cut >= 1
    distance = float((judged.delta - own).norm())
    assert distance <= 2.0 * float(own.norm()) * (1 + 1e-4)
    bound = 2.0 * (float(own[BIG:].norm()) + float(own.norm()) * math.sqrt(SMALL / (BIG + SMALL)))
    assert float((judged.delta[BIG:] - own[BIG:]).norm()) <= bound * (1 + 1e-4)


def test_the_sender_judges_each_fragment_by_its_own_tensors() -> None:
    own, theirs = _pair()
    forged = theirs.clone()
    forged[BIG:] += 1.5 * float(own.norm()) / math.sqrt(SMALL)
    sender = Sender(None, segments=[[BIG, SMALL], [7]])
    sender.sent_whole(0, own)
    (judged,) = sender.yardstick(0, own).judge([(forged, None)], 2.0)
    assert judged.tensors_cut == 1
    with pytest.raises(ValueError, match="segments"):
        Yardstick(lambda _, a, b: own[a:b], None, own.numel(), segments=[BIG, SMALL + 1])


def test_a_re_encoded_copy_of_the_own_or_of_another_delta_is_marked_a_copy() -> None:
    """A peer's Δ re-encoded (here in 4-bit blocks) and sent as its own is marked: a copy of the
    own Δ is refused; of a pair of peers' that are one, the later is refused and the earlier
    taken, credited to neither (which is the original, the bytes cannot tell). Honest deltas,
    and a scaled copy (the clip's case), are not marked."""
    own, theirs = _pair()
    other = torch.randn(BIG + SMALL) + own.mean()
    copied = decode(encode(theirs, Codec.FP4)).reshape(-1)
    mine = decode(encode(own, Codec.FP4)).reshape(-1)
    judged = _yardstick(own, [BIG, SMALL]).judge(
        [(theirs, None), (copied, None), (mine, None), (other, None), (own * 1e6, None)], 2.0
    )
    assert [j.copy for j in judged] == [False, True, True, False, False]
    assert [j.uncredited for j in judged] == [True, False, False, False, False]
    assert judged[4].clipped  # a scaled copy is a scaled delivery: clipped, not refused


def test_a_plagiarist_gets_no_credit_and_the_copied_delta_is_applied_once() -> None:
    """A peer that re-encodes another's Δ and publishes it as its own (a public peer re-serving a
    NATed volunteer's): at the outer step the work is taken once, credited to neither, and no
    one is blamed for it."""
    network = VirtualNetwork()
    me, honest, copier = network.join("me"), network.join("honest"), network.join("copier")
    loop = OuterLoop([torch.zeros(4096)], OuterOptions(optimizer="sgd", outer_lr=1.0), me, "run")
    torch.manual_seed(3)
    common = torch.randn(4096)
    loop.theta[0].sub_(common + 2 * torch.randn(4096))
    loop.publish(0, tokens=10)
    theirs = common + 2 * torch.randn(4096)
    honest.publish(Fragment(FragmentKey("run", 0, 0, "honest"), theirs, tokens=10))
    copy = decode(encode(theirs, Codec.FP4)).reshape(-1)
    copier.publish(Fragment(FragmentKey("run", 0, 0, "copier"), copy, tokens=10))
    loop.apply(0)
    assert loop.counters.rejected["copied"] == 1 and loop.counters.applied == 1
    assert not loop.counters.applied_by_peer and not loop.counters.rejected_by_peer


def test_a_tensor_of_no_values_does_not_end_the_walk() -> None:
    """Segments [5, 0, 5]: the push on the last tensor is still cut there, and a delta held by
    the whole clip is written whole (no value left unset)."""
    own = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0, -1.0])
    pushed = own.clone()
    pushed[5:] += torch.tensor([1000.0, 0, 0, 0, 0])
    judged = _yardstick(own, [5, 0, 5]).judge([(pushed, None), (-3 * own + 100, None)], 2.0)
    assert float((judged[0].delta - own).norm()) <= 2.0 * (5**0.5 + 10**0.5 * (5 / 10) ** 0.5) * (1 + 1e-5)
    assert judged[1].clipped and torch.isfinite(judged[1].delta).all()
    assert float((judged[1].delta - own).norm()) <= 2.0 * float(own.norm()) * (1 + 1e-5)


def test_the_direction_screen_sees_the_delta_as_sent_not_as_cut() -> None:
    """A delta opposed to the own Δ overall, whose opposition sits in one tensor that the cut
    shrinks, keeps its cosine as sent: the screen refuses what cutting would have turned around."""
    own = torch.cat([torch.ones(1000), torch.full((10,), 0.01)])
    theirs = torch.cat([0.05 * torch.ones(1000), torch.full((10,), -1000.0)])
    (judged,) = _yardstick(own, [1000, 10]).judge([(theirs, None)], 2.0)
    assert judged.tensors_cut == 1 and judged.cosine < 0
