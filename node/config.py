"""One configuration model, in parts: inner training, the outer step, the network, the node.

``JoinConfig`` (a daemon), ``DemoConfig`` (the demo) and the simulator's ``SimConfig``
(``cgad.node.sim.config``) are built from the same parts by inheritance, so a field is declared
once: its type, its default, its range and its description, which is also the flag's help.
``cgad.node.front.cli`` turns every field into a flag (``inner_steps`` is ``--inner-steps``); a
YAML file (``--config``) may spell keys either way.
The outer loop takes the ``OuterOptions`` part and the transport the ``NetworkOptions`` part of
the very same object: nothing is copied field by field.

Nothing here imports torch: ``cgad-node status``, which the compose health check runs every 30 s,
builds the same parser.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cgad.optim.defaults import DEFAULT_ALPHA, DEFAULT_CUTOFF
from cgad.protocol.config import CodecName, NetworkOptions, Port

__all__ = [
    "ADMIN_PORT",
    "OPTIMIZERS",
    "ConfigError",
    "DemoConfig",
    "JoinConfig",
    "NodeOptions",
    "OuterOptions",
    "TrainingOptions",
    "build_config",
    "load_yaml",
]

ADMIN_PORT = 7780  # where `cgad-node status` and `leave` look by default
DASHBOARD_PORT = 7781  # where a node's dashboard is, http://127.0.0.1:7781/, unless that port is taken

# The outer methods by name; cgad.node.member.methods holds what each one does (and checks it has one
# method per name).
OptimizerName = Literal[
    "cga", "cgad", "pa-cgad", "adam-decay", "adam", "nesterov", "delayed-nesterov", "sgd", "noloco", "local"
]
OPTIMIZERS: tuple[str, ...] = OptimizerName.__args__

Positive = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
# --eval-every auto: held-out evaluation takes at most this share of the run's time. It stops
# training (a forward pass over every held-out batch); at 26M parameters and H = 10 one evaluation
# costs about 13% of a round, so evaluating every round cost an eighth of the node's tokens. At 1%
# it comes every 13 rounds there (about a minute): a reading for the dashboard, not a cost the
# swarm should feel (at 3%, a round in four lost an eighth of its tokens).
EVAL_SHARE = 0.01


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key."""


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrainingOptions(Part):
    """The model, the data and the inner AdamW steps."""

    model: str = Field("tiny", description="preset (tiny, small, base, 1b) or a Llama config.json")
    data: str | None = Field(
        None, description=".txt/.md file, folder of them, or .jsonl with 'text' (default: bundled corpus)"
    )
    tokenizer: str | None = Field(
        None, description="a Hugging Face tokenizer directory (default: the bundled BPE)"
    )
    inner_steps: Positive = Field(50, description="H: inner steps per outer round")
    inner_lr: PositiveFloat = Field(4e-4, description="inner AdamW learning rate")
    inner_lr_scaling: Literal["sqrt", "none"] = Field(
        "sqrt",
        description="sqrt: the inner lr is multiplied by the square root of how many members' deltas the "
        "outer steps average (1 alone; Adam's square-root rule for the swarm's batch, docs/DESIGN.md); "
        "none: the inner lr as given",
    )
    warmup_steps: int = Field(0, ge=0, description="inner lr warm-up steps")
    batch_size: Positive = Field(8, description="sequences per inner step")
    seq_len: Positive = Field(128, description="tokens per sequence")
    eval_batches: Positive = Field(4, description="held-out batches per evaluation")
    seed: int = Field(0, ge=0, description="model initialisation (and the simulator's randomness)")

    @field_validator("data", "tokenizer")
    @classmethod
    def _exists(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).exists():
            raise ValueError(f"{value} does not exist")
        return value


