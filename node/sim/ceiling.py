"""The two ends a swarm is judged between, run on the simulator's data and evaluation.

- **The ceiling**: the same W machines synchronised at every inner step, i.e. one model trained
  by data-parallel AdamW on the W members' batches at once (batch W × b), each member's batch
  drawn from its own shard as a swarm member's is (``worker_batches``): what a datacenter would
  do with the same machines and the same data.
- **One member alone for longer**: a single model on the whole training split (a volunteer alone
  has all of its own data) for as many inner steps as asked, evaluated every H steps: the curve a
  swarm's loss is read against to say how many members it is worth.

Both evaluate on the simulator's held-out batches (``TokenDataset.eval_batches`` at the members'
batch size), after every H inner steps, so their curves line up with a swarm's by round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from cgad.node.sim.config import SimConfig
from cgad.node.sim.simulate import worker_batches
from cgad.node.training.data import TokenDataset
from cgad.node.training.model import build_model
from cgad.node.training.trainer import InnerTrainer, evaluate

__all__ = ["alone_curve", "ceiling_curve"]


class _Concatenated(Iterator[torch.Tensor]):
    """One batch of each iterator, stacked: the W members' batches of one synchronous step."""

    def __init__(self, iterators: list[Iterator[torch.Tensor]]) -> None:
        self.iterators = iterators

    def __next__(self) -> torch.Tensor:
        return torch.cat([next(it) for it in self.iterators])


def _curve(
    c: SimConfig,
    dataset: TokenDataset,
    vocab_size: int,
    batches: Iterator[torch.Tensor],
    rounds: int,
    lr: float,
    progress: Callable[[int], None] | None,
) -> dict:
    torch.manual_seed(c.seed)
    model = build_model(c.model, vocab_size, seed=c.seed)  # the swarm's initial weights
    eval_batches = dataset.eval_batches(c.eval_batches, c.batch_size, c.seq_len)
    initial = evaluate(model, eval_batches)
    trainer = InnerTrainer(model, batches, lr=lr, warmup_steps=c.warmup_steps)
    losses = []
    for _ in range(rounds):
        for _ in range(c.inner_steps):
            trainer.step()
        if progress:
            progress(c.inner_steps)
        losses.append(evaluate(model, eval_batches))
    return {"initial_loss": initial, "losses": losses, "final_loss": losses[-1], "inner_lr": lr}


def ceiling_curve(
    c: SimConfig,
    dataset: TokenDataset,
    vocab_size: int,
    lr: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Data-parallel training of ``c.workers`` members for ``c.rounds`` × H inner steps.

    Args:
        c: the swarm's configuration (workers, model, data split, batch, H, rounds, seed).
        dataset: its corpus.
        vocab_size: the tokenizer's.
        lr: the inner lr (None: ``c.inner_lr``, the members' own).
        progress: told of inner steps as they are done.
    """
    batches = _Concatenated([worker_batches(dataset, c, w) for w in range(c.workers)])
    return _curve(c, dataset, vocab_size, batches, c.rounds, lr or c.inner_lr, progress)


def alone_curve(
    c: SimConfig,
    dataset: TokenDataset,
    vocab_size: int,
    rounds: int,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """One member on the whole training split for ``rounds`` × H inner steps at ``c.inner_lr``.

    Args:
        c: the swarm's configuration (model, batch, H, seed).
        dataset: its corpus.
        vocab_size: the tokenizer's.
        rounds: how many H-step blocks to train.
        progress: told of inner steps as they are done.
    """
    batches = dataset.shard(0, 1).batches(c.batch_size, c.seq_len, seed=c.seed * 1_000_003)
    return _curve(c, dataset, vocab_size, batches, rounds, c.inner_lr, progress)
