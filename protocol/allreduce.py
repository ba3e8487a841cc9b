"""Blocking DiLoCo's exchange: each block ends in an all-reduce of the peers' pseudo-gradients.

This is the baseline the non-blocking exchange is measured against (OpenDiLoCo's design:
hivemind's ``DecentralizedAverager`` averages fp16 pseudo-gradients within a matched group, and
every peer takes the same outer step on the group's mean), and a mode volunteers can choose
(``cgad-node join --sync allreduce``). Each publish blocks until the group's all-reduce is done or
has failed: the slowest peer in the group sets everyone's pace.

The averager runs on a hivemind DHT of its own: its matchmaking records are not this run's signed
schema, which the fragment DHT refuses. A node states that DHT's addresses when asked who it is
(``Describe``), and a joiner bootstraps from those of the peers at ``--peers``. The averager trusts
its group: no allowlist or clipping applies inside it (the outer step still clips the group's
mean around the own update with ``--aggregation clip``). In a private swarm the averager's DHT
takes the swarm key (``SwarmAuthorizer``: every DHT request and answer carries a ticket), so an
averager without it can neither join the DHT nor find a group's records there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionBase, Float16Compression, NoCompression
from hivemind.utils import get_dht_time

from cgad.protocol.auth import SwarmAuthorizer, SwarmKey
from cgad.protocol.codec import Codec, all_finite, decode
from cgad.protocol.config import check_multiaddr
from cgad.protocol.records import Identity
from cgad.protocol.transport import Fragment, FragmentKey, Inbox, Kind, Transport, TransportStats

__all__ = [
    "GROUP_PUBLISHER",
    "AllReduceExchange",
    "AveragerSettings",
    "GroupAverager",
    "averager_bootstrap",
    "listen_anywhere",
]

logger = logging.getLogger(__name__)

GROUP_PUBLISHER = "all-reduce"  # who the group's share of the mean is from, in the counters
MAX_BOOTSTRAP = 16  # averager addresses taken from one peer's description (its claim)
# hivemind's DHT and averager are processes forked from this one, which has threads (gRPC, the
# transport's loop, torch's); a fork taken while another thread holds a lock can leave the child
# hung before it says it is ready, and hivemind's own start waits without limit. A child starts in
# a few seconds; the pair not ready in this long is killed (each with its p2pd) and started again.
# A child killed while it held one of hivemind's cross-process locks (MPFuture's) would leave the
# next start blocked there, outside this deadline: not seen, and not guarded against.
START_TIMEOUT = 60.0
START_TRIES = 3


@dataclass(frozen=True)
class AveragerSettings:
    """What an averager of either kind is started with: its DHT's key prefix, the group it
    forms (``group_size`` peers at most), the matchmaking window (``matchmaking_time`` seconds),
    how long a step may take (``timeout``), and a private swarm's key for its DHT (None: public).
    ``identity``: the libp2p identity its DHT runs under (the node's own, so that a group's members
    are known by the node's peer ids; None: a fresh one); ``allowed``: with an identity, the peer
    ids whose groups a ``GroupAverager`` takes (``--allow``; None: any)."""

    prefix: str
    group_size: int
    matchmaking_time: float
    timeout: float
    swarm_key: SwarmKey | None = None
    identity: Identity | None = field(default=None, repr=False)
    allowed: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"a group of {self.group_size}: at least 2")


class AllReduceExchange(Transport):
    """``Transport`` for one fragment's pseudo-gradients, exchanged by a blocking all-reduce.

    ``publish`` runs the all-reduce of a group of ``group_size`` peers (matchmaking retries every
    ``matchmaking_time`` seconds until the group is whole, and gives up after ``timeout``); the
    group's mean of n members then arrives as n − 1 deliveries of the other members' mean, so the
    token-weighted mean the outer step takes over them and the own Δ is the group's mean.
    ``peers`` answers who is alive (the fragment transport's progress records). ``start`` joins
    the averager's DHT."""

    def __init__(self, peers: Transport, numel: int, settings: AveragerSettings) -> None:
        self.settings = settings
        self.peer_id = peers.peer_id
        self.stats = TransportStats()
        self.fan_in = settings.group_size - 1  # a group brings the other members' deliveries, no more
        self._peers = peers
        self._numel = numel
        self._inbox = Inbox()
        self.dht: hivemind.DHT | None = None
        self.averager: DecentralizedAverager | None = None
        self.groups: Counter[int] = Counter()  # sizes of the groups each publish averaged in; 1: none

    def start(self, initial_peers: Sequence[str], host_maddrs: Sequence[str]) -> None:
        # the whole group or none: smaller groups that form first stay out of phase with each
        # other for good (measured on 10 Mbit: four nodes averaged in two fixed pairs)
        self.dht, self.averager = _start_averager(
            initial_peers, host_maddrs, self._numel, self.settings, self.settings.group_size
        )

    def maddrs(self) -> list[str]:
        """Where the averager's DHT can be reached: what this node states in ``Describe``."""
        return [str(m) for m in self.dht.get_visible_maddrs()] if self.dht is not None else []

    def publish(self, fragment: Fragment) -> None:
        """All-reduce the own Δ with the group (blocking); on success the others' mean waits in
        ``receive``. A failed or lone round leaves the outer step with the own Δ alone."""
        if self.averager is None:
            raise RuntimeError("AllReduceExchange.publish before start")
        own = fragment.tensor.detach().float()
        mean, members, _ = _average_once(
            self.averager, own, self.settings.timeout, "this round steps on the own update alone"
        )
        self.groups[members] += 1
        self.stats.published += 1
        if mean is None:
            self.stats.skipped["no_group"] += 1
            return
        if not all_finite(mean):
            self.stats.rejected["non_finite"] += 1
            return
        others = (mean * members - own) / (members - 1)
        for member in range(1, members):
            key = replace(fragment.key, publisher=f"{GROUP_PUBLISHER}/{member}")
            self._inbox.put(Fragment(key, others, fragment.tokens))
        self.stats.received += members - 1

    def publish_encoded(
        self, key: FragmentKey, data: bytes, *, codec: Codec, numel: int, tokens: int
    ) -> None:
        """The all-reduce sends fp16 through the averager: encoded bytes are decoded first."""
        self.publish(Fragment(key, decode(data), tokens))

    def receive(self, index: int, kind: Kind = Kind.DELTA) -> list[Fragment]:
        return self._inbox.pop(index, kind)

    def live_peers(self) -> list[str]:
        return self._peers.live_peers()

    def close(self) -> None:
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None


class GroupAverager:
    """The mean of one flat tensor over a group of peers (hivemind's all-reduce, fp32 on the wire:
    φ itself is averaged, and fp16's rounding would move every weight by up to 1/2048 of itself at
    each step): factored mixing's blocking step averages φ with it. ``average`` blocks until a group
    of up to ``group_size`` peers (at least two; a full one at once, else once its window ended)
    averaged, or its search for a group ran out, or the formed group's all-reduce took longer than
    ``timeout`` seconds; with no group the caller goes on alone. ``matchmaking_time``: the default
    window, and each further one of a peer that found nobody (hivemind's). ``start`` joins the
    averager's DHT, as ``AllReduceExchange.start``."""

    def __init__(self, numel: int, settings: AveragerSettings) -> None:
        self.settings = settings
        self._numel = numel
        self.timeout = settings.timeout
        self.dht: hivemind.DHT | None = None
        self.averager: DecentralizedAverager | None = None
        self.groups: Counter[int] = Counter()  # sizes of the groups each step averaged in; 1: none
        self.outsiders = 0  # groups whose mean was not taken: members outside ``settings.allowed``
        self.finished_at: float | None = None  # time.monotonic() when the last ``average`` returned

    def start(self, initial_peers: Sequence[str], host_maddrs: Sequence[str]) -> None:
        # whoever matched within the window averages (at least two): a member never waits on
        # one that is slow or gone for longer than the window
        self.dht, self.averager = _start_averager(
            initial_peers,
            host_maddrs,
            self._numel,
            self.settings,
            2,
            NoCompression(),
            allreduce_timeout=self.timeout,
        )

    def maddrs(self) -> list[str]:
        """Where the averager's DHT can be reached: what this node states in ``Describe``."""
        return [str(m) for m in self.dht.get_visible_maddrs()] if self.dht is not None else []

    def average(
        self, tensor: torch.Tensor, window: float | None = None, timeout: float | None = None
    ) -> tuple[torch.Tensor, int] | None:
        """The group's mean of ``tensor`` and how many peers it is over (this one included), or
        None when no group formed in time or its mean is not finite (blocking).

        Args:
            tensor: what this peer offers.
            window: seconds a new group gathers members unless it fills first (None: the
                constructor's ``matchmaking_time``).
            timeout: seconds this peer looks for a group before it goes on without one (None:
                the constructor's ``timeout``).
        """
        if self.averager is None:
            raise RuntimeError("GroupAverager.average before start")
        window = window if window is not None else self.settings.matchmaking_time
        timeout = timeout if timeout is not None else self.timeout
        if not 0 < window < timeout:
            raise ValueError(f"a matchmaking window of {window} s within a timeout of {timeout} s")
        mean, members, peers = _average_once(
            self.averager, tensor.detach().float().flatten(), timeout, "going on without it",
            scheduled_time=get_dht_time() + window,
        )  # fmt: skip
        self.finished_at = time.monotonic()
        allowed = self.settings.allowed
        if mean is not None and allowed is not None and not peers <= allowed | {self.peer_id}:
            # with an allowlist, a group with anyone outside it: its mean is not taken (its all-
            # reduce could not keep them out, the result can be)
            logger.warning("a consensus group with %d peers outside --allow; going on without it",
                           len(peers - allowed - {self.peer_id}))  # fmt: skip
            self.outsiders += 1
            return None
        self.groups[members] += 1
        return (mean, members) if mean is not None and all_finite(mean) else None

    @property
    def peer_id(self) -> str | None:
        """The averager's own peer id (the node's, when started with its identity)."""
        return self.dht.peer_id.to_base58() if self.dht is not None else None

    def close(self) -> None:
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None


def _average_once(
    averager: DecentralizedAverager,
    tensor: torch.Tensor,
    timeout: float,
    otherwise: str,
    scheduled_time: float | None = None,
) -> tuple[torch.Tensor | None, int, set[str]]:
    """One all-reduce of ``tensor`` (flat, float32) with whatever group forms: the group's mean (a
    copy), its size and its members' peer ids, or None, 1 and none when no group of two or more
    averaged (``otherwise`` says
    what the caller does then, in the warning of a failed step). ``scheduled_time`` (DHT time):
    when a group short of members starts (None: the averager's matchmaking time from now)."""
    with averager.get_tensors() as tensors:
        tensors[0].copy_(tensor)
    try:
        gathered = averager.step(timeout=timeout, scheduled_time=scheduled_time)
    except Exception as exc:  # hivemind raises whatever a failed group provokes
        logger.warning("all-reduce failed: %r; %s", exc, otherwise)
        gathered = None
    members = len(gathered) if gathered else 1
    if members < 2:
        return None, 1, set()
    with averager.get_tensors() as tensors:
        return tensors[0].clone(), members, {peer.to_base58() for peer in gathered}


def _start_averager(
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    numel: int,
    settings: AveragerSettings,
    min_group_size: int,
    compression: CompressionBase | None = None,
    allreduce_timeout: float | None = None,
) -> tuple[hivemind.DHT, DecentralizedAverager]:
    """A hivemind DHT of the averager's own and an averager of one flat tensor on it (fp16 on the
    wire unless ``compression`` says otherwise; a formed group's all-reduce limited to
    ``allreduce_timeout`` seconds, none: no limit); the pair started again whole when either is not
    ready in time (an averager may hang on a DHT that stopped answering)."""
    error: NotReady | None = None
    options = {"authorizer": SwarmAuthorizer(settings.swarm_key)} if settings.swarm_key else {}
    for _ in range(START_TRIES):
        identity = settings.identity.key_file(None) if settings.identity else contextlib.nullcontext(None)
        with identity as identity_path:  # read by p2pd as it starts
            dht = start_child(
                lambda: hivemind.DHT(
                    initial_peers=list(initial_peers),
                    host_maddrs=list(host_maddrs),
                    start=False,
                    **options,
                    # the node's own p2pd holds this identity too: hivemind's check that it is free
                    # (dialling it through the bootstrap peers) would find the node and refuse
                    **({"identity_path": identity_path, "check_if_identity_free": False}
                       if identity_path else {}),
                ),
                "DHT",
            )
        try:
            averager = start_child(
                lambda dht=dht: DecentralizedAverager(
                    [torch.zeros(numel)],
                    dht=dht,
                    prefix=settings.prefix,
                    target_group_size=settings.group_size,
                    min_group_size=min_group_size,
                    min_matchmaking_time=settings.matchmaking_time,
                    request_timeout=min(3.0, settings.matchmaking_time / 2),  # below the window: hivemind's
                    compression=compression or Float16Compression(),
                    allreduce_timeout=allreduce_timeout,
                    start=False,
                ),
                "averager",
                tries=1,
            )
            return dht, averager
        except NotReady as not_ready:
            _stop(dht)
            error = not_ready
        except BaseException:
            _stop(dht)
            raise
    raise NotReady(f"{error} ({START_TRIES} times, with a new DHT each time)") from error


def _stop(dht: hivemind.DHT) -> None:
    # listed first: a wedged DHT is terminated by its shutdown, and its p2pd, left behind, is
    # then no longer under it
    tree = _tree(dht.pid) if dht.pid is not None else ([], [])
    dht.shutdown()
    _kill_listed(*tree)


class NotReady(RuntimeError):
    """A hivemind process was not ready within its deadline, in every try."""


Child = TypeVar("Child")


def start_child(
    make: Callable[[], Child], what: str, timeout: float = START_TIMEOUT, tries: int = START_TRIES
) -> Child:
    """A hivemind process (``make()``, not started) started and ready; one that is not ready within
    ``timeout`` seconds is killed with its own children (its p2pd) and made again, up to ``tries``
    times, then ``NotReady``. An error the child reports (a TimeoutError of its own included) is
    raised as it is.

    Args:
        make: builds the process object (``start=False``); it has ``run_in_background``.
        what: its name in the warnings.
        timeout: seconds to wait for it to be ready.
        tries: starts before giving up.
    """
    for attempt in range(1, tries + 1):
        child = make()
        began = time.monotonic()
        try:
            child.run_in_background(await_ready=True, timeout=timeout)  # type: ignore[attr-defined]
            return child
        except TimeoutError:
            if time.monotonic() - began < timeout:
                raise  # the child's own error, not the deadline
            kill_tree(child.pid)  # type: ignore[attr-defined]
            child.join(5.0)  # type: ignore[attr-defined]
            logger.warning("the all-reduce's %s process was not ready within %.0f s (start %d of %d): killed",
                           what, timeout, attempt, tries)  # fmt: skip
    raise NotReady(f"the all-reduce's {what} process was not ready within {timeout:.0f} s, {tries} times")


def kill_tree(pid: int | None) -> None:
    """SIGKILL a process and every process under it (Linux's /proc; elsewhere the process only),
    and remove the unix sockets a killed p2pd listened on (it cannot remove them itself)."""
    if pid is not None:
        _kill_listed(*_tree(pid))


def _tree(pid: int) -> tuple[list[int], list[Path]]:
    """``pid``, the processes under it, and the unix sockets p2pds among them listen on."""
    tree = [*_descendants(pid), pid]
    return tree, [path for each in tree for path in _listening_sockets(each)]


def _kill_listed(pids: list[int], sockets: list[Path]) -> None:
    for each in pids:
        _kill(each)
    for path in sockets:
        path.unlink(missing_ok=True)  # a socket file, checked while its owner was alive


def _listening_sockets(pid: int) -> list[Path]:
    """The unix socket a p2pd was told to listen on (``-listen=/unix/PATH``), from its command line."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []
    prefix = b"-listen=/unix/"
    paths = [
        Path("/" + a[len(prefix) :].decode(errors="replace").lstrip("/"))
        for a in args
        if a.startswith(prefix)
    ]
    return [path for path in paths if path.is_socket()]


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid``, from each process's parent in /proc/*/stat (no kernel option
    needed, unlike /proc/PID/task/*/children); none where /proc is absent."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
        except (OSError, IndexError):
            continue  # gone meanwhile
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = parents.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def averager_bootstrap(description: dict[str, object]) -> list[str]:
    """The averager DHT addresses a peer states in its description, checked: a peer's claim."""
    stated = description.get("averager")
    if not isinstance(stated, list):
        return []
    return [addr for addr in stated[:MAX_BOOTSTRAP] if _usable(addr)]


def _usable(addr: object) -> bool:
    if not isinstance(addr, str) or len(addr) >= 512:
        return False
    try:
        check_multiaddr(addr)
    except ValueError:
        return False
    return True


def listen_anywhere(host_maddrs: Sequence[str]) -> list[str]:
    """The node's listening addresses with the port left to the system: the averager's DHT
    listens on the same interfaces, beside the fragment DHT."""
    return [re.sub(r"/(tcp|udp)/\d+", r"/\1/0", m.split("/p2p/")[0]) for m in host_maddrs]
