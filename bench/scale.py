"""Memory and throughput at size: a lone daemon against a bare training loop (issue 28, point 3).

For each preset (tiny, small, base, and 1b where it fits in this machine's memory) two processes
run one after the other, in alternating order repeat by repeat (the machine may be shared: medians
of alternating repeats are compared):

- the daemon: a real ``cgad-node join`` with no peers, every flag at its default except the batch,
  the sequence length and H (and the ports: ``--admin-port 0 --dashboard-port 0``, so that it
  never collides with another node on the machine, and ``--maddrs-file``, where it says where it
  listens);
- the bare loop: the same model, batch and data pipeline (the bundled corpus, the same window
  sampler) stepped by the daemon's ``InnerTrainer`` (AdamW, clipping), nothing else.

Both get the same threads (``OMP_NUM_THREADS``). A window is one outer round of H inner steps
(the daemon's own per-round tokens/s, outer step, evaluation and snapshot included, read from its
dashboard's timeline) or H inner steps of the bare loop; the first ``--warmup`` windows are left
out and tokens/s is the median over the rest. Each side runs at least ``--seconds`` after its
warm-up and at least three windows. Also per run: peak RSS (``VmHWM`` of the process; the
daemon's libp2p daemon, a child process, beside it), the trainer's stall per outer step and its
share of the block (the status document's ``stall``, None where the daemon does not report it),
the bytes one round publishes (the encoded pseudo-gradients: the status document's ``sent_as``
priced by ``encoded_size``) and moves (``bytes_in`` + ``bytes_out``: nothing, alone), and the
snapshot's bytes (the ``byte_length`` of the state offer the daemon signed, read from the DHT
by an observer).

Results per preset are medians over repeats, as daemon/bare ratios beside the goals of issue 28
(tokens/s at least 0.95x, peak RSS at most 1.5x, stall at most 2% of the block). The tokens/s
ratio is the median of each repeat's own ratio (its two sides ran back to back), which cancels
the machine's drift between repeats; the ratio of the medians is kept beside it. Many short
repeats resolve the ratio better than a few long ones. Writes
``bench/results/scale.json`` (commit, clean flag, machine, settings, every run) and
``bench/results/scale.png``. With ``--checkpoint`` the daemon also keeps a checkpoint
(``--checkpoint-dir``, every 5 rounds by default), as volunteers and docker-compose nodes do.

    .venv/bin/python bench/scale.py [--presets tiny,small,base,1b] [--seconds 300] [--repeats 3]
        [--checkpoint]   (writes bench/results/scale_checkpoint.json)
"""

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench" / "wan"))  # provenance: what a run ran
from provenance import tree_state  # noqa: E402

RESULT = ROOT / "bench" / "results" / "scale.json"
START_TIMEOUT = 300.0  # seconds for a daemon to print its addresses (imports, p2pd, model) when busy
MIN_WINDOWS = 3  # measured windows per run, whatever --seconds says
POLL_SECONDS = 2.0
GOALS = {"tokens_ratio_min": 0.95, "rss_ratio_max": 1.5, "stall_fraction_max": 0.02}
# bytes of host memory per parameter in a bare loop: fp32 weights, gradients and AdamW's two moments
BARE_BYTES_PER_PARAM = 16
PROCESS_BASE_BYTES = 1 << 30  # torch, transformers and the token cache, before the model
UNMEASURED_DAEMON_RATIO = 3.2  # issue 28's daemon/bare peak RSS at small, until this run measures one

Say = Callable[[str], None]


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
    cmd = [sys.executable, str(Path(__file__).resolve()), "--bare-child", json.dumps(asdict(settings))]
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
        "--dashboard-port", "0", "--maddrs-file", str(maddrs_file), *(extra or []),
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


# ---------------------------------------------------------------------------- the bench


