"""Time of one outer step: CGAD and PA-CGAD against torch.optim.Adam(foreach=True).

The parameter sets have the shapes of Llama models of about 25M and 100M parameters. Every
optimizer steps the same parameters with the same pseudo-gradient, interleaved repeat by repeat
(in rotating order) so that machine noise falls on all of them alike; we report medians and the
ratio to Adam's median.

    python bench/optim_step.py [--repeats 15] [--out bench/results/optim_step.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from cgad.bench.wan.provenance import tree_state
from cgad.optim import CGAD, PACGAD

ROOT = Path(__file__).resolve().parent.parent

# (hidden, layers, intermediate, vocab) of two Llama-style models with untied embeddings
SIZES = {"25M": (512, 6, 1376, 8192), "100M": (768, 12, 2048, 8192)}
FRAGMENTS = 4


def llama_shapes(hidden: int, layers: int, intermediate: int, vocab: int) -> list[tuple[int, ...]]:
    per_layer = [(hidden, hidden)] * 4 + [(intermediate, hidden)] * 2 + [(hidden, intermediate)]
    per_layer += [(hidden,), (hidden,)]  # the two RMSNorm weights
    return [(vocab, hidden)] + per_layer * layers + [(hidden,), (vocab, hidden)]


def make_params(shapes: list[tuple[int, ...]], seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen) * 0.01
        params.append(p)
    return params


def strided_fragments(params: list[torch.nn.Parameter], count: int) -> list[dict]:
    """Strided layer groups, as Streaming DiLoCo assigns fragments."""
    return [{"params": params[i::count]} for i in range(count)]


def measure(repeats: int, warmup: int) -> dict:
    """Wall time and this process's CPU time of each step. On a shared machine the CPU time is the
    steadier measure of cost (a preempted step accrues wall time, not CPU time)."""
    records = []
    for name, dims in SIZES.items():
        shapes = llama_shapes(*dims)
        contenders = {
            "adam": (torch.optim.Adam(make_params(shapes, 0), lr=1e-3, foreach=True), {}),
            "cgad_age0": (CGAD(make_params(shapes, 0), lr=1e-3), {"age": 0}),
            "cgad_age2": (CGAD(make_params(shapes, 0), lr=1e-3), {"age": 2}),
            "pacgad": (
                PACGAD(strided_fragments(make_params(shapes, 0), FRAGMENTS), lr=1e-3),
                {"ages": [0, 1, 2, 3]},
            ),
        }
        numel = sum(p.numel() for p in contenders["adam"][0].param_groups[0]["params"])
        times: dict[str, list[float]] = {k: [] for k in contenders}
        cpu: dict[str, list[float]] = {k: [] for k in contenders}
        for i in tqdm(range(warmup + repeats), desc=f"{name} ({numel / 1e6:.1f}M params)", leave=False):
            # rotate who goes first, so a cold cache or a noisy neighbour hits everyone alike
            keys = list(contenders)
            for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
                opt, kwargs = contenders[key]
                start, start_cpu = time.perf_counter(), time.process_time()
                opt.step(**kwargs)
                elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
                if i >= warmup:
                    times[key].append(elapsed)
                    cpu[key].append(elapsed_cpu)
        medians = {k: statistics.median(v) for k, v in times.items()}
        cpu_medians = {k: statistics.median(v) for k, v in cpu.items()}
        record = {
            "size": name,
            "parameters": numel,
            "median_seconds": medians,
            "median_cpu_seconds": cpu_medians,
            "ratio_to_adam": {k: medians[k] / medians["adam"] for k in medians if k != "adam"},
            "cpu_ratio_to_adam": {
                k: cpu_medians[k] / cpu_medians["adam"] for k in cpu_medians if k != "adam"
            },
        }
        records.append(record)
        print(
            f"{name:>5} {numel / 1e6:6.1f}M  adam {medians['adam'] * 1e3:7.1f} ms  wall "
            + "  ".join(f"{k} {v:.3f}x" for k, v in record["ratio_to_adam"].items())
            + "  cpu "
            + "  ".join(f"{k} {v:.3f}x" for k, v in record["cpu_ratio_to_adam"].items())
        )
    return {
        "benchmark": "optim_step",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "repeats": repeats,
        "records": records,
    }


def main() -> None:
    ran = tree_state(ROOT)  # the code that runs: read before, so a run never ends unrecorded
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time = work done)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "optim_step.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(args.repeats, args.warmup)
    result["load_average"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {**ran, **result}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
