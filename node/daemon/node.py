"""One peer of a real swarm: `cgad-node join`.

The node trains its local model with inner AdamW steps and, at each fragment's turn, runs the
``OuterLoop`` over the network transport: publish the fragment's pseudo-gradient, apply whatever
peers' fragments have arrived, weighted by their age, and continue from the new outer parameters.
It never waits for a peer. Around that loop: it starts from its checkpoint if it has one, else
from a live peer's state (refusing a swarm whose run id, model or tokenizer differ, and saying
which); it re-syncs when it has fallen more than the cutoff behind; it checkpoints atomically; it
answers the admin API (status, leave, health) and serves Prometheus metrics; on `leave`, SIGINT or
SIGTERM it finishes the step, publishes, checkpoints and exits 0.
"""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from cgad.node.config import JoinConfig
from cgad.node.daemon.admin import AdminServer
from cgad.node.daemon.allocator import give_back_freed_memory
from cgad.node.daemon.checkpoint import TOKENIZER_DIR, load_checkpoint, save_checkpoint
from cgad.node.daemon.consensus import consensus_averager, consensus_status, join_group, start_averaging
from cgad.node.daemon.dashboard import DashboardServer, floor_points
from cgad.node.daemon.joining import StateSync, check_compatible
from cgad.node.daemon.metrics import Metrics
from cgad.node.daemon.monitor import swarm_rows
from cgad.node.daemon.snapshots import SnapshotPublisher
from cgad.node.daemon.stall import StallMeter
from cgad.node.daemon.status import cpu_seconds_by_thread, exchange_status, status_line
from cgad.node.member.engine import Member, MemberHooks, Schedule
from cgad.node.member.ledger import layout_numels
from cgad.node.member.methods import UsableVersions, method
from cgad.node.member.outer import OuterLoop, inner_lr_scale
from cgad.node.member.outer_state import Phi0
from cgad.node.member.scoring import data_score
from cgad.node.training.data import load_dataset
from cgad.node.training.model import build_model, model_fingerprint
from cgad.node.training.tokenizer import load_tokenizer
from cgad.node.training.trainer import EvalSchedule, InnerTrainer, evaluate
from cgad.protocol.allreduce import AllReduceExchange, AveragerSettings
from cgad.protocol.event_thread import side_worker
from cgad.protocol.files import atomic_write
from cgad.protocol.network import NetworkTransport
from cgad.protocol.records import PROTOCOL_VERSION, Identity, run_prefix

__all__ = ["Node"]

logger = logging.getLogger(__name__)

LINGER_SECONDS = 3.0  # after the last publish, so peers (polling every second) can fetch it
TIMELINE_POINTS = 20_000  # rounds the dashboard can draw


# the outer loop's plain counters in status ("unheard": own deltas not encoded, nobody could fetch them)
def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    return torch.device(name)