def machine() -> dict[str, Any]:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo") if line.startswith("model name")),
        None,
    )
    memory = next(
        (int(line.split()[1]) * 1024 for line in _lines("/proc/meminfo") if line.startswith("MemTotal")), None
    )
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg(),
        # huge pages change what a fresh model-sized buffer costs (faults, compaction)
        "transparent_hugepages": next(iter(_lines("/sys/kernel/mm/transparent_hugepage/enabled")), None),
    }


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def available_memory() -> int:
    """MemAvailable, in bytes (what a new process can take without swapping others out)."""
    line = next((line for line in _lines("/proc/meminfo") if line.startswith("MemAvailable")), None)
    return int(line.split()[1]) * 1024 if line else 0


def parameters(preset: str) -> int:
    """The preset's parameter count at the bundled tokenizer's vocabulary (no weights allocated)."""
    from cgad.node.training.model import build_model
    from cgad.node.training.tokenizer import load_tokenizer

    model = build_model(preset, load_tokenizer(None).vocab_size, seed=0, device="meta")
    return sum(p.numel() for p in model.parameters())


def summarize(runs: list[dict[str, Any]], numel: int) -> dict[str, Any]:
    """Medians over repeats and the daemon/bare ratios, beside issue 28's goals."""

    def median(side: str, key: str) -> float | None:
        values = [r[side][key] for r in runs if r[side].get(key) is not None]
        return statistics.median(values) if values else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    stalls = [r["daemon"]["stall"] for r in runs if r["daemon"].get("stall")]
    stall_s = [s["per_outer_step_s"] for s in stalls if s.get("per_outer_step_s") is not None]
    stall_f = [s["fraction"] for s in stalls if s.get("fraction") is not None]
    snapshot = median("daemon", "snapshot_bytes")
    summary = {
        "bare_tokens_per_second": median("bare", "tokens_per_second"),
        "daemon_tokens_per_second": median("daemon", "tokens_per_second"),
        "bare_peak_rss_bytes": median("bare", "peak_rss_bytes"),
        "daemon_peak_rss_bytes": median("daemon", "peak_rss_bytes"),
        "stall_per_outer_step_s": statistics.median(stall_s) if stall_s else None,
        "stall_fraction": statistics.median(stall_f) if stall_f else None,
        "published_bytes_per_round": median("daemon", "published_bytes_per_round"),
        "transport_bytes_per_round": median("daemon", "transport_bytes_per_round"),
        "snapshot_bytes": snapshot,
        "snapshot_bytes_per_parameter": snapshot / numel if snapshot else None,
    }
    summary["tokens_ratio_of_medians"] = ratio(
        summary["daemon_tokens_per_second"], summary["bare_tokens_per_second"]
    )
    # each repeat's two sides ran back to back: their ratio cancels the machine's slow drift (the
    # bare loop alone moves by several percent between repeats here), so the goal reads its median
    pairs = [
        r["daemon"]["tokens_per_second"] / r["bare"]["tokens_per_second"]
        for r in runs
        if r["daemon"].get("tokens_per_second") and r["bare"].get("tokens_per_second")
    ]
    summary["tokens_ratio_pairs"] = pairs
    summary["tokens_ratio"] = statistics.median(pairs) if pairs else None
    summary["rss_ratio"] = ratio(summary["daemon_peak_rss_bytes"], summary["bare_peak_rss_bytes"])
    fraction = summary["stall_fraction"]
    summary["goals_met"] = {
        "tokens": summary["tokens_ratio"] is not None
        and summary["tokens_ratio"] >= GOALS["tokens_ratio_min"],
        "rss": summary["rss_ratio"] is not None and summary["rss_ratio"] <= GOALS["rss_ratio_max"],
        "stall": None if fraction is None else fraction <= GOALS["stall_fraction_max"],
    }
    return summary


