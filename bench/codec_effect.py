"""Does what the exchange does to a pseudo-gradient cost the outer step anything? The simulator
with every pseudo-gradient passed through a codec (`--codec`: error feedback, as a daemon sends it)
against fp32, and with peers' deltas clipped around the own one (``--aggregation clip``, the
default) against the plain mean, all beside `local` (each worker alone) in the same run.

4 workers of the sweep model (bench/sweep_model.json, 1024-token BPE of the bundled corpus),
H = 10, batch 4 × 64, inner lr 1e-3, 30 rounds; `cga` at a fixed delay of 0 and 1 round. Writes
bench/results/codec_effect.json.

    python bench/codec_effect.py [--seeds 0] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from cgad.node.front.progress import progress_bar

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "codec_effect.json"
CELLS = [  # (codec, optimizer, delay, aggregation)
    ("fp32", "local", "0", "mean"),
    ("fp32", "cga", "0", "mean"),
    ("4bit", "cga", "0", "mean"),
    ("fp32", "cga", "1", "mean"),
    ("4bit", "cga", "1", "mean"),
    ("fp32", "cga", "0", "clip"),
    ("fp32", "cga", "1", "clip"),
    ("4bit", "cga", "1", "clip"),  # the daemon's defaults
    ("2bit", "cga", "0", "mean"),
    ("2bit", "cga", "1", "mean"),
    ("2bit", "cga", "1", "clip"),  # the daemon's defaults on a link too slow for 4bit
    ("sparse", "cga", "0", "mean"),
    ("sparse", "cga", "0", "clip"),
    ("sparse", "cga", "1", "clip"),  # top-k: 7x fewer bytes than 4bit
]
SPARSE_KEPT = 8  # values per block of 256 for the sparse cells (bench/sparse_density.py varies it)


def run_cell(cell: tuple[str, str, str, str, int]) -> dict:
    codec, optimizer, delay, aggregation, seed = cell
    import torch

    from cgad.node.sim.config import SimConfig
    from cgad.node.sim.simulate import simulate
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(None, vocab_size=1024)
    config = SimConfig(
        workers=4, inner_steps=10, rounds=30, batch_size=4, seq_len=64, eval_batches=4, inner_lr=1e-3,
        delay=delay, optimizer=optimizer, aggregation=aggregation, codec=codec, seed=seed,
        sparse_keep=SPARSE_KEPT,
        model=str(ROOT / "bench" / "sweep_model.json"),
    )  # fmt: skip
    record = simulate(config, load_dataset(tokenizer), tokenizer.vocab_size)
    return {
        "codec": codec,
        "optimizer": optimizer,
        "delay": delay,
        "aggregation": aggregation,
        "seed": seed,
        "final_loss": record["final_loss"],
        "clipped": record["clipped"],
        "bytes_sent": record["bytes_sent"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    cells = [(*cell, seed) for seed in args.seeds for cell in CELLS]
    results = []
    with (
        ProcessPoolExecutor(args.jobs) as pool,
        progress_bar(len(cells), "codec_effect", "run") as bar,
    ):
        for future in as_completed([pool.submit(run_cell, cell) for cell in cells]):
            results.append(future.result())
            bar.update()
    results.sort(
        key=lambda r: (r["seed"], CELLS.index((r["codec"], r["optimizer"], r["delay"], r["aggregation"])))
    )
    for r in results:
        print(
            f"{r['optimizer']:6} delay {r['delay']} {r['codec']:6} {r['aggregation']:5} seed {r['seed']}:"
            f" {r['final_loss']:.3f}"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"cells": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
