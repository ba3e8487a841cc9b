"""The simulator's attacker: parsing an attack, what each kind forges, and what one hostile worker
does to the honest ones with and without the robust aggregation."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError

from cgad.node.sim.attacks import EDGE_MIN_COSINE, Attack, ForgingTransport, edge_targets
from cgad.node.sim.config import SimConfig
from cgad.node.sim.memory import VirtualNetwork
from cgad.node.sim.simulate import simulate
from cgad.node.training.data import load_dataset
from cgad.node.training.tokenizer import load_tokenizer
from cgad.optim.robust import AroundOwn
from cgad.protocol.codec import Codec, decode, encode
from cgad.protocol.transport import Fragment, FragmentKey, Kind


@pytest.mark.parametrize(
    "text",
    [
        "scale:1e6",
        "signflip",
        "noise:3",
        "nan",
        "inf",
        "tokens:1000",
        "future:5",
        "mirror:1",
        "edge:96",
        "edge:norm.weight",
    ],
)
def test_every_kind_parses_and_prints_back(text: str) -> None:
    attack = Attack.parse(text)
    assert Attack.parse(str(attack)) == attack


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("scal:2", "unknown attack 'scal:2'; one of scale:N, signflip"),
        ("scale", "scale needs an amount"),
        ("nan:2", "nan takes no amount"),
        ("tokens:1.5", "tokens takes a whole amount"),
        ("future:-3", "future takes a whole amount"),
        ("scale:inf", "scale takes a finite amount"),
        ("noise:lots", "'lots' is not a number"),
    ],
)
def test_a_bad_attack_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        Attack.parse(text)


def test_the_configuration_names_attack_errors() -> None:
    with pytest.raises(ValidationError, match="attack"):
        SimConfig(workers=3, attackers=1, attack="scal:2")
    with pytest.raises(ValidationError, match="one must be honest"):
        SimConfig(workers=2, attackers=2, attack="nan")
    with pytest.raises(ValidationError, match="--attackers needs --attack"):
        SimConfig(workers=3, attackers=1)


def _fragment(kind: Kind = Kind.DELTA) -> Fragment:
    return Fragment(FragmentKey("run", 0, 7, "evil", kind), torch.tensor([3.0, -4.0]), tokens=100)


def test_mirror_hides_inside_the_clip_and_colluders_push_one_way() -> None:
    torch.manual_seed(0)
    common = torch.randn(50_000)
    own, theirs = common + 2 * torch.randn(50_000), common + 2 * torch.randn(50_000)  # two shards
    attack = Attack.parse("mirror:1")
    fragment = Fragment(FragmentKey("run", 3, 7, "evil", Kind.DELTA), theirs, tokens=100)
    forged = attack.forge(fragment, direction_seed=5).tensor
    push = forged - theirs
    assert push.norm() / theirs.norm() == pytest.approx(1.0, rel=1e-4)
    # the receiver's clip and screen see it as they see an honest peer's Δ
    cosine_honest, _, clipped_honest = AroundOwn(own, radius=2.0).judge(theirs)
    cosine, _, clipped = AroundOwn(own, radius=2.0).judge(forged)
    assert not clipped and not clipped_honest and 0 < cosine < cosine_honest

    # a second attacker of the run pushes the same way; another run (seed), or fragment, elsewhere
    def pushed(fragment_index: int, seed: int) -> float:
        key = FragmentKey("run", fragment_index, 7, "evil2", Kind.DELTA)
        forged = attack.forge(Fragment(key, own, tokens=100), direction_seed=seed).tensor
        return float(torch.nn.functional.cosine_similarity(forged - own, push, dim=0))

    assert pushed(3, 5) > 0.999
    assert abs(pushed(3, 6)) < 0.05 and abs(pushed(4, 5)) < 0.05


def test_the_edge_attack_stays_inside_every_screen_and_aims_at_a_few_values() -> None:
    """``edge:K``: its own Δ plus the longest push on K values that keeps its cosine with that Δ
    at 0.15 or more (at most 4 norms), a token claim at the receivers' cap. The screen and the clip
    around an honest receiver's Δ let it through, and what passes is aimed at those K values."""
    torch.manual_seed(0)
    common = torch.randn(50_000)
    own, theirs = common + 2 * torch.randn(50_000), common + 2 * torch.randn(50_000)
    fragment = Fragment(FragmentKey("run", 3, 7, "evil", Kind.DELTA), theirs, tokens=100)
    forged = Attack.parse("edge:96").forge(fragment, direction_seed=5)
    push = forged.tensor - theirs
    assert int((push != 0).sum()) == 96 and forged.tokens == 200
    cosine = float(torch.nn.functional.cosine_similarity(forged.tensor, theirs, dim=0))
    assert cosine >= EDGE_MIN_COSINE - 1e-6 and float(push.norm()) <= 4 * float(theirs.norm()) * (1 + 1e-6)
    cosine_own, _, _ = AroundOwn(own, radius=2.0).judge(forged.tensor)
    assert cosine_own > 0  # the direction screen (0) passes it
    # colluders of a run push the same K values of a fragment; another fragment, others
    again = Attack.parse("edge:96").forge(
        Fragment(replace(fragment.key, publisher="evil2"), own, 100), direction_seed=5
    )
    assert torch.equal((again.tensor - own) != 0, push != 0)


