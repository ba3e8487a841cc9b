"""The GPU path, checked in one short run (issue 28, point 6).

On a CUDA machine, for each preset (small, base, and 1b where the GPU's free memory holds it):

- a bare bf16 loop (the daemon's ``InnerTrainer`` with bf16 autocast on the model, its batch and
  data pipeline): tokens/s per window of H steps (median after the first window), peak GPU memory;
- the outer step on the GPU: two ``OuterLoop`` members on an in-memory network, the model's
  parameters as one member's θ; the time of ``publish`` (Δ and its encoding by the member's sender,
  ``--codec auto``) and of ``apply`` (the peer's delta taken, the method's step: ``cga``, the
  default), and peak GPU memory with the outer state;
- the codecs of ``protocol/codec.py`` on a model-sized Δ held on the GPU (fp16, 4bit, 2bit,
  sparse): encode and decode seconds, bytes;
- a lone ``cgad-node join --device cuda`` (``bench/scale.py``'s daemon run: every flag at its
  default but batch, sequence length, H and ports): tokens/s against the bare loop, peak GPU
  memory of its process (``nvidia-smi``), stall, snapshot bytes;

and, right after the first preset, a two-node loopback exchange (``--exchange-preset``, small):
two real daemons with ``--device cuda`` on this machine, the second joining the first, until each
has applied a fragment of the other's (or the time is up): what each applied, its bytes in and
out, replays, tokens/s, stall.

Every part runs under one deadline (``--budget`` seconds, 420 by default: with the processes'
start and stop the script ends within 8 minutes on an H200); a part that fails or has no time
left is recorded as such, with the reason, and the rest still runs. Writes one JSON
(``bench/results/gpu_check.json``).

On a machine without CUDA it says so and exits 0 at once. ``--device cpu`` runs the same code on
the CPU (tests use it at the tiny preset to keep the script working).

    .venv/bin/python bench/gpu_check.py [--presets small,base,1b] [--seconds 60] [--budget 420]
"""

import argparse
import dataclasses
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
RESULT = BENCH / "results" / "gpu_check.json"
CODECS = ("fp16", "4bit", "2bit", "sparse")
OUTER_REPEATS = 4  # timed outer steps per preset, after one untimed


def _scale() -> Any:
    """What this script shares with bench/scale.py: its daemon run and its machine record."""
    from cgad.bench import scale, scale_runs

    shared = ("Settings", "run_daemon", "_env", "_read_log", "_stop")
    return types.SimpleNamespace(
        **{name: getattr(scale_runs, name) for name in shared},
        machine=scale.machine, tree_state=scale.tree_state, ROOT=scale.ROOT,
    )  # fmt: skip


