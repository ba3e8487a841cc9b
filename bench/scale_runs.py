"""The two sides bench/scale.py measures, each a process of its own: a bare PyTorch training loop
(``bare_child``, run as ``python -m cgad.bench.scale --bare-child``) and a lone `cgad-node join`
daemon polled through its dashboard's JSON; their tokens per second by window and their peak RSS.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

START_TIMEOUT = 300.0  # seconds for a daemon to print its addresses (imports, p2pd, model) when busy
MIN_WINDOWS = 3  # measured windows per run, whatever --seconds says
POLL_SECONDS = 2.0


@dataclass(frozen=True)
class Settings:
    """What both sides run.

    Args:
        preset: the model preset.
        batch_size, seq_len, inner_steps: the batch, sequence length and H (a window is H steps).
        threads: torch threads of both processes.
        seconds: measured seconds per run, after the warm-up.
        warmup: windows left out at the start of each run.
        device: "cpu" or "cuda" (bf16 autocast on CUDA, as the daemon does).
    """

    preset: str
    batch_size: int = 4
    seq_len: int = 128
    inner_steps: int = 10
    threads: int = 2
    seconds: float = 300.0
    warmup: int = 2
    device: str = "cpu"

    @property
    def tokens_per_window(self) -> int:
        return self.batch_size * self.seq_len * self.inner_steps


# ---------------------------------------------------------------------------- processes


def peak_rss(pid: int) -> int | None:
    """The peak resident set of process ``pid`` (``VmHWM``) in bytes; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmHWM:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) * 1024 if found else None


def children_peak_rss(pid: int) -> dict[str, int]:
    """Peak RSS of each direct child of ``pid`` (the daemon's libp2p daemon), by name and pid."""
    found = {}
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = stat_path.read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) != pid:
            continue
        child = int(stat_path.parent.name)
        rss = peak_rss(child)
        if rss is not None:
            found[f"{stat[stat.index('(') + 1 : stat.rindex(')')]}:{child}"] = rss
    return found


def _median_after_warmup(rates: list[float], warmup: int) -> float | None:
    measured = rates[warmup:]
    return statistics.median(measured) if measured else None


def bare_child(settings: Settings) -> dict[str, Any]:
    """The bare loop, run in its own process (``--bare-child``): tokens/s per window of H steps
    until ``seconds`` after the warm-up have passed and ``MIN_WINDOWS`` were measured."""
    import torch

    from cgad.node.training.data import load_dataset
    from cgad.node.training.model import build_model
    from cgad.node.training.tokenizer import load_tokenizer
    from cgad.node.training.trainer import InnerTrainer

    torch.set_num_threads(settings.threads)
    device = torch.device(settings.device)
    tokenizer = load_tokenizer(None)
    dataset = load_dataset(tokenizer)
    model = build_model(settings.preset, tokenizer.vocab_size, seed=0).to(device)
    batches = dataset.shard(0, 1).batches(settings.batch_size, settings.seq_len, seed=0)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    trainer = InnerTrainer(model, batches, device=device, autocast_dtype=autocast)
    rates: list[float] = []
    measured_from = time.perf_counter() if settings.warmup == 0 else None
    while True:
        start = time.perf_counter()
        for _ in range(settings.inner_steps):
            trainer.step()  # returns float(loss): synchronises with the device every step
        rates.append(settings.tokens_per_window / (time.perf_counter() - start))
        if len(rates) == settings.warmup:
            measured_from = time.perf_counter()
        if (
            measured_from is not None
            and len(rates) - settings.warmup >= MIN_WINDOWS
            and time.perf_counter() - measured_from >= settings.seconds
        ):
            break
    return {
        "tokens_per_second": _median_after_warmup(rates, settings.warmup),
        "window_rates": rates,
        "peak_rss_bytes": peak_rss(os.getpid()),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _env(settings: Settings) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(settings.threads), "PYTHONUNBUFFERED": "1"}


def run_bare(settings: Settings, timeout: float) -> dict[str, Any]:
    """``bare_child`` in a process of its own (its peak RSS is its own)."""
    cmd = [sys.executable, "-m", "cgad.bench.scale", "--bare-child", json.dumps(asdict(settings))]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(settings), timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the bare loop exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _http_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=20) as reply:
        return json.loads(reply.read())


def _read_log(log: Path, pattern: str) -> str | None:
    found = re.search(pattern, log.read_text(errors="replace"), re.M)
    return found.group(1) if found else None


def published_bytes_per_round(status: dict[str, Any], numel: int, fragments: int) -> float | None:
    """The encoded pseudo-gradients one round publishes, from the codecs the status says its
    deltas went out in (``sent_as``: per codec, or "sparse:k", how many fragments)."""
    from cgad.protocol.codec import encoded_size

    counts = status.get("sent_as") or {}
    rounds = status.get("round") or 0
    if not counts or not rounds:
        return None
    per_fragment = numel // fragments
    total = 0
    for name, count in counts.items():
        codec, _, kept = name.partition(":")
        size = (
            encoded_size(per_fragment, codec, kept=int(kept)) if kept else encoded_size(per_fragment, codec)
        )
        total += count * size
    return total / rounds