def test_the_edge_attack_finds_a_named_parameter_in_its_fragment() -> None:
    """``edge:norm.weight`` pushes on the final RMSNorm's gains alone, wherever the strided
    fragments put them (not on a layer's ``input_layernorm.weight``)."""
    named = [("model.embed_tokens.weight", 10), ("model.layers.0.input_layernorm.weight", 4),
             ("model.layers.0.mlp.weight", 6), ("model.norm.weight", 3)]  # fmt: skip
    fragments = [[0, 2], [1, 3]]  # strided, F = 2
    targets = edge_targets(named, fragments, "norm.weight")
    assert list(targets) == [1] and targets[1].tolist() == [4, 5, 6]
    with pytest.raises(ValueError, match="no parameter"):
        edge_targets(named, fragments, "lm_head.weight")
    delta = torch.randn(7)
    forged = Attack.parse("edge:norm.weight").forge(
        Fragment(FragmentKey("r", 1, 0, "e"), delta, 10), targets=targets
    )
    assert torch.equal(forged.tensor[:4], delta[:4]) and not torch.equal(forged.tensor[4:], delta[4:])
    other = Attack.parse("edge:norm.weight").forge(
        Fragment(FragmentKey("r", 0, 0, "e"), delta, 10), targets=targets
    )
    assert torch.equal(other.tensor, delta) and other.tokens == 20  # no such values here: the claim only


def test_what_each_kind_forges() -> None:
    honest = _fragment()
    assert torch.equal(Attack.parse("scale:10").forge(honest).tensor, torch.tensor([30.0, -40.0]))
    assert torch.equal(Attack.parse("signflip").forge(honest).tensor, torch.tensor([-3.0, 4.0]))
    assert torch.isnan(Attack.parse("nan").forge(honest).tensor).all()
    assert torch.isinf(Attack.parse("inf").forge(honest).tensor).all()
    assert Attack.parse("tokens:99999").forge(honest).tokens == 99999
    assert Attack.parse("future:3").forge(honest).key.base_version == 10
    big = Fragment(honest.key, torch.randn(100_000, generator=torch.Generator().manual_seed(7)), 100)
    noise = Attack.parse("noise:10").forge(big, torch.Generator().manual_seed(0)).tensor
    assert noise.norm() / big.tensor.norm() == pytest.approx(10.0, rel=0.02)
    assert abs(float(torch.nn.functional.cosine_similarity(noise, big.tensor, dim=0))) < 0.02
    # outer parameters (NoLoCo, gossip) go out as they are: the attack is on pseudo-gradients
    params = _fragment(Kind.PARAMS)
    assert Attack.parse("scale:10").forge(params) is params
    # the forged copy is new: the attacker's own Δ, kept for its own step, is untouched
    assert torch.equal(honest.tensor, torch.tensor([3.0, -4.0]))


