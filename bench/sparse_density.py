"""How many values per block must ``sparse`` send? The simulator with every pseudo-gradient passed
through ``--codec sparse`` at k = 8, 16 and 32 values per block of 256 (error feedback, the node
judging its peers against its own Δ as sent, as a daemon does) against 4bit and against each worker
training alone (`local`), in the same run.

A coordinate waits about 256/k rounds in the residual, so what k costs depends on the run's
rounds: H = 10 over 150 rounds and H = 50 over 30 (the same 1500 inner steps per worker; a
10-minute testbed run of the tiny model has about those rounds). 4 workers of the sweep model,
batch 4 × 64, inner lr 1e-3, every worker sampling the whole corpus (as daemons do), no delay.
Writes bench/results/sparse_density.json.

    python bench/sparse_density.py [--seeds 0] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from cgad.node.front.progress import progress_bar

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "sparse_density.json"
SETTINGS = [(10, 150), (50, 30)]  # (H, rounds)
CODECS = [("local", 0), ("4bit", 0), ("sparse", 8), ("sparse", 16), ("sparse", 32)]


def run_cell(cell: tuple[int, int, str, int, int]) -> dict:
    inner_steps, rounds, codec, kept, seed = cell
    import torch

    from cgad.node.sim.config import SimConfig
    from cgad.node.sim.simulate import simulate
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(None, vocab_size=1024)
    config = SimConfig(
        workers=4, inner_steps=inner_steps, rounds=rounds, batch_size=4, seq_len=64, eval_batches=4,
        inner_lr=1e-3, data_split="shared", seed=seed, model=str(ROOT / "bench" / "sweep_model.json"),
        optimizer="local" if codec == "local" else "cga", codec="fp32" if codec == "local" else codec,
        sparse_keep=kept or 16,
    )  # fmt: skip
    record = simulate(config, load_dataset(tokenizer), tokenizer.vocab_size)
    return {
        "inner_steps": inner_steps,
        "rounds": rounds,
        "codec": codec,
        "kept": kept or None,
        "seed": seed,
        "final_loss": record["final_loss"],
        "bytes_sent": record["bytes_sent"],
        "clipped": record["clipped"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    cells = [(h, r, c, k, s) for s in args.seeds for h, r in SETTINGS for c, k in CODECS]
    results = []
    with (
        ProcessPoolExecutor(args.jobs) as pool,
        progress_bar(len(cells), "sparse_density", "run") as bar,
    ):
        for future in as_completed([pool.submit(run_cell, cell) for cell in cells]):
            results.append(future.result())
            bar.update()
    results.sort(key=lambda r: (r["seed"], r["inner_steps"], CODECS.index((r["codec"], r["kept"] or 0))))
    for r in results:
        name = f"sparse k={r['kept']}" if r["kept"] else r["codec"]
        setting = f"H = {r['inner_steps']:2}, {r['rounds']:3} rounds"
        print(f"{setting}, {name:12} seed {r['seed']}: {r['final_loss']:.3f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"cells": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