class Deadline:
    """The run's one clock: each part asks for its seconds and gets what is left."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, work: Callable[[], Any]) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    out = work()
    _sync(device)
    return time.perf_counter() - start, out


def _peak_gpu(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def bare_loop(model: torch.nn.Module, settings: Any, seconds: float, device: torch.device) -> dict[str, Any]:
    """``InnerTrainer`` steps (bf16 autocast on CUDA) for ``seconds`` and at least three windows
    after the first; tokens/s per window of H steps."""
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer
    from cgad.node.training.trainer import InnerTrainer

    batches = load_dataset(load_tokenizer(None)).shard(0, 1).batches(settings.batch_size, settings.seq_len, 0)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    trainer = InnerTrainer(model, batches, device=device, autocast_dtype=autocast)
    rates: list[float] = []
    measured_from = None
    while measured_from is None or len(rates) < 4 or time.perf_counter() - measured_from < seconds:
        elapsed, _ = _timed(device, lambda: [trainer.step() for _ in range(settings.inner_steps)])
        rates.append(settings.tokens_per_window / elapsed)
        if measured_from is None:
            measured_from = time.perf_counter()
    return {
        "tokens_per_second": statistics.median(rates[1:]),
        "window_rates": rates,
        "peak_gpu_bytes": _peak_gpu(device),
    }


def outer_step(model: torch.nn.Module, device: torch.device, deadline: Deadline) -> dict[str, Any]:
    """Two members on an in-memory network; the model's parameters are member A's θ, a copy
    member B's. Each repeat moves both θ as a block would, B publishes, and A's ``publish`` and
    ``apply`` are timed."""
    from cgad.node.config import JoinConfig
    from cgad.node.member.outer import OuterLoop
    from cgad.node.sim.memory import VirtualNetwork

    options = JoinConfig()  # every outer option at its default (cga, codec auto, one fragment)
    network = VirtualNetwork()
    theta_a = list(model.parameters())  # as the daemon hands them over
    theta_b = [t.detach().clone() for t in theta_a]
    loops = [
        OuterLoop(theta, options, network.join(name), "gpu-check", codec=options.codec)
        for name, theta in (("a", theta_a), ("b", theta_b))
    ]
    a, b = loops
    publish_s, apply_s = [], []
    for repeat in range(OUTER_REPEATS + 1):
        if repeat and deadline.left() < 30:
            break
        with torch.no_grad():  # a block's progress: a shared direction and each member's own noise
            for t_a, t_b in zip(theta_a, theta_b, strict=True):
                common = torch.randn_like(t_a)
                for t in (t_a, t_b):
                    t.add_(common, alpha=1e-3).add_(torch.randn_like(t), alpha=3e-4)
        b.publish(0, tokens=1000)
        published, _ = _timed(device, lambda: a.publish(0, tokens=1000))
        applied, deliveries = _timed(device, lambda: a.apply(0))
        b.apply(0)
        if repeat:  # the first step allocates the optimizer's state
            publish_s.append(published)
            apply_s.append(applied)
    return {
        "publish_seconds": publish_s,
        "apply_seconds": apply_s,
        "publish_median_s": statistics.median(publish_s) if publish_s else None,
        "apply_median_s": statistics.median(apply_s) if apply_s else None,
        "deliveries_last_step": len(deliveries),
        "applied_from_peer": a.counters.applied,
        "rejected": dict(a.counters.rejected),
        "sent_as": dict(a.counters.sent_as),
        "peak_gpu_bytes": _peak_gpu(device),
    }


def codecs(numel: int, device: torch.device, deadline: Deadline) -> dict[str, Any]:
    """Encode and decode of a model-sized Δ on ``device`` in each codec (the codec runs on the
    host: the copy off the device is part of its time)."""
    from cgad.protocol.codec import decode, encode

    delta = torch.randn(numel, device=device) * 1e-3
    out: dict[str, Any] = {}
    for codec in CODECS:
        if deadline.left() < 30:
            out[codec] = {"skipped": "no time left"}
            continue
        encode_s, data = _timed(device, lambda c=codec: encode(delta, c))
        decode_s, back = _timed(device, lambda d=data: decode(d).to(device))
        out[codec] = {"encode_s": encode_s, "decode_s": decode_s, "bytes": len(data), "numel": back.numel()}
    return out


def nvidia_smi_sampler(peaks: dict[int, int]) -> Callable[[int], None]:
    """A sampler for scale.run_daemon: the GPU memory nvidia-smi reports for the pid, its peak."""

    def sample(pid: int) -> None:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10,
            ).stdout  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return
        for line in out.splitlines():
            fields = [f.strip() for f in line.split(",")]
            if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
                peaks[pid] = max(peaks.get(pid, 0), int(fields[1]) << 20)

    return sample


def exchange(scale: Any, settings: Any, device: str, workdir: Path, timeout: float) -> dict[str, Any]:
    """Two real daemons on loopback, B joining A, until each has applied a fragment of the
    other's or ``timeout`` seconds have passed; each one's status then."""
    from cgad.node.daemon.admin import call_admin

    workdir.mkdir(parents=True, exist_ok=True)
    nodes: list[tuple[subprocess.Popen, Path]] = []
    admins: list[str | None] = []
    started = time.monotonic()
    try:
        for name in ("a", "b"):
            log, maddrs = workdir / f"{name}.log", workdir / f"{name}.maddrs"
            flags = [
                "--model", settings.preset, "--batch-size", str(settings.batch_size), "--seq-len",
                str(settings.seq_len), "--inner-steps", str(settings.inner_steps), "--admin-port", "0",
                "--dashboard-port", "0", "--maddrs-file", str(maddrs), "--device", device,
                "--private-endpoints",  # both on 127.0.0.1
            ]  # fmt: skip
            if nodes:
                flags += ["--peers", *(workdir / "a.maddrs").read_text().split()]
            cmd = [sys.executable, "-m", "cgad.node.front.cli", "join", *flags]
            with log.open("w") as out:
                process = subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=scale._env(settings),
                    start_new_session=True,
                )
            nodes.append((process, log))
            admins.append(None)
            while not (
                maddrs.exists() and maddrs.read_text().strip() and scale._read_log(log, r"^admin\s+(\S+)")
            ):
                if process.poll() is not None or time.monotonic() - started > timeout:
                    raise RuntimeError(
                        f"node {name} did not start:\n{log.read_text(errors='replace')[-3000:]}"
                    )
                time.sleep(0.5)
            admins[-1] = scale._read_log(log, r"^admin\s+(\S+)")
        b_started = time.monotonic()
        statuses: list[dict[str, Any]] = [{}, {}]
        first_applied: dict[str, float] = {}
        while time.monotonic() - started < timeout:
            for k, ((process, log), admin) in enumerate(zip(nodes, admins, strict=True)):
                if process.poll() is not None:
                    raise RuntimeError(f"node {'ab'[k]} exited:\n{log.read_text(errors='replace')[-3000:]}")
                try:
                    statuses[k] = call_admin(admin, "Status", timeout=20)
                except ConnectionError:
                    continue
                if statuses[k].get("applied_by_peer") and "ab"[k] not in first_applied:
                    first_applied["ab"[k]] = time.monotonic() - b_started
            if len(first_applied) == 2:
                break
            time.sleep(2.0)
    finally:
        for (process, _), admin in zip(nodes, admins, strict=False):
            scale._stop(process, admin)
    keys = (
        "round", "applied", "applied_by_peer", "applied_by_age", "bytes_in", "bytes_out", "started_from",
        "replayed", "discarded", "tokens_per_second", "stall", "rejected", "sent_as", "device",
    )  # fmt: skip
    return {
        "both_applied": len(first_applied) == 2,
        "seconds_after_b_started_to_first_applied": first_applied,
        "nodes": {name: {k: s.get(k) for k in keys} for name, s in zip("ab", statuses, strict=True)},
        "seconds": time.monotonic() - started,
    }


def _part(record: dict[str, Any], name: str, deadline: Deadline, need: float, work: Callable[[], Any]) -> Any:
    """Run one part into ``record[name]``: skipped without ``need`` seconds left, its error kept."""
    if deadline.left() < need:
        record[name] = {"skipped": f"{deadline.left():.0f} s left, {need:.0f} needed"}
        return None
    start = time.monotonic()
    try:
        record[name] = work()
    except Exception as exc:  # a failed part is a finding, not the end of the check
        record[name] = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:]}
    if isinstance(record[name], dict):
        record[name]["part_seconds"] = time.monotonic() - start
    return record[name]


def check_preset(
    scale: Any, settings: Any, device: torch.device, deadline: Deadline, workdir: Path, say: Any
):
    """One preset's bare loop, outer step, codecs and lone daemon."""
    from cgad.node.training.model import build_model
    from cgad.node.training.tokenizer import load_tokenizer

    record: dict[str, Any] = {"preset": settings.preset}
    model = build_model(settings.preset, load_tokenizer(None).vocab_size, seed=0)  # on the host
    numel = record["parameters"] = sum(p.numel() for p in model.parameters())
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # the bare loop (16 B a parameter), then two members' θ, φ and outer state beside the model
        need = 40 * numel
        if need > free:
            return {**record, "skipped": f"needs about {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"}
        torch.cuda.reset_peak_memory_stats(device)
    held = [model.to(device)]  # emptied before the daemon runs, so that its memory is freed
    say(f"{settings.preset}: bare loop ...")
    bare = _part(
        record, "bare", deadline, 30, lambda: bare_loop(held[0], settings, 0.35 * settings.seconds, device)
    )
    say(f"{settings.preset}: outer step and codecs ...")
    _part(record, "outer_step", deadline, 30, lambda: outer_step(held[0], device, deadline))
    _part(record, "codecs", deadline, 30, lambda: codecs(numel, device, deadline))
    held.clear()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    say(f"{settings.preset}: lone daemon ...")
    peaks: dict[int, int] = {}
    lone = dataclasses.replace(settings, seconds=0.4 * settings.seconds, warmup=1)
    daemon = _part(
        record, "daemon", deadline, 60,
        lambda: scale.run_daemon(
            lone, workdir / settings.preset, deadline.left() - 10, extra=["--device", device.type],
            sample=nvidia_smi_sampler(peaks),
        ),
    )  # fmt: skip
    if daemon and "tokens_per_second" in daemon:
        daemon["peak_gpu_bytes"] = max(peaks.values(), default=None)
        if bare and bare.get("tokens_per_second"):
            record["tokens_ratio"] = daemon["tokens_per_second"] / bare["tokens_per_second"]
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="small,base,1b", help="comma-separated model presets")
    parser.add_argument("--seconds", type=float, default=60.0, help="about this long per preset")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the whole check")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--inner-steps", type=int, default=20, help="H")
    parser.add_argument(
        "--exchange-preset", default="small", help="the two-node exchange's model ('' skips it)"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch threads, all parts"
    )
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch sees none); it checks the GPU path and has nothing to "
              "measure on this machine. Nothing written.", flush=True)  # fmt: skip
        return 0
    deadline = Deadline(args.budget)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    scale = _scale()

    def say(line: str) -> None:
        print(f"[{datetime.now(UTC):%H:%M:%S}] {deadline.left():4.0f} s left  {line}", flush=True)

    def settings(preset: str) -> Any:
        return scale.Settings(
            preset, args.batch_size, args.seq_len, args.inner_steps, threads=args.threads,
            seconds=args.seconds, warmup=1, device=args.device,
        )  # fmt: skip

    record: dict[str, Any] = {
        "benchmark": "gpu_check",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **scale.tree_state(scale.ROOT),
        "machine": {**scale.machine(), "torch": torch.__version__, "cuda": torch.version.cuda},
        "gpu": _gpu(device),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "presets": [],
    }
    with tempfile.TemporaryDirectory(prefix="cgad-gpu-check-") as tmp:
        presets = [p.strip() for p in args.presets.split(",") if p.strip()]
        for k, preset in enumerate(presets):
            if deadline.left() < 90:
                record["presets"].append({"preset": preset, "skipped": f"{deadline.left():.0f} s left"})
            else:
                try:
                    found = check_preset(scale, settings(preset), device, deadline, Path(tmp), say)
                except Exception as exc:  # e.g. out of memory building the model: the next one still runs
                    found = {
                        "preset": preset,
                        "error": repr(exc),
                        "traceback": traceback.format_exc()[-4000:],
                    }
                record["presets"].append(found)
            _write(record, args.out)
            if k == 0 and args.exchange_preset:
                # right after the first preset: two daemons talking on the GPU matter more than 1b
                say(f"two-node exchange ({args.exchange_preset}) ...")
                _part(
                    record, "exchange", deadline, 60,
                    lambda: exchange(
                        scale, settings(args.exchange_preset), args.device, Path(tmp) / "exchange",
                        deadline.left() - 10,
                    ),
                )  # fmt: skip
                _write(record, args.out)
    _write(record, args.out)
    say(f"wrote {args.out}")
    for p in record["presets"]:
        ratio = p.get("tokens_ratio")
        say(f"{p['preset']}: " + (f"daemon/bare tokens/s {ratio:.3f}" if ratio else json.dumps(p)[:300]))
    return 0


def _gpu(device: torch.device) -> dict[str, Any] | None:
    if device.type != "cuda":
        return {"name": None, "note": f"run on {platform.processor() or 'the CPU'} (--device cpu)"}
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "memory_bytes": props.total_memory, "capability": [props.major, props.minor]}


def _write(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
