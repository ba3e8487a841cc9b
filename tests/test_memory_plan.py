"""The member's host memory beside φ, its optimizer state and θ (docs/SCALE.md, "Host memory
beside the GPU"): what an ``OuterLoop`` holds between two outer steps, counted by walking its
attributes, against the table's bytes per parameter; and the yardstick it judges peers by, built
for the step from what it holds."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from cgad.node.config import OuterOptions
from cgad.node.member.outer import OuterLoop
from cgad.node.member.sender import Sender
from cgad.node.sim.memory import VirtualNetwork
from cgad.optim import FLOAT64_CHUNK, AroundOwn
from cgad.protocol.codec import Codec, decode, encode

NUMEL = 1 << 16
OWNED_ELSEWHERE = ("phi", "theta", "optimizer", "transport", "method", "options")


def _held_bytes(obj: object, seen: set[int] | None = None) -> int:
    """Bytes of tensors and byte strings reachable from ``obj``'s attributes and containers (each
    counted once), leaving out what the table counts apart (φ, θ, the outer optimizer)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, bytes | bytearray):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_held_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple | set | frozenset):
        return sum(_held_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("cgad."):
        return sum(_held_bytes(v, seen) for k, v in vars(obj).items() if k not in OWNED_ELSEWHERE)
    if hasattr(obj, "__slots__") and type(obj).__module__.startswith("cgad."):
        return sum(_held_bytes(getattr(obj, k), seen) for k in obj.__slots__ if hasattr(obj, k))
    return 0


def _rounds(codec: str, rounds: int = 3) -> OuterLoop:
    """A member and one peer, each sending its Δ in ``codec`` for ``rounds`` rounds."""
    torch.manual_seed(0)
    network = VirtualNetwork()
    options = OuterOptions(optimizer="sgd", outer_lr=1.0)
    me = OuterLoop([torch.zeros(NUMEL)], options, network.join("me"), "run", codec=codec)
    peer = OuterLoop([torch.zeros(NUMEL)], options, network.join("peer"), "run", codec=codec)
    drift = torch.randn(NUMEL) * 0.01
    for _ in range(rounds):
        for loop in (me, peer):
            loop.theta[0].add_(drift + torch.randn(NUMEL) * 0.01)
            loop.publish(0, tokens=10)
        for loop in (me, peer):
            loop.apply(0)
    assert me.counters.applied == rounds and me.counters.clipped == 0
    return me


def test_between_outer_steps_the_member_holds_the_residual_in_bfloat16_and_its_delta_encoded() -> None:
    """Was 12 bytes per parameter under 4bit: the yardstick (4), the residual (4), the own Δ as
    sent, decoded (4). Now the residual in bfloat16 (2) and the own Δ's bytes as sent (4bit:
    0.5625, the very bytes the store serves; sparse: 0.14); the yardstick is rebuilt at the step
    from them."""
    for codec, encoded in (("4bit", 0.5625), ("sparse", 0.1407)):
        loop = _rounds(codec)
        assert loop.sender._unsent[0].residual.dtype == torch.bfloat16
        held = _held_bytes(loop) / NUMEL
        assert held <= 2 + encoded + 0.01, (codec, held)


def test_the_yardstick_is_the_own_delta_and_what_it_owed() -> None:
    """Rebuilt from the Δ as sent and the residual after it: the Δ plus what earlier rounds had
    left out, the target the bytes approximate; as a delivery of the same sparsity, the Δ as
    sent."""
    torch.manual_seed(0)
    sender = Sender("sparse")
    first, second = torch.randn(NUMEL), torch.randn(NUMEL)
    sender.send(0, first)
    owed = sender._unsent[0].residual.float().clone()
    data, codec, kept = sender.send(0, second)
    assert codec is Codec.SPARSE
    yardstick = sender.yardstick(0, second)
    assert torch.allclose(yardstick.target, second + owed, atol=1e-2 * float(owed.abs().max()))
    assert torch.equal(yardstick.reference(kept), decode(data))
    # a dense delivery is judged against the dense target, a sparser one against it picked so
    assert torch.equal(yardstick.reference(None), yardstick.target)
    assert torch.equal(yardstick.reference(4), decode(encode(yardstick.target, Codec.SPARSE, 4)))
    # a block that diverged: the latest own Δ as it went out, with what it still owes
    later = sender.yardstick(0, None)
    assert torch.allclose(later.target, yardstick.target)
    assert Sender("sparse").yardstick(0, None) is None  # never a block of its own


@pytest.mark.parametrize("codec", ["sparse", "4bit", "fp32"])
def test_judging_a_chunk_at_a_time_is_judging_against_the_whole_reference(codec: str) -> None:
    """``Yardstick.judge`` never builds a whole reference, and gives AroundOwn's floats bit for
    bit: dense deliveries, ones as sparse as the own Δ went out and sparser ones, one far enough
    off to be clipped and one against the own Δ, over several chunks and a partial last block;
    and the same for a block that was withheld and for one that diverged."""
    torch.manual_seed(1)
    numel = 2 * FLOAT64_CHUNK + 1000
    sender = Sender(codec)
    sender.send(0, torch.randn(numel))
    own = torch.randn(numel)
    _, _, kept = sender.send(0, own)
    sparse_kept = kept if codec == "sparse" else None
    deliveries = [
        (torch.randn(numel), None), (own + 0.1 * torch.randn(numel), sparse_kept), (-own, sparse_kept),
        (50 * torch.randn(numel), None), (decode(encode(torch.randn(numel), Codec.SPARSE, 4)), 4),
    ]  # fmt: skip
    withheld = Sender(codec)
    withheld.send(0, torch.randn(numel))
    withheld.withhold(0, own)
    for yardstick in (sender.yardstick(0, own), sender.yardstick(0, None), withheld.yardstick(0, own)):
        got = yardstick.judge(deliveries, 2.0)
        clipped = 0
        for (delta, k), judged in zip(deliveries, got, strict=True):
            want = AroundOwn(yardstick.reference(k), 2.0).judge(delta)
            assert judged.cosine == want[0] and judged.clipped == want[2]
            assert torch.equal(judged.delta, want[1])
            clipped += judged.clipped
        assert clipped >= 1 and got[2].cosine < 0
        # the chunks put together are the whole target picked at once
        assert torch.equal(yardstick.reference(4), decode(encode(yardstick.target, Codec.SPARSE, 4)))
        norm = float(torch.linalg.vector_norm(yardstick.target, dtype=torch.float64))
        assert abs(yardstick.norm() - norm) <= 1e-12 * norm


def test_a_step_without_peers_builds_no_yardstick() -> None:
    built = []
    loop = OuterLoop([torch.zeros(NUMEL)], OuterOptions(optimizer="sgd"), VirtualNetwork().join("me"), "run",
                     codec="4bit")  # fmt: skip
    original = loop.sender.yardstick

    def counting(fragment: int, own: Tensor | None):
        yardstick = original(fragment, own)
        built.append(yardstick)
        return yardstick

    loop.sender.yardstick = counting  # type: ignore[method-assign]
    loop.theta[0].add_(1.0)
    loop.publish(0, tokens=10)
    loop.apply(0)
    assert len(built) == 1 and "_sent" not in vars(built[0])  # asked for, never built


def test_the_progress_carried_over_a_late_step_is_held_in_theta_as_a_copy_would_hold_it() -> None:
    """apply(carry=True) with float32 θ: θ ← φ' + (θ − θ at publish) bit for bit as with a
    float32 copy of the progress (what the step held before, 4 bytes per parameter); a θ of
    another dtype still gets the copy; a step that fails leaves θ at φ plus the progress."""
    from cgad.node.member.carry import hold_progress, restart_theta

    torch.manual_seed(5)
    phi, own = [torch.randn(1000)], [torch.randn(1000) * 1e-3]
    for dtype in (torch.float32, torch.bfloat16):
        theta = [(phi[0] - own[0] + torch.randn(1000) * 1e-4).to(dtype)]
        as_copy = theta[0].float() - phi[0] + own[0]
        progress = hold_progress(theta, phi, own)
        assert (progress is None) == (dtype == torch.float32)
        stepped = [phi[0] + torch.randn(1000) * 1e-2]
        restart_theta(theta, stepped, progress, carried=True)
        assert torch.equal(theta[0], (stepped[0] + as_copy).to(dtype))
    network = VirtualNetwork()
    loop = OuterLoop([torch.zeros(8)], OuterOptions(optimizer="sgd", outer_lr=1.0), network.join("me"), "run")
    loop.theta[0].add_(1.0)
    loop.publish(0, tokens=10)
    loop.theta[0].add_(0.5)  # inner steps after publishing

    def failing(*args: object) -> None:
        raise RuntimeError("the step failed")

    loop._take_steps = failing  # type: ignore[method-assign]
    try:
        loop.apply(0, carry=True)
    except RuntimeError:
        pass
    assert torch.equal(loop.theta[0], torch.full((8,), 0.5))  # φ (unchanged) + the progress
