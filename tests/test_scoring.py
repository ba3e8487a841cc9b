"""The data score: each peer's Δ judged by what it does to the member's loss on held-out windows
that no evaluation window overlaps; refused when it raises the loss beyond chance, weighed by its
publisher's record otherwise, within a budget of forward passes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cgad.node.member.ledger import Counters, strided_fragments
from cgad.node.member.scoring import DataScore, ScoreOptions, judge_losses
from cgad.node.sim.config import SimConfig
from cgad.node.sim.simulate import simulate
from cgad.node.training.data import ProbeWindows, TokenDataset, load_dataset
from cgad.node.training.model import build_model
from cgad.node.training.probe import Probe
from cgad.node.training.tokenizer import load_tokenizer
from cgad.node.training.trainer import evaluate

SEQ = 32


@pytest.fixture(scope="module")
def corpus():
    tokenizer = load_tokenizer()
    return tokenizer, load_dataset(tokenizer)


def test_a_rise_beyond_chance_is_refused_and_noise_is_not():
    base = torch.linspace(4.0, 5.0, 40, dtype=torch.float64)
    noise = torch.tensor([0.01, -0.01] * 20, dtype=torch.float64)
    assert not judge_losses(base, base + noise, z=3.0, min_harm=0.002).refused
    assert not judge_losses(base, base - 0.05 + noise, z=3.0, min_harm=0.002).refused  # a gain
    harmful = judge_losses(base, base + 0.05 + noise, z=3.0, min_harm=0.002)
    assert harmful.refused and harmful.harm == pytest.approx(0.05) and harmful.t > 3
    assert not judge_losses(base, base + 0.001, z=3.0, min_harm=0.002).refused  # sure, but harmless
    blown = base.clone()
    blown[3] = math.inf
    assert judge_losses(base, blown, z=3.0, min_harm=0.002).refused  # non-finite: harm beyond doubt


def test_the_bar_rises_as_the_windows_fall():
    """The spread comes from the windows themselves: over few of them a t-value of 3 is common by
    chance (one in 29 over 4 windows), so the bar is Student's t as rare as a normal 3."""
    from cgad.node.member.scoring import critical_t, t_tail

    assert critical_t(3, 3.0) == pytest.approx(9.2189, abs=1e-3)  # scipy.stats.t.isf(norm.sf(3), 3)
    assert critical_t(7, 3.0) == pytest.approx(4.5300, abs=1e-3)
    assert critical_t(1000, 3.0) == pytest.approx(3.0, abs=0.01)
    assert t_tail(2.0, 5) == pytest.approx(0.0509697, abs=1e-6)
    base = torch.zeros(4, dtype=torch.float64)
    clear = torch.tensor([0.10, 0.12, 0.08, 0.11], dtype=torch.float64)  # t ≈ 12 over 4 windows
    assert judge_losses(base, clear, z=3.0, min_harm=0.002).refused
    noisy = torch.tensor([0.10, 0.02, 0.07, 0.01], dtype=torch.float64)  # t ≈ 2.4: chance over 4
    assert not judge_losses(base, noisy, z=3.0, min_harm=0.002).refused


def test_probe_windows_never_overlap_an_evaluation_window_and_differ_per_draw():
    tokens = np.arange(20_000, dtype=np.uint16)
    dataset = TokenDataset(tokens, "numbers", eval_fraction=0.1)
    eval_starts = {int(b[0]) for batch in dataset.eval_batches(4, 4, SEQ) for b in batch}
    windows = ProbeWindows(dataset, (4, 4), SEQ, seed=1)
    first, second = windows.draw(8), windows.draw(8)
    assert first.shape == (8, SEQ) and first.dtype == torch.int64
    assert not torch.equal(first, second)
    for window in torch.cat([first, second]):
        start = int(window[0])
        assert torch.equal(window, torch.arange(start, start + SEQ))  # contiguous text of the tail
        assert start >= dataset.split
        assert all(abs(start - e) >= SEQ for e in eval_starts), start
    # another member's windows are its own
    assert not torch.equal(ProbeWindows(dataset, (4, 4), SEQ, seed=2).draw(8), first)
    # a tail covered by evaluation windows has no room: no probe rather than an overlapping one
    crowded = TokenDataset(np.arange(2_000, dtype=np.uint16), "numbers", eval_fraction=0.1)
    assert ProbeWindows(crowded, (8, 8), SEQ, seed=1).draw(2) is None


