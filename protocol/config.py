"""The network part of a node's configuration: what the transport needs to know.

A pydantic model, so the node's configuration (``cgad.node.config``) can inherit it field for
field: every field here is also a ``cgad-node join`` flag and a YAML key, with its description as
the flag's help. Validation names the field; nothing here imports torch or hivemind, so the
commands that only talk to a running node stay light.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "AUTO_DENSE", "CODEC_NAMES", "LOOP_CODECS", "PATHS", "SPARSE_KEPT", "SPARSE_MAX_KEPT", "CodecName",
    "ExchangeOptions", "NetworkOptions", "Port", "check_multiaddr", "wire_codec",
]  # fmt: skip

SPARSE_KEPT = 16  # values the sparse codec sends per block of 256 unless told otherwise
SPARSE_MAX_KEPT = 64  # beyond a quarter of a block's values, 4bit sends them in fewer bytes
# "auto" is no encoding of its own: each round the outer loop sends "4bit" where the measured
# link carries it in time, else "sparse" with as many values per block as fit (docs/DESIGN.md §4)
CodecName = Literal["auto", "fp32", "fp16", "int8", "4bit", "2bit", "sparse"]
CODEC_NAMES: tuple[str, ...] = CodecName.__args__
# the codecs whose values the outer loop picks and whose error feedback it keeps: it hands the
# transport bytes, and judges peers' deltas against its own as sent
LOOP_CODECS = ("auto", "sparse")
AUTO_DENSE = "4bit"  # what "auto" sends when the link carries everything


def wire_codec(name: str) -> str:
    """The encoding ``name`` stands for when a tensor is encoded whole: "auto" is the member's
    sender's choice per round for pseudo-gradients, and ``AUTO_DENSE`` for outer parameters."""
    return AUTO_DENSE if name == "auto" else name


PATHS = ("grpc", "libp2p")
# an internal a volunteer has no reason to set: a key of the config file (--config), not a flag
FILE_ONLY = {"file_only": True}
# a host others dial: a name, an IPv4 or a bracketed IPv6 address (what a record's endpoint holds)
HOST = r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)$"  # (pydantic-core: $ is the end of the text)
Port = Annotated[int, Field(ge=0, le=65535)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]

# /proto/value pairs; the protocols a swarm address may use, each with how its value looks
_MULTIADDR_PARTS = {
    "ip4": r"\d{1,3}(\.\d{1,3}){3}",
    "ip6": r"[0-9a-fA-F:.]+",
    "dns": r"[A-Za-z0-9.-]+",
    "dns4": r"[A-Za-z0-9.-]+",
    "dns6": r"[A-Za-z0-9.-]+",
    "tcp": r"\d{1,5}",
    "udp": r"\d{1,5}",
    "p2p": r"[1-9A-HJ-NP-Za-km-z]{10,128}",
    "ipfs": r"[1-9A-HJ-NP-Za-km-z]{10,128}",
}
_PEER_ID = r"[1-9A-HJ-NP-Za-km-z]{10,128}"  # base58
_FLAG_PARTS = {"quic", "quic-v1", "p2p-circuit", "ws", "wss"}


def check_multiaddr(text: str) -> str:
    """``text`` if it is a multiaddr a swarm can use, else ValueError saying what is wrong."""
    if not text.startswith("/"):
        raise ValueError(f"{text!r} is not a multiaddr (it must start with '/', e.g. /ip4/1.2.3.4/tcp/31337)")
    parts = text.strip("/").split("/")
    i = 0
    while i < len(parts):
        proto = parts[i]
        if proto in _FLAG_PARTS:
            i += 1
            continue
        pattern = _MULTIADDR_PARTS.get(proto)
        if pattern is None:
            raise ValueError(f"{text!r}: unknown multiaddr protocol {proto!r}")
        if i + 1 >= len(parts) or not re.fullmatch(pattern, parts[i + 1]):
            raise ValueError(f"{text!r}: {proto} needs a valid value")
        if proto in ("tcp", "udp") and int(parts[i + 1]) > 65535:
            raise ValueError(f"{text!r}: port {parts[i + 1]} > 65535")
        if proto == "ip4" and any(int(x) > 255 for x in parts[i + 1].split(".")):
            raise ValueError(f"{text!r}: {parts[i + 1]} is not an IPv4 address")
        i += 2
    return text


class ExchangeOptions(BaseModel):
    """What a round's exchange sends and takes, the same in a daemon and in the simulator."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    codec: CodecName = Field(
        "auto",
        description="pseudo-gradient encoding on the wire (auto: 4bit, or sparse with as many values as"
        " the measured link carries each round)",
    )
    sparse_keep: int = Field(
        SPARSE_KEPT,
        ge=1,
        le=SPARSE_MAX_KEPT,
        description="--codec sparse: values sent per block of 256 (16: 1.125 bits per value; fewer for"
        " slower links); auto picks its own each round",
    )
    error_feedback: bool = Field(
        True, description="carry a lossy codec's rounding error into the fragment's next pseudo-gradient"
    )
    fan_in: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        "auto",
        description="at most this many peers' fragments taken per fragment and round (none: every peer's;"
        " auto: as many as 2 GiB holds decoded, 4 to 16: tiny 16, small 10, base and 1b 4)",
    )

    @field_validator("fan_in", mode="before")
    @classmethod
    def _none_is_every_peer(cls, value: object) -> object:
        """``--fan-in none`` (a flag is text): every peer's, as ``fan_in: null`` in a file."""
        return None if isinstance(value, str) and value.strip().lower() == "none" else value

    @model_validator(mode="after")
    def _sparse_needs_feedback(self) -> ExchangeOptions:
        if self.codec in LOOP_CODECS and not self.error_feedback:
            raise ValueError(
                f"--codec {self.codec} needs --error-feedback: without it the values a sparse round"
                " leaves out never go out"
            )
        return self