def measure_preset(
    settings: Settings, repeats: int, workdir: Path, say: Say, checkpoint: bool = False
) -> dict[str, Any]:
    """``repeats`` runs of each side, the order alternating, and their summary."""
    numel = parameters(settings.preset)
    # a run that cannot reach its windows within this is stuck, not slow
    timeout = START_TIMEOUT + 4 * settings.seconds + 600
    runs = []
    for i in range(repeats):
        run: dict[str, Any] = {}
        for side in ("bare", "daemon") if i % 2 == 0 else ("daemon", "bare"):
            say(f"{settings.preset} repeat {i + 1}/{repeats}: {side} ...")
            if side == "bare":
                run[side] = run_bare(settings, timeout)
            else:
                where = workdir / f"{settings.preset}-{i}"
                extra = ["--checkpoint-dir", str(where / "ckpt")] if checkpoint else None
                run[side] = run_daemon(settings, where, timeout, extra)
                shutil.rmtree(where / "ckpt", ignore_errors=True)  # a model's state a repeat
                run[side]["published_bytes_per_round"] = published_bytes_per_round(
                    {**run[side]["status"], "round": run[side]["rounds"]}, numel, 1
                )
            got = run[side]
            rss = got["peak_rss_bytes"] or 0
            say(
                f"{settings.preset} repeat {i + 1}/{repeats}: {side} "
                f"{got['tokens_per_second'] or 0:.0f} tokens/s "
                f"over {len(got['window_rates']) - settings.warmup} windows, peak RSS {rss / 2**30:.2f} GiB"
                + (f", stall {got['stall']}" if side == "daemon" else "")
            )
        runs.append(run)
    summary = summarize(runs, numel)
    return {"preset": settings.preset, "parameters": numel, "runs": runs, "summary": summary}


def fits(preset: str, numel: int, done: list[dict[str, Any]]) -> tuple[bool, str]:
    """Whether the daemon of ``preset`` should fit in the memory available now: a bare loop's
    16 bytes per parameter plus a process's base, times the daemon/bare peak-RSS ratio measured at
    the largest preset so far (issue 28's 3.2 before any)."""
    ratios = [p["summary"]["rss_ratio"] for p in done if p["summary"]["rss_ratio"]]
    ratio = ratios[-1] if ratios else UNMEASURED_DAEMON_RATIO
    need = ratio * (BARE_BYTES_PER_PARAM * numel + PROCESS_BASE_BYTES)
    have = available_memory()
    why = (
        f"{preset}: the daemon needs about {need / 2**30:.1f} GiB ({ratio:.2f}x a bare loop), "
        f"{have / 2**30:.1f} GiB available"
    )
    return need <= have, why