class OuterOptions(Part):
    """The outer step: which method, its settings, and how the model is split into fragments."""

    optimizer: OptimizerName = Field("cga", description="the outer method")
    outer_lr: PositiveFloat | Literal["auto"] = Field(
        "auto",
        description="outer learning rate; auto: the method's own (1 for cga and local; 0.7 for sgd, "
        "the Nesterov family and noloco; for the Adam family 0.5 × H × inner lr)",
    )
    aggregation: Literal["clip", "mean"] = Field(
        "clip",
        description="how peers' pseudo-gradients are taken: clip (each clipped to within --clip-radius x "
        "the own update's norm of the own update, so no single peer moves the step far) or mean (as sent)",
    )
    clip_radius: PositiveFloat = Field(2.0, description="clip: the radius, in norms of the own update")
    moments: Literal["shared", "own"] = Field(
        "shared",
        description="shared: each block's inner AdamW first moment goes out beside its delta (in 4-bit "
        "blocks, where the link has room) and is averaged with the peers' fresh ones after the outer step "
        "(docs/DESIGN.md §1); own: each member keeps its own",
    )
    min_cosine: float = Field(
        0.0,
        ge=-1.0,
        le=1.0,
        description="clip: a peer's pseudo-gradient whose cosine with the own update is below this is "
        "refused (counted 'opposed'); -1 takes every direction",
    )
    alpha: float = Field(DEFAULT_ALPHA, ge=0, allow_inf_nan=False, description="CGAD: decay per round of age")
    cutoff: PositiveFloat = Field(
        DEFAULT_CUTOFF,
        description="CGAD: the gate's cutoff in rounds; also how far behind triggers a re-sync",
    )
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam family: first-moment decay")
    beta2: float = Field(0.95, ge=0, lt=1, description="Adam family: second-moment decay")
    momentum: float = Field(0.9, ge=0, lt=1, description="Nesterov family: momentum")
    cga_momentum: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="CGA: Nesterov momentum on the averaged step, scaled by the running share of peers "
        "whose deltas arrive fresh (0, the default: plain averaging; the inner lr's square-root rule "
        "already gives the step its length)",
    )
    data_score: Literal["on", "off"] = Field(
        "off",
        description="clip: on: each peer's pseudo-gradient that passed the screen is also judged on a few "
        "windows of this node's held-out text (never the evaluation's): one that raises the loss beyond "
        "chance is refused (counted 'harmful'), and each peer weighs by its record (docs/SECURITY.md)",
    )
    score_share: float = Field(
        0.1, gt=0, le=1, description="data score: the most of a block's inner compute its forward passes take"
    )
    noloco_beta: float = Field(0.5, ge=0, lt=1, description="NoLoCo: momentum β")
    restart_every: int = Field(
        0, ge=0, description="reset the outer optimizer's state every N steps (0: never)"
    )
    fragments: Positive = Field(
        1,
        description="F: the model is split into F strided fragments, synced in turn, one every H/F "
        "inner steps, each with its own version and outer-optimizer state (Streaming DiLoCo); "
        "for every method",
    )
    mixing: Literal["auto", "none", "gossip", "late"] = Field(
        "auto",
        description="gossip: also pull φ toward a random peer's, by their drift at a common version; "
        "late (cga): the same, by as much as the peers' deltas come late or not at all (1 − the running "
        "share of live peers heard on time), "
        "with φ sent only in rounds where they do and the link has room for it; auto: late with cga "
        "(and --sync exchange), none otherwise",
    )
    mixing_period: Positive = Field(1, description="outer rounds between gossip mixes")
    mixing_rate: float = Field(
        0.5, gt=0, le=1, description="gossip: the share of the drift from the partner's φ removed per mix"
    )
    consensus_every: NonNegative = Field(
        0,
        description="K: every K rounds, a blocking step that sets φ to the mean of a group's φ, beside the"
        " non-blocking exchange (factored mixing); 0: never",
    )
    consensus_group: int = Field(4, ge=2, description="consensus: members averaged together")
    consensus_timeout: PositiveFloat = Field(
        30.0,
        description="consensus: seconds a member waits for its group (matchmaking and exchange) before it"
        " goes on without it (the simulator's virtual seconds: an inner step takes --step-time)",
    )

    @model_validator(mode="before")
    @classmethod
    def _mixing_auto(cls, data: Any) -> Any:
        """--mixing auto is decided here, once, so that what a node reports is what it does."""
        if isinstance(data, dict) and data.get("mixing", "auto") == "auto":
            optimizer = data.get("optimizer", cls.model_fields["optimizer"].default)
            late = optimizer == "cga" and data.get("sync", "exchange") == "exchange"
            data = {**data, "mixing": "late" if late else "none"}
        return data

    @model_validator(mode="after")
    def _late_mixing_follows_cga(self) -> Any:
        if self.mixing == "late" and self.optimizer != "cga":
            raise ValueError(
                f"--mixing late is made and measured for cga's steps; with --optimizer {self.optimizer} "
                "use --mixing gossip"
            )
        if self.data_score == "on" and self.aggregation != "clip":
            raise ValueError("--data-score judges what the clip takes: it needs --aggregation clip")
        if self.consensus_every and self.optimizer == "local":
            raise ValueError("--consensus-every averages φ with peers; --optimizer local trains alone")
        return self