class Node(MemberHooks):
    def __init__(self, config: JoinConfig) -> None:
        self.config = c = config
        give_back_freed_memory()  # before the model and its buffers are allocated
        self.device = _device(c.device)
        self.autocast = torch.bfloat16 if self.device.type == "cuda" else None
        self.tokenizer = load_tokenizer(c.tokenizer)
        self.dataset = load_dataset(self.tokenizer, c.data)
        self.model = build_model(c.model, self.tokenizer.vocab_size, seed=c.seed).to(self.device)
        phi0 = Phi0(c.seed, self.model.parameters())  # what int8 snapshots are the difference to
        self.swarm = {
            "run_id": c.run_id,
            "model": model_fingerprint(self.model.config),
            "tokenizer": self.tokenizer.fingerprint,
            "optimizer": method(c.optimizer).family,
            "fragments": c.fragments,
            "sync": c.sync,
            "consensus_every": c.consensus_every,  # a member with no group would wait out every step
            "protocol": PROTOCOL_VERSION,  # checked by a joiner before the rest (Describe)
        }
        self.identity = Identity.load_or_create(c.identity) if c.identity else Identity()
        self.peer_id = self.identity.peer_id
        # no coordinator assigns shards: each peer draws from the whole split with a stream of its own
        # id (or --data-seed, so that compared runs, and a swarm with its floor, see one data order)
        digest = hashlib.sha256(self.peer_id.encode()).digest()[:4]
        seed = c.data_seed if c.data_seed is not None else int.from_bytes(digest, "little")
        self.batches = self.dataset.shard(0, 1).batches(c.batch_size, c.seq_len, seed=seed)
        self.trainer = InnerTrainer(
            self.model,
            self.batches,
            lr=c.inner_lr,
            warmup_steps=c.warmup_steps,
            device=self.device,
            autocast_dtype=self.autocast,
        )
        self.eval_batches = self.dataset.eval_batches(c.eval_batches, c.batch_size, c.seq_len)
        params = list(self.model.parameters())
        numels = layout_numels(params, c.fragments)
        # the transport and the outer loop read their own parts of the one configuration; a snapshot
        # holds φ and at most two more model-sized fp32 tensors and a little metadata: no more
        state_bound = 16 * sum(p.numel() for p in params) + (1 << 20)
        usable = UsableVersions.of(c)  # what the outer step can use is all the transport fetches
        self.transport = NetworkTransport(
            c.model_copy(update={"max_state_bytes": min(c.max_state_bytes, state_bound)}),
            num_fragments=c.fragments,
            fragment_numel=dict(enumerate(numels)),
            identity=self.identity,
            stale_after=usable.stale_after,
            max_ahead=usable.max_ahead,
            kinds=usable.kinds,
        )
        self.transport.describe_as(json.dumps(self.swarm))
        try:  # from here on, a failure must not leave the transport's sockets and p2pd behind
            # --sync allreduce: the outer step takes the group's all-reduced mean instead of the
            # fragments the transport delivers (the transport still carries states and progress)
            self.exchange = (
                AllReduceExchange(
                    self.transport,
                    numels[0],
                    AveragerSettings(
                        f"{run_prefix(c.run_id)}_allreduce",
                        c.allreduce_group,
                        c.allreduce_matchmaking,
                        c.allreduce_timeout,
                        self.transport.swarm_key,
                    ),
                )
                if c.sync == "allreduce"
                else None
            )
            self.groups = consensus_averager(c, sum(numels), self.transport.swarm_key, self.identity)
            self.loop = OuterLoop(
                params,
                c,
                self.exchange or self.transport,
                c.run_id,
                seed=seed,
                # the all-reduce sends fp16 through hivemind's averager: no codec to pick there
                codec=c.codec if c.sync == "exchange" else None,
                sparse_keep=c.sparse_keep, params_codec=c.params_codec,
                link_budget=self.transport.round_budget, error_feedback=c.error_feedback,
                encoder=side_worker("cgad-encode"),
                heard=bool(c.peers),  # the first node of a swarm has nobody to publish for yet
                score=data_score(c, self.model, self.dataset, None, self.device, self.autocast),
            )
            self.trainer.lr_scale = inner_lr_scale(c, self.loop)  # the swarm's √N (--inner-lr-scaling)
            if self.exchange is None:  # an all-reduce round averages one tensor: Δ
                self.loop.moments.attach(self.trainer.optimizer)  # its first moment goes beside Δ
            self.started_at = time.time()
            self._round_mark = (time.monotonic(), 0)  # when the round began, at how many tokens
            self._reported: list[int] = []  # the versions of the last progress record
            self.losses: deque[float] = deque(maxlen=50)
            self.eval_history: list[tuple[int, float]] = []
            self.tokens_per_second = 0.0
            self.started_from = "scratch"  # where the outer state came from: scratch, checkpoint, peer ID
            self.resumed = False  # restarted from this node's own checkpoint
            self._leave = threading.Event()
            self._outer_lock = threading.Lock()
            self.metrics = Metrics(c.metrics_port, c.metrics_host) if c.metrics_port is not None else None
            self.stall = StallMeter()
            vocab = self.tokenizer.vocab_size
            self.snapshots = SnapshotPublisher(
                self.loop, self.transport, self._outer_lock, self.swarm, c.snapshot_codec, phi0,
                lambda seed: Phi0(seed, build_model(c.model, vocab, seed=seed).parameters()),
            )  # fmt: skip
            self.state_sync = StateSync(
                c, self.transport, self.loop, self.swarm, self._outer_lock, self._leave,
                self.snapshots.reference,
            )  # fmt: skip
            # the round itself: the wall clock and the network drive the one member engine;
            # an all-reduce has waited for its group already, so it takes its step at once
            self.member = Member(
                self.loop,
                self.state_sync,
                Schedule.of(
                    c,
                    apply_delay=0 if self.exchange is not None else c.apply_delay,
                    fan_in=self.transport.fan_in,  # --fan-in auto, cut to the model by the transport
                    align_after_adopting=self.exchange is None,
                ),
                hooks=self,
                lock=self._outer_lock,
            )
            self.admin = AdminServer(
                c.admin_host, c.admin_port, status=self.admin_status, leave=self.request_leave
            )
            # what the dashboard draws over time: one point per round, bounded
            self.timeline: deque[dict[str, Any]] = deque(maxlen=TIMELINE_POINTS)
            self.dashboard = (
                DashboardServer(c.dashboard_host, c.dashboard_port, self.dashboard_snapshot)
                if c.dashboard
                else None
            )
        except BaseException:
            self.transport.close()
            raise

    # ------------------------------------------------------------------ state

    def publish_state(self, wait: bool = False) -> None:
        """Offer a snapshot of the swarm's identity and this peer's outer state to peers that
        join or fall behind: packed once on the snapshot thread (``wait``: and offered before
        this returns), served to all of them by content hash."""
        self.snapshots.offer(self.member.round, wait)

    def _checkpoint_state(self) -> dict[str, Any]:
        return {
            "swarm": self.swarm,
            "peer_id": self.peer_id,
            "outer": self.loop.state_dict(),
            "model": self.model.state_dict(),
            "inner_optimizer": self.trainer.optimizer.state_dict(),
            "inner_step": self.trainer.steps,
            "tokens": self.trainer.tokens,
            **self.member.state_dict(),  # round, blocks, block_start
            "data": self.batches.state_dict(),
            "eval_history": [list(e) for e in self.eval_history],
            "model_config": self.model.config.to_dict(),
        }

    def save(self) -> None:
        """Checkpoint atomically; the first time, also the tokenizer beside it (for export)."""
        directory = Path(self.config.checkpoint_dir)
        tokenizer_dir = directory / TOKENIZER_DIR
        if not tokenizer_dir.exists():
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write(tokenizer_dir, lambda tmp: self.tokenizer.save_pretrained(tmp))
        save_checkpoint(directory, self._checkpoint_state())

    def resume_or_join(self) -> None:
        c = self.config
        state = load_checkpoint(c.checkpoint_dir) if c.checkpoint_dir else None
        if state is not None:
            check_compatible(self.swarm, state["swarm"], f"checkpoint in {c.checkpoint_dir}")
            with self._outer_lock:
                self.loop.load_state_dict(state["outer"])  # φ and versions; it sets θ = φ
            self.model.load_state_dict(state["model"])  # then θ as it was, mid-round
            self.trainer.optimizer.load_state_dict(state["inner_optimizer"])
            self.trainer.steps = state["inner_step"]
            self.trainer.tokens = state["tokens"]
            self.batches.load_state_dict(state["data"])
            self.member.load_state_dict(state, self.trainer.steps)
            self.eval_history = [tuple(e) for e in state["eval_history"]]
            self.started_from = "checkpoint"
            self.resumed = True
            logger.info("resumed from %s at round %d", c.checkpoint_dir, self.member.round)
        described = self.state_sync.check_bootstrap_peers() if c.peers else []
        averaging = self.exchange or self.groups
        if averaging is not None:  # state where this node's averager listens when asked who it is
            maddrs = start_averaging(averaging, described, c)
            self._install_signal_handlers()  # hivemind's averager start set SIGINT to ignored
            self.transport.describe_as(json.dumps({**self.swarm, "averager": maddrs}))
        if c.peers:
            # a fresh node starts from the swarm's model; a resumed one catches up if it lags
            self.sync_from_swarm(required=state is None)

    def sync_from_swarm(self, required: bool) -> bool:
        """Adopt a peer's snapshot ahead of this node (``Member.adopt``); True when one was."""
        return self.member.adopt(required) is not None

    # ------------------------------------------------------------------ the member's hooks

    def adopt_state(self, required: bool) -> tuple[str, int] | None:
        behind = self.member.behind()
        if behind > self.config.cutoff:
            logger.warning("%d versions behind the swarm: re-syncing", behind)
        adopted = self.state_sync.sync(required)
        if adopted is not None:
            self.started_from = f"peer {adopted[0]}"
        return adopted

    def diverged(self, fragment: int) -> None:
        # θ_f was reset to φ_f; restart the inner moments too
        logger.warning("non-finite pseudo-gradient on fragment %d: block discarded", fragment)
        self.trainer.optimizer.state.clear()

    def round_ended(self, round_: int) -> None:
        c = self.config
        # over the whole round, outer steps and waits included: what the swarm gets from us
        now, (since, tokens_then) = time.monotonic(), self._round_mark
        self.tokens_per_second = (self.trainer.tokens - tokens_then) / max(now - since, 1e-9)
        self._round_mark = (now, self.trainer.tokens)
        evaluated = self.eval_schedule.due(round_)
        if evaluated:
            with self.stall.apart(), self.eval_schedule.timed():
                loss = evaluate(self.model, self.eval_batches, self.device, self.autocast)
            self.eval_history.append((round_, loss))
        recent = list(self.losses)
        self.timeline.append({
            "round": round_, "seconds": time.time() - self.started_at,
            "loss": sum(recent) / len(recent) if recent else None,
            "eval_loss": self.eval_history[-1][1] if evaluated else None,
            "tokens_per_second": self.tokens_per_second,
        })  # fmt: skip
        if c.checkpoint_dir and round_ % c.checkpoint_every == 0:
            with self.stall.apart():
                self.save()
        if round_ % c.state_every == 0:
            self.publish_state()

    def applied(self, fragment: int) -> None:
        self._report_progress()

    def group_due(self, round_: int) -> None:
        if self.groups is not None:  # the trainer waits (a stall): what utilisation pays for agreement
            join_group(self.member, self.groups)

    def stepped(self, fragment: int, deliveries: list, round_ended: bool) -> None:
        if self.loop.versions != self._reported:  # a re-sync moved them since ``applied``
            self._report_progress()
        status = self.status()
        if self.metrics:
            self.metrics.update(status)
        self._show(status)

    def _report_progress(self) -> None:
        """One signed progress record (a DHT store) with the versions as they are now."""
        self._reported = list(self.loop.versions)
        # signed with it: the latest held-out loss, and how many fragments it applied from whom
        claims = (self.eval_history[-1][1] if self.eval_history else None, self.loop.counters.applied_by_peer)
        self.transport.report_progress(self._reported, self.trainer.steps, self.tokens_per_second, *claims)

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        c = self.config
        self._install_signal_handlers()
        self._announce()
        self.resume_or_join()
        if self._leave.is_set() and self.started_from == "scratch" and c.peers:
            # told to leave while waiting for the swarm's state: an untrained model is nothing
            # to offer peers, and a checkpoint of it would make the next start a resume
            logger.info("left before the swarm's state arrived: nothing saved")
            return 0
        self.publish_state(wait=True)
        self.member.start_round = self.member.round  # --max-rounds counts this run's rounds
        self.eval_schedule = EvalSchedule(c.eval_every)
        if not self.eval_history:
            with self.eval_schedule.timed():
                loss = evaluate(self.model, self.eval_batches, self.device, self.autocast)
            self.eval_history.append((self.member.round, loss))
        self._round_mark = (time.monotonic(), self.trainer.tokens)
        self.stall = StallMeter()  # from the first block: not the join, the first snapshot or evaluation
        while not self._leave.is_set() and not self.member.done:
            self.losses.append(self.trainer.step())
            blocks = self.member.blocks
            with self.stall.stalled():
                self.member.after_inner_step(self.trainer.steps)
            if self.member.blocks != blocks:
                self.stall.block_ended()
        self._finish()
        return 0

    def _finish(self) -> None:
        """Stopping (``Member.finish``): the waiting step, and when told to leave the block under
        way with the steps it has; then checkpoint, and give peers a moment to fetch the last
        fragment."""
        self.member.finish(self.trainer.steps, leaving=self._leave.is_set())
        self.loop.settle()  # the last Δ handed to the transport before peers are given time for it
        if self.config.checkpoint_dir:
            self.save()
        self._show(self.status(), final=True)
        if self.transport.live_peers():
            time.sleep(LINGER_SECONDS)

    def close(self) -> None:
        if self.dashboard:
            self.dashboard.stop()
        self.admin.stop()
        for averaging in (self.exchange, self.groups):
            if averaging is not None:
                averaging.close()
        self.snapshots.close()
        self.transport.close()
        if self.metrics:
            self.metrics.stop()

    def request_leave(self) -> None:
        self._leave.set()

    def _install_signal_handlers(self) -> None:
        # hivemind sets SIGINT to ignored in the host process: take both signals back
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self.request_leave())

    def _announce(self) -> None:
        maddrs = self.transport.maddrs()
        if self.config.maddrs_file:  # before the lines a watcher takes as "up": it reads this next
            path = Path(self.config.maddrs_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, "".join(f"{a}\n" for a in maddrs).encode())
        print(f"peer id   {self.peer_id}", flush=True)
        for addr in maddrs:
            print(f"multiaddr {addr}", flush=True)
        print(f"reach     {self.transport.reach()['line']}", flush=True)
        print(f"admin     {self.admin.address}", flush=True)
        if self.dashboard:
            print(f"dashboard {self.dashboard.url}", flush=True)

    # ------------------------------------------------------------------ what it shows

    def status(self) -> dict[str, Any]:
        recent = list(self.losses)
        return {
            "peer_id": self.peer_id,
            "run_id": self.config.run_id,
            "optimizer": self.config.optimizer,
            "versions": list(self.loop.versions),
            "round": self.member.round,
            "inner_step": self.trainer.steps,
            "loss": sum(recent) / len(recent) if recent else None,
            "eval_loss": self.eval_history[-1][1] if self.eval_history else None,
            "eval_history": [list(e) for e in self.eval_history],
            "tokens_per_second": self.tokens_per_second,
            **exchange_status(self.loop, self.transport),
            "phase_nudges": dict(self.member.phase_nudges),
            "inner_lr": self.trainer.optimizer.param_groups[0]["lr"],  # × √N averaged (--inner-lr-scaling)
            "resyncs": self.member.resyncs,
            "allreduce_groups": dict(self.exchange.groups) if self.exchange is not None else None,
            "consensus": consensus_status(self.member, self.groups),
            "started_from": self.started_from,
            "resumed": self.resumed,
            "device": str(self.device),
            "stall": self.stall.summary(),  # time off training per outer step (evaluation, checkpoints apart)
            "snapshot_bytes": self.snapshots.bytes,
            "uptime": time.time() - self.started_at,
        }

    def dashboard_snapshot(self) -> dict[str, Any]:
        """What the dashboard page draws: ``status``, the per-round timeline, every live peer's
        latest report with what this node applied from it, and the traffic counters."""
        status = self.status()
        applied = status["applied_by_peer"]
        refused = status["rejected_by_peer"]
        peers = [
            {**row, "applied": applied.get(row["peer_id"], 0), "rejected": refused.get(row["peer_id"], 0)}
            for row in swarm_rows(self.transport)
        ]
        return {
            **status,
            "timeline": list(self.timeline),
            "swarm": peers,  # this node's row too (``this_node``), each with its credit
            "floor": floor_points(self.config.dashboard_floor),  # a lone node's held-out loss, if known
            "bytes_by_path": dict(self.transport.bytes_by_path),
            "leaving": self._leave.is_set(),
            "time": time.time(),
        }

    def admin_status(self) -> dict[str, Any]:
        """``status`` and where the CPU went, for the admin API: read from /proc on request,
        not every round (the status line and metrics do not need it)."""
        return {**self.status(), "cpu_seconds_by_thread": cpu_seconds_by_thread()}

    def _show(self, status: dict[str, Any], final: bool = False) -> None:
        """The live status line: redrawn in place on a terminal, one line per round otherwise."""
        line = status_line(status)
        if sys.stderr.isatty() and not final:
            sys.stderr.write("\r" + line[:200].ljust(100))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