def test_the_probe_computes_at_given_parameters_and_leaves_the_model_alone(corpus):
    tokenizer, dataset = corpus
    model = build_model("tiny", tokenizer.vocab_size, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    probe = Probe(model)
    windows = dataset.eval_batches(1, 2, SEQ)[0]
    own = probe.chunk_losses([p.detach() for p in model.parameters()], windows)
    assert own.shape == (2 * ((SEQ - 1) // 8),)
    assert float(own.mean()) == pytest.approx(evaluate(model, [windows]), abs=0.05)  # chunks cut the tail
    zeroed = probe.chunk_losses([torch.zeros_like(p) for p in model.parameters()], windows)
    assert float(zeroed.mean()) == pytest.approx(math.log(tokenizer.vocab_size), abs=1e-3)  # uniform
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


def _trained_delta(model, dataset, warm=60, steps=6, shard=0):
    """φ after ``warm`` AdamW steps on the training text (a fresh model's loss falls whichever way
    it moves), and a real pseudo-gradient from there: φ − θ after ``steps`` more."""
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = dataset.shard(0, 1).batches(4, SEQ, seed=0)
    other = dataset.shard(shard, 2).batches(4, SEQ, seed=shard)

    def train(n):
        for _ in range(n):
            batch = next(batches)
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    train(warm)
    phi = [p.detach().clone() for p in model.parameters()]
    batches = other  # the Δ from here on: trained on this member's own half of the text
    train(steps)
    delta = torch.cat([(a - b.detach()).flatten() for a, b in zip(phi, model.parameters(), strict=True)])
    return phi, delta


def _score(model, dataset, phi, budget_windows=30, seed=0):
    windows = ProbeWindows(dataset, (2, 2), SEQ, seed=seed)
    score = DataScore(Probe(model), windows.draw, budget=budget_windows * SEQ, seq_len=SEQ, seed=seed)
    score.attach(phi, strided_fragments(len(phi), 1), Counters())
    return score


def test_an_honest_delta_is_taken_and_harmful_ones_are_refused(corpus):
    tokenizer, dataset = corpus
    model = build_model("tiny", tokenizer.vocab_size, seed=0)
    phi, own = _trained_delta(model, dataset)
    _, peer = _trained_delta(build_model("tiny", tokenizer.vocab_size, seed=0), dataset, shard=1)
    score = _score(model, dataset, phi)
    unit = torch.randn(own.shape, generator=torch.Generator().manual_seed(1)) / own.numel() ** 0.5
    offered = [("honest", peer), ("reversed", -2 * peer), ("noise", 30 * unit * own.norm())]
    verdicts = score.judge(0, own, offered)
    assert verdicts[0] == (1.0, False)
    assert verdicts[1] == (0.0, True) and verdicts[2] == (0.0, True), verdicts
    assert score.counters.probed == 3 and score.counters.probe_tokens == 5 * 6 * SEQ  # φ, own, 3 peers
    # a record of harm outlives the delivery: the next Δ of that identity weighs less
    assert score.weight("reversed") < 1.0 and score.weight("honest") == 1.0
    # with no own Δ (a replay's step) nothing is probed: each weighs by its record
    replayed = score.judge(0, None, [("reversed", peer), ("new", peer)])
    assert replayed == [(score.weight("reversed"), False), (1.0, False)]
    assert score.counters.probed == 3


def test_the_budget_bounds_the_forward_passes_and_a_wide_fan_in_is_sampled():
    # windows of 65 tokens: 64 predicted, 8 chunks of 8; 16 chunks and 4 windows a pass at least
    def score(windows: int) -> DataScore:
        return DataScore(probe=None, windows=lambda n: None, budget=windows * 65, seq_len=65)  # type: ignore[arg-type]

    assert score(20).plan(3) == (3, 4)  # φ, the own and 3 peers: 5 passes of 4 windows
    assert score(20).plan(7) == (3, 4)  # 9 × 4 would be 36: 3 peers beside φ and the own
    assert score(20).plan(0) == (0, 0)
    assert score(12).plan(4) == (1, 4)  # one peer at the fewest windows
    assert score(11).plan(1) == (0, 0)  # not even that: nothing probed
    assert score(200).plan(1) == (1, 16)  # a bound, not a target: 4 × the windows the test needs
    # too small a block for one test: nothing probed (a daemon test's 8 steps of 2 × 32 tokens)
    small = DataScore.of(None, lambda n: None, inner_steps=8, fragments=1, batch_size=2, seq_len=32)  # type: ignore[arg-type]
    assert small.plan(2) == (0, 0)
    # sweep scale: 10 steps × 4 × 64 tokens, a tenth of three forwards each; 7 chunks a window
    swept = DataScore.of(None, lambda n: None, inner_steps=10, fragments=1, batch_size=4, seq_len=64)  # type: ignore[arg-type]
    assert swept.budget == 768 and swept.plan(7) == (1, 4)


def test_a_weight_follows_the_record():
    score = DataScore(probe=None, windows=lambda n: None, budget=0, seq_len=64, options=ScoreOptions(z=3.0))  # type: ignore[arg-type]
    score.records.update({"gainer": -2.0, "neutral": 0.0, "harmer": 1.5, "worst": 9.0})
    assert score.weight("gainer") == 1.0 and score.weight("neutral") == 1.0 and score.weight("new") == 1.0
    assert score.weight("harmer") == pytest.approx(0.75) and score.weight("worst") == 0.0
    score.records["slightly"] = 1.0  # an honest peer a little worse than the own now and then
    assert score.weight("slightly") == 1.0


def _sim(corpus, **overrides) -> dict:
    tokenizer, dataset = corpus
    config = dict(workers=4, inner_steps=4, rounds=6, batch_size=2, seq_len=32, eval_batches=2, inner_lr=1e-3)
    return simulate(SimConfig(**{**config, **overrides}), dataset, tokenizer.vocab_size)


@pytest.mark.slow
def test_in_the_simulator_a_scaler_is_refused_as_harmful_and_honest_peers_are_not(corpus):
    scored = dict(data_score="on", score_share=1.0)  # these blocks of 4 × 2 × 32 tokens need it all
    honest = _sim(corpus, **scored)
    assert honest["probed"] >= 40 and honest["probe_tokens"] > 0
    assert honest["rejected"].get("harmful", 0) <= 1, honest["rejected"]  # chance, at z = 3
    assert honest["final_loss"] == pytest.approx(_sim(corpus)["final_loss"], abs=0.01)
    attacked = _sim(corpus, attackers=1, attack="scale:1e6", **scored)
    unscored = _sim(corpus, attackers=1, attack="scale:1e6")
    # the scaler's Δ, clipped to two own norms, is twice an honest step: taken whole without the
    # score; with it refused as harmful now and then and weighed by its record the rest of the
    # time, and the honest workers end lower
    assert attacked["rejected"].get("harmful", 0) >= 1, attacked["rejected"]
    assert attacked["final_loss"] < unscored["final_loss"], (attacked["final_loss"], unscored["final_loss"])
