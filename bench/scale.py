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
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cgad.bench.scale_runs import (
    MIN_WINDOWS,
    START_TIMEOUT,
    Settings,
    bare_child,
    published_bytes_per_round,
    run_bare,
    run_daemon,
)
from cgad.bench.wan.provenance import tree_state

ROOT = Path(__file__).resolve().parent.parent

RESULT = ROOT / "bench" / "results" / "scale.json"
GOALS = {"tokens_ratio_min": 0.95, "rss_ratio_max": 1.5, "stall_fraction_max": 0.02}
# bytes of host memory per parameter in a bare loop: fp32 weights, gradients and AdamW's two moments
BARE_BYTES_PER_PARAM = 16
PROCESS_BASE_BYTES = 1 << 30  # torch, transformers and the token cache, before the model
UNMEASURED_DAEMON_RATIO = 3.2  # issue 28's daemon/bare peak RSS at small, until this run measures one

Say = Callable[[str], None]


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