def test_the_forging_transport_forges_only_what_it_sends() -> None:
    network = VirtualNetwork()
    evil = ForgingTransport(network.join("evil"), Attack.parse("scale:2"))
    victim = network.join("victim")
    evil.publish(_fragment())
    got = victim.receive(0)
    assert [f.tensor.tolist() for f in got] == [[6.0, -8.0]]
    victim.publish(Fragment(FragmentKey("run", 0, 7, "victim", Kind.DELTA), torch.ones(2), 1))
    assert [f.tensor.tolist() for f in evil.receive(0)] == [[1.0, 1.0]]


@pytest.fixture(scope="module")
def corpus():
    tokenizer = load_tokenizer(None)
    return tokenizer, load_dataset(tokenizer)


def _swarm(corpus, **overrides) -> dict:
    tokenizer, dataset = corpus
    config = dict(workers=4, inner_steps=4, rounds=6, batch_size=2, seq_len=32, eval_batches=2, inner_lr=1e-3)
    return simulate(SimConfig(**{**config, **overrides}), dataset, tokenizer.vocab_size)


@pytest.mark.slow
def test_one_attacker_hurts_the_plain_mean_and_not_the_robust_default(corpus) -> None:
    clean = _swarm(corpus)
    assert clean["attackers"] == 0 and clean["attack"] is None and clean["aggregation"] == "clip"
    robust = _swarm(corpus, attackers=1, attack="scale:1e6")
    plain = _swarm(corpus, attackers=1, attack="scale:1e6", aggregation="mean")
    assert robust["attack"] == "scale:1e+06" and robust["attackers"] == 1
    assert len(robust["worker_final_losses"]) == 3  # judged by the honest workers only
    assert robust["clipped"] > 0
    assert robust["final_loss"] == pytest.approx(clean["final_loss"], rel=0.05)
    # and the honest workers end below the same three training alone: the least a swarm owes them
    alone = _swarm(corpus, optimizer="local")["worker_final_losses"][:3]
    assert robust["final_loss"] < sum(alone) / 3, (robust["final_loss"], alone)
    # the plain mean takes the scaled Δ whole: the honest workers' model blows up (their own
    # next pseudo-gradients come out non-finite) or their loss climbs far above the clean run's
    assert (
        plain["rejected"].get("local_non_finite", 0) > 0
        or not plain["final_loss"] < clean["final_loss"] * 1.2
    )

    poisoned = _swarm(corpus, attackers=1, attack="inf", aggregation="mean")
    assert poisoned["rejected"]["non_finite"] > 0  # refused, counted, never applied
    assert math.isfinite(poisoned["final_loss"])
    assert poisoned["final_loss"] == pytest.approx(clean["final_loss"], rel=0.05)


def test_a_forged_encoded_delta_goes_out_in_the_honest_codec():
    """An attacker behind --codec sparse or 4bit sends its forgery in the same codec and values
    per block, not whole: its bytes and its judging are what a real attacker's would be."""
    network = VirtualNetwork()
    evil, peer = network.join("evil"), network.join("peer")
    forging = ForgingTransport(evil, Attack.parse("signflip"), seed=1)
    delta = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    for codec, kept in ((Codec.SPARSE, 16), (Codec.FP4, None)):
        data = encode(delta, codec, kept or 16)
        key = FragmentKey("run", 0, 0 if kept else 1, "evil")
        forging.publish_encoded(key, data, codec=codec, numel=4096, tokens=1)
        (got,) = peer.receive(0)
        assert got.kept == kept
        assert torch.allclose(got.tensor, -decode(data), atol=1e-3 * float(delta.abs().max()))
    assert evil.stats.bytes_sent < 2 * 4096  # both forgeries encoded, not 2 × 16 kB in fp32