class NodeOptions(Part):
    """One daemon: its device, checkpoints, evaluation, and the ports it serves on localhost."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto picks CUDA (with bf16 autocast) when present"
    )
    checkpoint_dir: str | None = Field(
        None, description="checkpoint here, and resume from it if it holds one"
    )
    checkpoint_every: Positive = Field(5, description="outer rounds between checkpoints")
    snapshot_codec: Literal["int8", "fp16", "fp32"] = Field(
        "int8",
        description="how snapshots for joining peers carry the outer state: int8 (φ − φ₀ in 8-bit blocks,"
        " ~1 byte per parameter; the outer momentum is rebuilt by the joiner), fp16 (φ in float16 and the"
        " momentum in bfloat16, ~4 bytes per parameter), fp32 (as held)",
    )
    data_seed: int | None = Field(
        None,
        ge=0,
        description="seed of this node's training-batch order (default: drawn from its peer id); runs"
        " that are compared, a swarm and its floor, give node i the same value",
    )
    join_timeout: float = Field(
        120.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds a new node waits for the swarm to offer its state (a download under way"
        " has its own timeout, from its size)",
    )
    state_every: Positive = Field(
        1,
        description="outer rounds between snapshots of the outer state offered to joining peers (a joiner"
        " adopts the newest: an old one leaves its parameters behind the swarm's for good)",
    )
    sync: Literal["exchange", "allreduce"] = Field(
        "exchange",
        description="exchange: publish pseudo-gradients and never wait for a peer; allreduce: blocking"
        " DiLoCo, each block ends in hivemind's all-reduce of the group's pseudo-gradients (the baseline;"
        " it trusts its group)",
    )
    allreduce_group: int = Field(4, ge=2, description="allreduce: peers averaged together (the swarm's size)")
    allreduce_matchmaking: PositiveFloat = Field(
        10.0, description="allreduce: seconds a group waits for its members before it averages without them"
    )
    allreduce_timeout: PositiveFloat = Field(
        120.0, description="allreduce: seconds before a round without a group steps on the own update alone"
    )
    max_rounds: int = Field(
        0, ge=0, description="stop after this many outer rounds of this run (0: until told to leave)"
    )
    eval_every: Positive | Literal["auto"] = Field(
        "auto",
        description="outer rounds between held-out evaluations (auto: as often as evaluation takes at"
        f" most {EVAL_SHARE * 100:.0f} percent of the run's time; it stops training)",
    )
    maddrs_file: str | None = Field(None, description="write this node's multiaddrs here, one per line")
    admin_host: str = Field("127.0.0.1", description="host of the admin gRPC API")
    admin_port: Port = Field(
        ADMIN_PORT, description="admin gRPC port, where `status` and `leave` look (0: any free port)"
    )
    metrics_port: Port | None = Field(None, description="serve Prometheus metrics on this port")
    metrics_host: str = Field(
        "127.0.0.1", description="host of the Prometheus endpoint (0.0.0.0 in a container, to be scraped)"
    )
    dashboard: bool = Field(True, description="serve a live web dashboard of this node and its swarm")
    dashboard_host: str = Field(
        "127.0.0.1",
        description="host of the dashboard (anything but loopback shows the swarm to the network)",
    )
    dashboard_port: Port = Field(
        DASHBOARD_PORT, description="port of the dashboard (0, or the default when taken: any free port)"
    )
    dashboard_floor: str | None = Field(
        None,
        description='a JSON file of a node training alone, {"points": [[round, seconds, held-out loss],'
        " ...]}, drawn beside this node's loss (read as it changes; `demo` writes one)",
    )


class RoundOptions(Part):
    """The round's schedule: when an outer step is taken, a daemon's and a simulated worker's alike."""

    apply_delay: NonNegative | Literal["auto"] = Field(
        "auto",
        description="inner steps between publishing a fragment and its outer step at the latest, training"
        " on meanwhile, so that peers' fragments of the same round arrive in time (auto: as soon as every"
        " live peer's is in, and at most half a block later; 0: at once)",
    )

    @model_validator(mode="after")
    def _apply_delay_within_a_block(self) -> Any:
        block = self.inner_steps // self.fragments  # type: ignore[attr-defined]
        if self.apply_delay != "auto" and self.apply_delay >= block:
            raise ValueError(f"--apply-delay ({self.apply_delay}) must be under a block ({block} steps)")
        return self


