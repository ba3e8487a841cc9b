"""The default outer step on text it was never tuned on, with every flag at its default.

Everything in docs/RESULTS.md was tuned on the bundled Shakespeare. This runs the simulator on
other English: the Markdown files of the installed Python packages (READMEs, changelogs and docs
of hivemind, torch, transformers and the rest; the set follows the lockfile), gathered into one
folder in sorted order. The default method (`cga`: momentum following freshness, `--mixing auto`,
i.e. late gossip) against Nesterov (DiLoCo) and plain averaging (`sgd`), each at its default
outer lr, and each worker training alone (`local`), under random delays of 0 to 4 and 0 to 8
rounds, at H = 10 and H = 50. Default flags otherwise (tiny model, default tokenizer, batch, inner lr,
disjoint shards); 4 workers; seeds 0 and 1 (the sweeps tune on seed 100).

Writes bench/results/unseen_text.json and .png (final held-out loss per cell: mean and std), and
each run as it finishes to unseen_text.runs.jsonl; a rerun on the same corpus runs only the cells
that log lacks.

    python bench/unseen_text.py [--jobs 2] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sysconfig
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from cgad.node.front.progress import progress_bar

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "unseen_text.json"
RUNS = OUT.with_suffix(".runs.jsonl")
CORPUS = ROOT / "out" / "unseen_text"  # /out/ is git-ignored
METHODS = ("cga", "nesterov", "sgd", "local")
DELAYS = ("random:4", "random:8")  # uniform 0..M rounds: every delay up to 8
ROUNDS = {10: 30, 50: 10}  # H: rounds (300 and 500 inner steps per worker)
MIN_BYTES = 2_000  # shorter files are mostly badges and links


def gather_corpus() -> dict:
    """Copy every Markdown file of the installed packages into ``CORPUS``; what was gathered."""
    site = Path(sysconfig.get_paths()["purelib"])
    files = sorted(p for p in site.rglob("*.md") if p.is_file() and p.stat().st_size >= MIN_BYTES)
    CORPUS.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    total = 0
    for old in CORPUS.glob("*.md"):
        old.unlink()
    for n, path in enumerate(files):
        text = path.read_text(encoding="utf-8", errors="replace")
        digest.update(text.encode())
        total += len(text.encode())
        (CORPUS / f"{n:05d}.md").write_text(text, encoding="utf-8")
    return {"files": len(files), "bytes": total, "sha256": digest.hexdigest()}


def cells(seeds: list[int]) -> list[tuple[str, str, int, int]]:
    out = []
    for h in ROUNDS:
        for seed in seeds:
            out.append(("local", "0", h, seed))  # alone, the delay changes nothing
            out += [(method, delay, h, seed) for method in METHODS if method != "local" for delay in DELAYS]
    return out


def run_cell(cell: tuple[str, str, int, int]) -> dict:
    method, delay, h, seed = cell
    import torch

    from cgad.node.sim.config import SimConfig
    from cgad.node.sim.simulate import simulate
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer()
    config = SimConfig(
        workers=4, inner_steps=h, rounds=ROUNDS[h], delay=delay, optimizer=method, seed=seed, data=str(CORPUS)
    )
    record = simulate(config, load_dataset(tokenizer, CORPUS), tokenizer.vocab_size)
    return {
        "method": method,
        "delay": delay,
        "inner_steps": h,
        "seed": seed,
        "mixing": config.mixing,
        "outer_lr": record["config"]["outer_lr"],
        "final_loss": record["final_loss"],
        "initial_loss": record["initial_loss"],
        "losses": record["losses"],
        "diverged": record["diverged"],
    }


def summarise(results: list[dict]) -> list[dict]:
    """Mean, std and mean + std per (H, delay, method); local's cell stands in every delay."""
    rows = []
    for h in ROUNDS:
        for delay in DELAYS:
            for method in METHODS:
                want = "0" if method == "local" else delay
                losses = [
                    r["final_loss"]
                    for r in results
                    if (r["method"], r["delay"], r["inner_steps"]) == (method, want, h)
                ]
                if not losses:
                    continue
                mean = statistics.fmean(losses)
                std = statistics.stdev(losses) if len(losses) > 1 else 0.0
                rows.append({"inner_steps": h, "delay": delay, "method": method, "mean": mean, "std": std,
                             "risk": mean + std, "seeds": len(losses)})  # fmt: skip
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(h, d) for h in ROUNDS for d in DELAYS]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), sharey=True)
    for ax, (h, delay) in zip(axes, panels, strict=True):
        cell = [r for r in rows if r["inner_steps"] == h and r["delay"] == delay]
        colors = ["tab:green" if r["method"] == "cga" else "tab:gray" for r in cell]
        means, stds = [r["mean"] for r in cell], [r["std"] for r in cell]
        ax.bar([r["method"] for r in cell], means, yerr=stds, color=colors, capsize=4)
        ax.set_title(f"H = {h}, {delay}")
        low = min(r["mean"] - r["std"] for r in rows)
        ax.set_ylim(low - 0.1, max(r["mean"] + r["std"] for r in rows) + 0.05)
    axes[0].set_ylabel("final held-out loss (mean ± std)")
    fig.suptitle("Unseen text, default flags: cga (the default) against Nesterov, sgd and training alone")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def logged_runs(corpus: dict) -> list[dict]:
    """The runs already in the log, if it was written for this corpus (else a fresh, empty log)."""
    RUNS.parent.mkdir(parents=True, exist_ok=True)
    same_corpus = OUT.exists() and json.loads(OUT.read_text())["corpus"]["sha256"] == corpus["sha256"]
    if not (same_corpus and RUNS.exists()):
        RUNS.write_text("")
        return []
    return [json.loads(line) for line in RUNS.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    corpus = gather_corpus()
    print(f"corpus: {corpus['files']} Markdown files, {corpus['bytes'] / 1e6:.1f} MB")
    results = logged_runs(corpus)
    done = {(r["method"], r["delay"], r["inner_steps"], r["seed"]) for r in results}
    todo = [cell for cell in cells(args.seeds) if cell not in done]
    with ProcessPoolExecutor(args.jobs) as pool, progress_bar(len(todo), "unseen_text", "run") as bar:
        for future in as_completed([pool.submit(run_cell, cell) for cell in todo]):
            r = future.result()
            results.append(r)
            with RUNS.open("a") as log:  # kept as they finish: a stopped sweep keeps its runs
                log.write(json.dumps(r) + "\n")
            bar.write(
                f"H {r['inner_steps']} {r['delay']:9} {r['method']:9} seed {r['seed']}: {r['final_loss']:.3f}"
            )
            bar.update()
    results.sort(key=lambda r: (r["inner_steps"], r["delay"], METHODS.index(r["method"]), r["seed"]))
    rows = summarise(results)
    for r in rows:
        print(f"H {r['inner_steps']:>2} {r['delay']:9} {r['method']:9} {r['mean']:.3f} ± {r['std']:.3f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"corpus": corpus, "rows": rows, "runs": results}, indent=1) + "\n")
    plot(rows, OUT.with_suffix(".png"))
    print(f"wrote {OUT} and its PNG")


if __name__ == "__main__":
    main()
