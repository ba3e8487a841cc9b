"""A node's configuration: defaults, then a YAML file (``--config``), then command-line flags.

Every field is also a ``cgad-node join`` flag (``checkpoint_dir`` is ``--checkpoint-dir``), and a
YAML file may spell keys either way. An unknown key or a value of the wrong type is an error that
names the key, before anything starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cgad.node.outer import OPTIMIZERS
from cgad.optim import DEFAULT_ALPHA, DEFAULT_CUTOFF

__all__ = ["ADMIN_PORT", "CODECS", "DEVICES", "MIXING", "NodeConfig", "load_yaml"]

ADMIN_PORT = 7780  # where `cgad-node status` and `leave` look by default
CODECS = ("fp32", "fp16", "int8", "4bit")
DEVICES = ("auto", "cpu", "cuda")
MIXING = ("none", "gossip")


@dataclass
class NodeConfig:
    run_id: str = "cgad-run"
    peers: list[str] = field(default_factory=list)  # multiaddrs of peers already in the swarm
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity: str | None = None  # a key file: the same peer id across restarts
    client_mode: bool = False  # behind NAT: reach out only, be reached through relays
    use_relay: bool = True
    grpc_host: str = "127.0.0.1"  # direct data path; "none" to serve over libp2p only
    grpc_port: int = 0
    grpc_announce_host: str | None = None
    maddrs_file: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 5  # outer rounds between checkpoints
    data: str | None = None
    tokenizer: str | None = None
    model: str = "tiny"
    optimizer: str = "cgad"
    outer_lr: float | None = None
    alpha: float = DEFAULT_ALPHA
    cutoff: float = DEFAULT_CUTOFF
    inner_steps: int = 50
    inner_lr: float = 4e-4
    warmup_steps: int = 0
    batch_size: int = 8
    seq_len: int = 128
    fragments: int = 1
    codec: str = "4bit"
    fan_in: int = 4
    mixing: str = "none"
    mixing_period: int = 1  # outer rounds between gossip mixes
    device: str = "auto"
    max_rounds: int = 0  # 0: until told to leave
    eval_every: int = 1  # outer rounds between held-out evaluations
    eval_batches: int = 4
    admin_host: str = "127.0.0.1"
    admin_port: int = ADMIN_PORT  # 0: any free port (printed at start)
    metrics_port: int | None = None
    seed: int = 0
    dry_run: bool = False  # validate everything, print the resolved configuration, exit

    def __post_init__(self) -> None:
        choices = {"optimizer": OPTIMIZERS, "codec": CODECS, "mixing": MIXING, "device": DEVICES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("inner_steps", "fragments", "batch_size", "seq_len", "checkpoint_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.inner_steps % self.fragments:
            raise ValueError(
                f"inner_steps ({self.inner_steps}) must be a multiple of fragments ({self.fragments})"
            )
        if self.max_rounds < 0:
            raise ValueError(f"max_rounds must be >= 0 (0: no limit), got {self.max_rounds}")
        for name in ("data", "tokenizer", "identity"):
            value = getattr(self, name)
            if name != "identity" and value is not None and not Path(value).exists():
                raise ValueError(f"{name}: {value} does not exist")

    @classmethod
    def fields(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}

    @classmethod
    def build(cls, file_values: dict[str, Any], flag_values: dict[str, Any]) -> NodeConfig:
        """Defaults < the YAML file < flags given on the command line."""
        return cls(**{**file_values, **flag_values})


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a config file; keys may use dashes or underscores; unknown keys are errors."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path} must hold a mapping of option: value")
    known = NodeConfig.fields()
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in known or name == "dry_run":
            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f" (did you mean {close[0].replace('_', '-')!r}?)" if close else ""
            raise ValueError(f"config file {path}: unknown option {key!r}{hint}")
        values[name] = _coerce(name, value, known[name], path)
    return values


def _coerce(name: str, value: Any, spec: dataclasses.Field, path: Path) -> Any:
    annotation = str(spec.type)
    if value is None:
        if "None" in annotation:
            return None
        raise ValueError(f"config file {path}: {name} cannot be empty")
    if annotation.startswith("list"):
        return [str(v) for v in value] if isinstance(value, list) else [str(value)]
    if annotation.startswith("bool"):
        if not isinstance(value, bool):
            raise ValueError(f"config file {path}: {name} must be true or false, got {value!r}")
        return value
    for kind in (int, float):
        if annotation.startswith(kind.__name__):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"config file {path}: {name} must be a number, got {value!r}")
            if kind is int and value != int(value):
                raise ValueError(f"config file {path}: {name} must be a whole number, got {value!r}")
            return kind(value)
    return str(value)