def snapshot_bytes(maddrs: list[str], peer_id: str, run_id: str) -> int | None:
    """The size the daemon's newest state offer states in its signed record, read from the DHT
    as a joiner would (an observer that trains and publishes nothing)."""
    from cgad.node.daemon.monitor import open_monitor
    from cgad.protocol.config import NetworkOptions

    with open_monitor(NetworkOptions(run_id=run_id, peers=maddrs)) as monitor:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            offers = [c for c in monitor.state_offers() if c.key.publisher == peer_id]
            if offers:
                return max(offers, key=lambda c: c.key.base_version).offer.byte_length
            time.sleep(1.0)
    return None


def _stop(process: subprocess.Popen, admin: str | None) -> None:
    """Ask the daemon to leave; kill its process group (p2pd with it) if it has not gone in 60 s."""
    from cgad.node.daemon.admin import call_admin

    if process.poll() is None and admin:
        try:
            call_admin(admin, "Leave", timeout=5)
        except ConnectionError:
            pass
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)


def run_daemon(
    settings: Settings,
    workdir: Path,
    timeout: float,
    extra: list[str] | None = None,
    sample: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """A lone ``cgad-node join`` until ``seconds`` after its warm-up rounds (and at least
    ``MIN_WINDOWS`` rounds); its status at the end, peak RSS, snapshot size; then it leaves.

    Args:
        settings: the preset, batch, H, threads and seconds.
        workdir: where its log and multiaddrs go.
        timeout: seconds from start after which the run fails.
        extra: further ``join`` flags (``gpu_check`` adds ``--device cuda``).
        sample: called with the daemon's pid at every poll (``gpu_check`` reads GPU memory).
    """
    from cgad.node.daemon.admin import call_admin
    from cgad.protocol.config import NetworkOptions

    workdir.mkdir(parents=True, exist_ok=True)
    log, maddrs_file = workdir / "daemon.log", workdir / "daemon.maddrs"
    flags = [
        "--model", settings.preset, "--batch-size", str(settings.batch_size), "--seq-len",
        str(settings.seq_len), "--inner-steps", str(settings.inner_steps), "--admin-port", "0",
        "--dashboard-port", "0", "--maddrs-file", str(maddrs_file), *(extra or []), "--private-endpoints",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "cgad.node.front.cli", "join", *flags]
    with log.open("w") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(settings), start_new_session=True
        )
    admin = None
    try:
        deadline = time.monotonic() + timeout
        start_deadline = time.monotonic() + min(timeout, START_TIMEOUT)
        dashboard = None
        while dashboard is None:
            if process.poll() is not None or time.monotonic() > start_deadline:
                raise RuntimeError(f"the daemon did not start:\n{log.read_text(errors='replace')[-3000:]}")
            admin = _read_log(log, r"^admin\s+(\S+)")
            dashboard = _read_log(log, r"^dashboard\s+(\S+)")
            time.sleep(0.5)
        started = time.monotonic()
        snapshot: dict[str, Any] = {}
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the daemon exited:\n{log.read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon measured too few rounds in {timeout:.0f} s: {snapshot}")
            if sample is not None:
                sample(process.pid)
            try:
                snapshot = _http_json(f"{dashboard.rstrip('/')}/api/status")
            except OSError:
                snapshot = {}
            timeline = snapshot.get("timeline") or []
            measured = timeline[settings.warmup :]
            if (
                len(measured) >= MIN_WINDOWS
                and (
                    measured[-1]["seconds"] - timeline[settings.warmup - 1]["seconds"]
                    if settings.warmup
                    else measured[-1]["seconds"]
                )
                >= settings.seconds
            ):
                break
            time.sleep(POLL_SECONDS)
        status = call_admin(admin, "Status", timeout=20)
        rss, children = peak_rss(process.pid), children_peak_rss(process.pid)
        maddrs = maddrs_file.read_text().split()
        try:
            snap = snapshot_bytes(maddrs, status["peer_id"], NetworkOptions.model_fields["run_id"].default)
        except Exception as exc:  # a missing figure, said as such, not a failed run
            snap = None
            status["snapshot_error"] = repr(exc)
    finally:
        _stop(process, admin)
    rates = [point["tokens_per_second"] for point in timeline]
    rounds = status.get("round") or 0
    moved = (status.get("bytes_in") or 0) + (status.get("bytes_out") or 0)
    return {
        "tokens_per_second": _median_after_warmup(rates, settings.warmup),
        "window_rates": rates,
        "peak_rss_bytes": rss,
        "children_peak_rss_bytes": children,
        "stall": status.get("stall"),
        "rounds": rounds,
        "transport_bytes_per_round": moved / rounds if rounds else None,
        "status": {
            k: status.get(k)
            for k in ("sent_as", "bytes_in", "bytes_out", "inner_step", "device", "cpu_seconds_by_thread")
        },
        "snapshot_bytes": snap,
        "seconds": time.monotonic() - started,
        # as run, the run's own scratch folder named <workdir>: no path of this machine in the record
        "flags": [flag.replace(str(workdir), "<workdir>") for flag in flags],
    }