class NetworkOptions(ExchangeOptions):
    """How a peer reaches the swarm and moves fragments."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    run_id: str = Field(
        "cgad-run",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="name of the training run; peers of other runs are refused",
    )
    peers: list[str] = Field(
        default_factory=list, description="multiaddrs of peers already in the swarm (none: start a new swarm)"
    )
    host_maddrs: list[str] = Field(
        # every interface: a volunteer's peers dial its LAN or public address, never its loopback
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
        description="multiaddrs to listen on (every interface, a free port: reachable wherever the"
        " network lets peers in), e.g. /ip4/0.0.0.0/tcp/31337 for a fixed port to forward",
    )
    announce_maddrs: list[str] = Field(
        default_factory=list, description="multiaddrs others should dial (a public IP behind port forwarding)"
    )
    identity: str | None = Field(
        None, description="key file for a stable peer id across restarts (created if missing)"
    )
    swarm_key: str | None = Field(
        None,
        description="a private swarm's shared secret (a file from `cgad-node keygen --swarm-key`): peers"
        " without it can neither read nor write its records, fetch, nor ask who a member is",
    )
    allow: list[str] = Field(
        default_factory=list,
        description="peer ids of the only peers to train with (none: any): every other peer's records,"
        " fragments and snapshots are ignored and its libp2p requests refused; gRPC callers are"
        " anonymous, so a node with an allowlist serves over libp2p only",
    )
    client_mode: bool = Field(
        False,
        description="behave as behind NAT without checking (a joining node asks a peer to dial it back"
        " and chooses this itself): only dial out, a DHT client, reached through relays and re-servers",
    )
    use_relay: bool = Field(True, description="use libp2p relays to reach and be reached by NATed peers")
    grpc_host: str = Field(
        "127.0.0.1", pattern=HOST, description="host for the direct gRPC data path ('none': libp2p only)"
    )
    grpc_port: Port = Field(0, description="port for the direct gRPC data path (0: any free port)")
    grpc_tls: bool = Field(
        False,
        description="encrypt the gRPC data path, its certificate pinned by the signed records"
        " (always on with --swarm-key)",
    )
    private_endpoints: bool = Field(
        False,
        description="dial gRPC endpoints that peers' records name by host name or at private, loopback"
        " or link-local addresses (one machine, a LAN, a testbed); off: public IP addresses only, the"
        " rest over libp2p, so that no record aims this node at a service on its own network",
    )
    grpc_announce_host: str | None = Field(
        None, pattern=HOST, description="the host others dial for gRPC, when it differs from --grpc-host"
    )
    params_codec: CodecName = Field("fp32", description="outer-parameter encoding (gossip and NoLoCo mixing)")
    max_fetches: int = Field(
        3, ge=1, le=64, description="fragment fetches in flight at once (the youngest offers go first)"
    )
    keep_versions: int = Field(2, ge=1, description="own encoded versions kept per fragment to serve")
    keep_reserved: int = Field(
        8, ge=0, description="peers' fragments kept per fragment to serve onward", json_schema_extra=FILE_ONLY
    )
    history_versions: int = Field(
        64,
        ge=1,
        description="offers this many versions behind this peer's own are ignored unseen",
        json_schema_extra=FILE_ONLY,
    )
    paths: list[Literal["grpc", "libp2p"]] = Field(
        default_factory=lambda: list(PATHS),
        min_length=1,
        description="data paths to fetch over, in order of preference",
    )
    max_norm: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="refuse a fragment whose L2 norm is larger"
    )
    poll_interval: Seconds = Field(
        1.0, description="seconds between looks at the DHT (up to 4x that where rounds are long: 8 per round)"
    )
    record_ttl: float = Field(
        120.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="seconds a holdings record lives in the DHT",
        json_schema_extra=FILE_ONLY,
    )
    liveness_ttl: float = Field(
        30.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="seconds a peer counts as live after its last report",
        json_schema_extra=FILE_ONLY,
    )
    connect_timeout: Seconds = Field(2.0, description="seconds to wait for a holder to answer")
    chunk_timeout: Seconds = Field(
        15.0,
        description="longest silence within a transfer before trying another holder",
        json_schema_extra=FILE_ONLY,
    )
    fetch_timeout: Seconds = Field(300.0, description="seconds one fragment may take to arrive")
    upload_limit: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="bytes per second this peer serves at most (all streams)"
    )
    startup_timeout: Seconds = Field(60.0, description="seconds to start libp2p and the DHT")
    max_state_bytes: int = Field(1 << 36, ge=1, description="the largest state a joining peer accepts")

    @field_validator("peers", "host_maddrs", "announce_maddrs")
    @classmethod
    def _multiaddrs(cls, values: list[str]) -> list[str]:
        return [check_multiaddr(v) for v in values]

    @field_validator("params_codec")
    @classmethod
    def _params_whole(cls, value: str) -> str:
        if value in LOOP_CODECS:
            raise ValueError(
                f"{value} suits pseudo-gradients only (it may send 1 value in 64), not parameters"
            )
        return value

    @field_validator("allow")
    @classmethod
    def _peer_ids(cls, values: list[str]) -> list[str]:
        for value in values:
            if not re.fullmatch(_PEER_ID, value):
                raise ValueError(f"{value!r} is not a peer id (base58, as `cgad-node join` prints it)")
        return values

    @property
    def grpc_listen(self) -> str | None:
        """``host:port`` for the gRPC server, or None for libp2p only (also with an allowlist:
        a gRPC caller does not say who it is)."""
        return None if self.grpc_host == "none" or self.allow else f"{self.grpc_host}:{self.grpc_port}"
