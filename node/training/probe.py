"""The held-out probe: a model's loss at parameters other than its own, on a few windows.

A member judges a peer's pseudo-gradient by what it does to its own loss (``member/scoring.py``):
the loss at φ and at φ − Δ on the same windows, per chunk of tokens, so that the difference comes
with its spread. The model's own parameters (θ, mid-block) are never touched: the forward pass
takes the given tensors in their place (``torch.func.functional_call``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call

CHUNK = 8  # predicted tokens per chunk: the unit whose losses give a difference its spread

__all__ = ["CHUNK", "Probe", "chunks_per_window"]


def chunks_per_window(seq_len: int) -> int:
    """The chunks ``chunk_losses`` yields per window of ``seq_len`` tokens (``seq_len`` − 1 are
    predicted; a window shorter than a chunk is one)."""
    return max((seq_len - 1) // CHUNK, 1)


class Probe:
    """Per-chunk losses of ``model`` at given parameters.

    Args:
        model: the member's model (a causal LM taking ``input_ids``, returning ``logits``).
        device: where the model computes; parameters given on another device are copied there.
        autocast_dtype: the trainer's autocast dtype (None: full precision).
        batch_windows: windows per forward pass (the trainer's batch: what its memory holds).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device | str = "cpu",
        autocast_dtype: torch.dtype | None = None,
        batch_windows: int = 8,
    ) -> None:
        self.model = model
        self.batch_windows = max(1, batch_windows)
        self.names = [name for name, _ in model.named_parameters()]
        self.device = torch.device(device)
        self.autocast_dtype = autocast_dtype

    @torch.no_grad()
    def chunk_losses(self, params: Sequence[Tensor], windows: Tensor) -> Tensor:
        """The mean next-token loss of each chunk of ``CHUNK`` predicted tokens of each window,
        flat (float64; +inf where a chunk's loss is not finite).

        Args:
            params: one tensor per model parameter, in ``named_parameters`` order (copied to the
                model's device where they are elsewhere: the caller moves them once).
            windows: [n, seq_len] token ids.
        """
        if len(params) != len(self.names):
            raise ValueError(f"{len(params)} tensors for {len(self.names)} parameters")
        values = {name: p.to(self.device) for name, p in zip(self.names, params, strict=True)}
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype
            else contextlib.nullcontext()
        )
        was_training = self.model.training
        self.model.eval()
        chunks = []
        try:
            for part in windows.split(self.batch_windows):  # a forward at most a batch of windows
                input_ids = part.to(self.device)
                with autocast:
                    logits = functional_call(self.model, values, (), {"input_ids": input_ids}).logits
                predicted = logits[:, :-1].float().reshape(-1, logits.shape[-1])
                losses = F.cross_entropy(predicted, input_ids[:, 1:].reshape(-1), reduction="none")
                losses = losses.reshape(input_ids.shape[0], -1)
                count, per = chunks_per_window(part.shape[1]), min(CHUNK, losses.shape[1])
                chunks.append(losses[:, : count * per].reshape(-1, count, per).mean(dim=2).flatten())
        finally:
            self.model.train(was_training)
        flat = torch.cat(chunks).double().cpu()
        return torch.where(torch.isfinite(flat), flat, torch.full_like(flat, float("inf")))