def plot(record: dict[str, Any], path: Path) -> Path:
    """Left: daemon/bare ratios of tokens/s and peak RSS per preset, with the goals; right: the
    stall's share of the block, and snapshot and published bytes per parameter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = [p for p in record["presets"] if "summary" in p]
    names = [f"{p['preset']}\n{p['parameters'] / 1e6:.1f}M" for p in presets]
    xs = range(len(presets))
    fig, (ax, bytes_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.38

    def values(key: str, scale: float = 1.0) -> list[float]:
        return [(p["summary"][key] or 0) * scale for p in presets]

    tokens_label = "tokens/s, daemon / bare (median of each repeat's ratio)"
    ax.bar([x - width / 2 for x in xs], values("tokens_ratio"), width, label=tokens_label)
    rss_label = "peak RSS, daemon / bare (ratio of the medians)"
    ax.bar([x + width / 2 for x in xs], values("rss_ratio"), width, label=rss_label)
    ax.axhline(GOALS["tokens_ratio_min"], color="tab:blue", ls="--", lw=1, label="goal: tokens/s >= 0.95x")
    ax.axhline(GOALS["rss_ratio_max"], color="tab:orange", ls="--", lw=1, label="goal: peak RSS <= 1.5x")
    stalls = [p["summary"]["stall_fraction"] for p in presets]
    ax.set_xticks(
        list(xs),
        [
            f"{name}\nstall " + ("not reported" if f is None else f"{100 * f:.1f}% of the block")
            for name, f in zip(names, stalls, strict=True)
        ],
    )
    ax.set_ylabel("daemon / bare loop")
    ax.set_title("a lone daemon against a bare loop")
    ax.legend(fontsize=8)
    numels = [p["parameters"] for p in presets]
    snap = [(p["summary"]["snapshot_bytes"] or 0) / n for p, n in zip(presets, numels, strict=True)]
    sent = [
        (p["summary"]["published_bytes_per_round"] or 0) / n for p, n in zip(presets, numels, strict=True)
    ]
    bytes_ax.bar([x - width / 2 for x in xs], snap, width, label="snapshot")
    bytes_ax.bar([x + width / 2 for x in xs], sent, width, label="pseudo-gradients published per round")
    bytes_ax.set_xticks(list(xs), names)
    bytes_ax.set_ylabel("bytes per parameter")
    bytes_ax.set_title("what a node offers")
    bytes_ax.legend(fontsize=8)
    s = record["settings"]
    fig.suptitle(
        f"batch {s['batch_size']} x {s['seq_len']}, H = {s['inner_steps']}, {s['threads']} threads, "
        f"{record['repeats']} repeat(s), commit {record['commit'][:7]}"
        + ("" if record["clean"] else " (dirty)"),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="tiny,small,base,1b", help="comma-separated model presets")
    parser.add_argument("--seconds", type=float, default=300.0, help="measured seconds per run after warm-up")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="windows (rounds) left out at the start")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--inner-steps", type=int, default=10, help="H")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads of both sides"
    )
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="the daemon also checkpoints (--checkpoint-dir, every --checkpoint-every rounds: 5)",
    )
    parser.add_argument(
        "--out", type=Path, help="the JSON; the PNG goes beside it (scale.json, scale_checkpoint.json)"
    )
    parser.add_argument("--bare-child", help=argparse.SUPPRESS)  # the bare loop's own process
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = RESULT.with_name("scale_checkpoint.json") if args.checkpoint else RESULT
    if args.bare_child:
        print(json.dumps(bare_child(Settings(**json.loads(args.bare_child)))), flush=True)
        return 0

    def say(line: str) -> None:
        print(f"[{datetime.now(UTC):%H:%M:%S}] {line}", flush=True)

    record: dict[str, Any] = {
        "benchmark": "scale",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **tree_state(ROOT),
        "machine": machine(),
        "settings": {
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "inner_steps": args.inner_steps,
            "threads": args.threads,
            "seconds": args.seconds,
            "warmup_windows": args.warmup,
            "min_windows": MIN_WINDOWS,
            "daemon_flags": "every flag at its default but these, "
            "--admin-port 0 --dashboard-port 0 and --maddrs-file"
            + (" and --checkpoint-dir" if args.checkpoint else ""),
            "checkpoint": args.checkpoint,
        },
        "repeats": args.repeats,
        "goals": GOALS,
        "presets": [],
    }
    with tempfile.TemporaryDirectory(prefix="cgad-scale-") as tmp:
        for preset in [p.strip() for p in args.presets.split(",") if p.strip()]:
            numel = parameters(preset)
            ok, why = fits(preset, numel, record["presets"])
            if not ok:
                say(f"skipped: {why}")
                record["presets"].append({"preset": preset, "parameters": numel, "skipped": why})
                continue
            settings = Settings(
                preset,
                args.batch_size,
                args.seq_len,
                args.inner_steps,
                args.threads,
                args.seconds,
                args.warmup,
            )
            result = measure_preset(settings, args.repeats, Path(tmp), say, args.checkpoint)
            record["presets"].append(result)
            s = result["summary"]
            say(
                f"{preset}: daemon/bare tokens/s {s['tokens_ratio'] or 0:.3f}, "
                f"peak RSS {s['rss_ratio'] or 0:.2f}x, "
                f"stall {s['stall_fraction']}, snapshot {s['snapshot_bytes_per_parameter'] or 0:.2f} B/param"
            )
            _write(record, args.out)  # a preset at a time: a long run keeps what it measured
    _write(record, args.out)
    if any("summary" in p for p in record["presets"]):
        say(f"wrote {args.out} and {plot(record, args.out.with_suffix('.png'))}")
    return 0


def _write(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