class ScheduleChecks(Part):
    """Checks across the training and outer parts: fragments sync in turn within a round."""

    @model_validator(mode="after")
    def _fragments_divide_h(self) -> Any:
        steps, fragments = self.inner_steps, self.fragments  # type: ignore[attr-defined]
        if steps % fragments:
            raise ValueError(f"inner_steps ({steps}) must be a multiple of fragments ({fragments})")
        if self.optimizer == "pa-cgad" and fragments < 2:  # type: ignore[attr-defined]
            raise ValueError("pa-cgad is CGAD synced fragment by fragment: set fragments >= 2")
        return self


class JoinConfig(ScheduleChecks, TrainingOptions, OuterOptions, RoundOptions, NetworkOptions, NodeOptions):
    """Everything `cgad-node join` takes."""

    @model_validator(mode="after")
    def _allreduce_averages_deltas(self) -> Any:
        if self.sync == "allreduce":
            if self.fragments != 1:
                raise ValueError("--sync allreduce averages the whole model each block: set --fragments 1")
            if self.mixing != "none" or self.optimizer == "noloco" or self.consensus_every:
                raise ValueError(
                    "--sync allreduce averages pseudo-gradients: no --mixing, no noloco, no --consensus-every"
                )
        return self


class DemoConfig(ScheduleChecks, TrainingOptions, OuterOptions):
    """`cgad-node demo`: N real nodes on this machine. Its training defaults are a preset small
    enough for a laptop to show progress within minutes; any of them can be set as for join."""

    nodes: Positive = Field(3, description="nodes to start")
    minutes: PositiveFloat = Field(5.0, description="how long they train")
    out: str = Field(".", description="folder for the PNG and the nodes' logs and checkpoints")
    codec: CodecName = Field("fp16", description="pseudo-gradient encoding (preset here; join: auto)")
    inner_steps: Positive = Field(20, description="H: inner steps per outer round")
    inner_lr: PositiveFloat = Field(1e-3, description="inner AdamW learning rate")
    batch_size: Positive = Field(4, description="sequences per inner step")
    seq_len: Positive = Field(64, description="tokens per sequence")


def _field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), known, n=1)
    return f" (did you mean {close[0].replace('_', '-')!r}?)" if close else ""


def build_config(model: type[BaseModel], *layers: tuple[str, dict[str, Any]]) -> Any:
    """``model`` from its defaults overridden by each ``(source, values)`` layer in turn (a YAML
    file, then flags). A bad value raises ``ConfigError`` naming the key and where it came from."""
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for where, layer in layers:
        values.update(layer)
        source.update(dict.fromkeys(layer, where))
    try:
        return model(**values)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            key = ".".join(str(part) for part in item["loc"][:1])
            message = item["msg"].removeprefix("Value error, ")
            where = f"{source[key]}: " if source.get(key) else ""
            if item["type"] == "extra_forbidden":
                problems.append(f"{where}unknown option {key!r}{_suggest(key, _field_names(model))}")
            elif key:
                field = model.model_fields.get(key)
                extra = field.json_schema_extra if field is not None else None
                internal = isinstance(extra, dict) and extra.get("file_only")  # a key of the file alone
                flag = "" if internal else f" (--{key.replace('_', '-')})"
                problems.append(f"{where}{key}{flag}: {message}")
            else:
                problems.append(message)
        raise ConfigError("; ".join(problems)) from None


def load_yaml(path: str | os.PathLike[str], model: type[BaseModel] = JoinConfig) -> dict[str, Any]:
    """Read a config file of ``model``'s keys (dashes or underscores). Unknown keys are errors
    here; values are checked when the configuration is built (flags may still override them)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option: value")
    known = _field_names(model)
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError(f"config file {path}: unknown option {key!r}{_suggest(name, known)}")
        if isinstance(value, str) and model.model_fields[name].annotation == list[str]:
            value = [value]  # one multiaddr may stand alone
        values[name] = value
    return values
