"""The model every peer trains: a Llama decoder (transformers' `LlamaForCausalLM`) from a preset or
from a user's `config.json`, initialised deterministically from a seed. Nothing is fetched.

Input and output embeddings are tied. With the small vocabularies used here (4k-8k) the embedding
matrix is a large share of a small model (a quarter of `tiny`); tying halves that share, and with
it the bytes of every pseudo-gradient a peer sends, at no measurable cost in quality at these sizes
(Llama 3.2 1B/3B and SmolLM tie for the same reason).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Parameter counts below are at a vocabulary of 4096 (the bundled tokenizer's), embeddings tied.
PRESETS: dict[str, dict[str, int]] = {
    # ~1.9M: tests, CI and the simulator; one inner step at batch 8 x 256 is well under a second on CPU.
    "tiny": dict(
        hidden_size=160,
        intermediate_size=448,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    ),
    # ~26M
    "small": dict(
        hidden_size=512,
        intermediate_size=1280,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
    ),
    # ~149M
    "base": dict(
        hidden_size=1024,
        intermediate_size=2560,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=1024,
    ),
    # ~0.98B, Llama 3.2 1B's shape; grouped-query attention (8 key/value heads) as there.
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    ),
}

# What a user's config.json must state: LlamaConfig's defaults for these describe a 7B model, which
# nobody wants by omission.
_REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class ModelConfigError(ValueError):
    """A preset name or a user's config.json is unusable; the message says which and why."""


def model_config(preset_or_config: str | os.PathLike[str], vocab_size: int, **overrides: Any) -> LlamaConfig:
    """The LlamaConfig of a preset name or of a user's config.json (a file, or a folder holding one).

    Presets tie their embeddings; a user's file keeps its own choice (Hugging Face's default: untied).
    `vocab_size` always wins over the file's: the model must match the tokenizer it is trained
    with. `overrides` set any further LlamaConfig field (e.g. `eos_token_id`, `num_hidden_layers`).
    """
    if vocab_size < 1:
        raise ModelConfigError(f"vocab_size must be positive, got {vocab_size}")
    name = os.fspath(preset_or_config)
    if name in PRESETS:
        # Token ids default to None: LlamaConfig's 1 and 2 would name arbitrary tokens of our vocab.
        fields: dict[str, Any] = dict(
            PRESETS[name], tie_word_embeddings=True, bos_token_id=None, eos_token_id=None
        )
    else:
        fields = _read_user_config(Path(name))
    # Training never reuses a key/value cache; building one costs memory every forward.
    fields.update(vocab_size=vocab_size, use_cache=False)
    fields.update(overrides)
    _check_shapes(name, fields)
    try:
        config = LlamaConfig(**fields)
    except Exception as exc:  # newer transformers validate with their own exception types
        raise ModelConfigError(f"invalid model config {name}: {exc}") from exc
    # sdpa runs on CPU and GPU alike and, unlike flash-attn, needs no extra package.
    config._attn_implementation = "sdpa"
    return config


def build_model(
    preset_or_config: str | os.PathLike[str],
    vocab_size: int,
    seed: int,
    *,
    device: torch.device | str | None = None,
    **overrides: Any,
) -> LlamaForCausalLM:
    """A freshly initialised fp32 model; the same seed gives bit-identical weights on any device.

    Pass `device="meta"` to inspect a large preset's shapes without allocating its weights.
    """
    config = model_config(preset_or_config, vocab_size, **overrides)
    meta = device is not None and torch.device(device).type == "meta"
    # Initialise on the CPU whatever the target, so that peers on GPUs and on CPUs given the same
    # seed start from the same weights (each device type has its own random generator); fork_rng
    # keeps the caller's global random stream untouched.
    with torch.random.fork_rng(devices=[]), torch.device("meta" if meta else "cpu"):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    if device is not None and not meta:
        model = model.to(device)
    return model


# what makes two configs the same network: shapes, and what the forward pass computes with them
# (peers exchange parameters: a node whose attention has a bias, or whose rotary base differs,
# trains another function with the same tensors)
ARCHITECTURE_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
    "max_position_embeddings", "attention_bias", "mlp_bias", "hidden_act", "rms_norm_eps",
    "rope_parameters", "rope_theta", "rope_scaling",  # the first in transformers 5, the rest before
    "pretraining_tp",
)  # fmt: skip


def model_fingerprint(config: LlamaConfig) -> str:
    """The architecture of ``config`` (``ARCHITECTURE_KEYS``), hashed: peers must train the same
    network."""
    values = config.to_dict()
    architecture = {key: values.get(key) for key in ARCHITECTURE_KEYS}
    return hashlib.sha256(json.dumps(architecture, sort_keys=True).encode()).hexdigest()[:16]


def parameter_count(model_or_config: torch.nn.Module | LlamaConfig) -> int:
    """Number of distinct trainable numbers (a tied embedding counts once).

    For a config the count is computed from its shapes, so a 1B config costs nothing to measure.
    """
    if isinstance(model_or_config, torch.nn.Module):
        return sum(p.numel() for p in model_or_config.parameters())
    c = model_or_config
    head_dim = c.head_dim
    attention = c.hidden_size * head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    if c.attention_bias:
        attention += head_dim * (c.num_attention_heads + 2 * c.num_key_value_heads) + c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    if c.mlp_bias:
        mlp += 2 * c.intermediate_size + c.hidden_size
    layer = attention + mlp + 2 * c.hidden_size  # two RMSNorm weights
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return c.num_hidden_layers * layer + embeddings + c.hidden_size  # final RMSNorm


def _check_shapes(name: str, fields: dict[str, Any]) -> None:
    """The checks that make a config buildable, stated in our words before LlamaConfig's own."""
    for key in _REQUIRED_KEYS:
        if not isinstance(fields[key], int) or fields[key] < 1:
            raise ModelConfigError(
                f"invalid model config {name}: {key} must be a positive integer, got {fields[key]!r}"
            )
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    kv_heads = fields.get("num_key_value_heads") or heads
    if fields.get("head_dim") is None and hidden % heads:
        raise ModelConfigError(
            f"invalid model config {name}: hidden_size {hidden} is not divisible by "
            f"num_attention_heads {heads}"
        )
    if not isinstance(kv_heads, int) or heads % kv_heads:
        raise ModelConfigError(
            f"invalid model config {name}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}"
        )


def _read_user_config(path: Path) -> dict[str, Any]:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        known = ", ".join(PRESETS)
        raise ModelConfigError(
            f"model {os.fspath(path)!r} is neither a preset ({known}) nor an existing config.json"
        )
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"model config {path} is not valid JSON: {exc}") from exc
    if not isinstance(fields, dict):
        raise ModelConfigError(f"model config {path} must hold a JSON object")
    if fields.get("model_type", "llama") != "llama":
        raise ModelConfigError(
            f"model config {path} is a {fields['model_type']!r} model; only 'llama' is supported"
        )
    missing = [key for key in _REQUIRED_KEYS if key not in fields]
    if missing:
        raise ModelConfigError(f"model config {path} lacks {', '.join(missing)}")
    # Keys that describe the file rather than the architecture would clash with LlamaConfig's own.
    for key in ("model_type", "transformers_version", "architectures", "_name_or_path"):
        fields.pop(key, None)
    return fields
