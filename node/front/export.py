"""`cgad-node export`: a checkpoint's outer parameters as a Hugging Face model directory."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cgad.node.daemon.checkpoint import TOKENIZER_DIR, load_checkpoint
from cgad.node.training.tokenizer import load_hf_tokenizer

__all__ = ["export_checkpoint"]


def export_checkpoint(checkpoint_dir: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write config, weights (the swarm's outer parameters φ) and tokenizer to ``out``, loadable
    with ``AutoModelForCausalLM.from_pretrained(out)`` and ``AutoTokenizer.from_pretrained(out)``."""
    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    state = load_checkpoint(checkpoint_dir)
    if state is None:
        raise ValueError(f"{checkpoint_dir} holds no cgad-node checkpoint")
    config = LlamaConfig.from_dict(state["model_config"])
    model = LlamaForCausalLM(config)
    params = list(model.parameters())
    phi = state["outer"]["phi"]
    if len(params) != len(phi):
        raise ValueError(f"checkpoint has {len(phi)} parameter tensors, the model {len(params)}")
    with torch.no_grad():
        for p, q in zip(params, phi, strict=True):
            p.copy_(q)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    load_hf_tokenizer(checkpoint_dir / TOKENIZER_DIR).save_pretrained(out)
    return out
