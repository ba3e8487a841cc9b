"""Time of "every worker takes one inner step" in the virtual swarm: a loop over W model replicas
(what ``simulate`` does today through ``InnerTrainer.step``) against one batched step over
parameters stacked along a leading worker dimension.

The batched step runs ``torch.func.functional_call`` of one ``tiny`` Llama under ``torch.vmap``
over (stacked parameters, stacked batches), sums the W losses, runs one backward, clips each
worker's gradient by its own norm, and takes ONE AdamW step over the stacked parameters. AdamW is
elementwise, so that step equals W separate AdamWs; a numerical check on real shards against the
loop (same initial weights, same batches, a few steps) reports the largest difference.

Two batched variants: attention through sdpa (the model's default; under vmap its CPU kernel has
no batching rule, so PyTorch falls back to a per-worker loop for it) and through eager attention
(plain matmuls and softmax, which vmap batches).

Contenders and thread counts are interleaved round by round, in rotating order, so that machine
noise falls on all of them alike; we report medians (and minima) and the ratio batched / loop.

    python bench/inner_batching.py [--repeats 7] [--out bench/results/inner_batching.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor
from torch.func import functional_call

from cgad.bench.wan.provenance import tree_state
from cgad.node.training.data import load_dataset
from cgad.node.training.model import build_model
from cgad.node.training.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent

# InnerTrainer's defaults
LR, WEIGHT_DECAY, BETAS, CLIP = 4e-4, 0.1, (0.9, 0.95), 1.0
WORKERS = (2, 4, 8)
SHAPES = ((4, 64), (8, 128))  # (batch, sequence length)
THREADS = (1, 2)
CONTENDERS = ("loop", "batched_sdpa", "batched_eager")
MIN_REPEATS = 3


def adamw(params: list[Tensor]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, foreach=True)


class LoopStep:
    """Today's simulator: one replica and one AdamW per worker, stepped one after the other."""

    def __init__(self, models: list[torch.nn.Module]) -> None:
        self.models = models
        self.optimizers = [adamw(list(m.parameters())) for m in models]
        self.grad_norms: list[float] = []

    def step(self, batches: list[Tensor]) -> list[float]:
        losses, self.grad_norms = [], []
        for model, optimizer, input_ids in zip(self.models, self.optimizers, batches, strict=True):
            model.train()
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            self.grad_norms.append(float(norm))
        return losses

    def worker_params(self, w: int) -> list[Tensor]:
        return [p.detach() for p in self.models[w].parameters()]


class BatchedStep:
    """All workers at once: stacked leaf parameters [W, ...], vmap(functional_call), one AdamW."""

    def __init__(self, models: list[torch.nn.Module], attn_implementation: str) -> None:
        # One module supplies the structure (and its buffers: the rotary frequencies); its own
        # parameters are never used. Tied embeddings: named_parameters() lists the shared tensor
        # once, and functional_call (tie_weights=True) feeds it to lm_head as well.
        self.template = copy.deepcopy(models[0])
        self.template.config._attn_implementation = attn_implementation
        self.template.train()
        self.names = [name for name, _ in self.template.named_parameters()]
        per_model = [dict(m.named_parameters()) for m in models]
        self.params = [
            torch.stack([p[name].detach() for p in per_model]).requires_grad_() for name in self.names
        ]
        self.optimizer = adamw(self.params)
        self.grad_norms: list[float] = []

        def loss_of(params: tuple[Tensor, ...], input_ids: Tensor) -> Tensor:
            named = dict(zip(self.names, params, strict=True))
            return functional_call(
                self.template, named, (), {"input_ids": input_ids, "labels": input_ids}
            ).loss

        self.losses_of = torch.vmap(loss_of)

    def step(self, batches: list[Tensor]) -> list[float]:
        losses = self.losses_of(tuple(self.params), torch.stack(batches))
        # The workers' losses depend on disjoint parameters: the gradient of their sum is each
        # worker's own gradient.
        losses.sum().backward()
        grads = [p.grad for p in self.params]
        # clip_grad_norm_ per worker: the 2-norm over all of one worker's gradients.
        per_param = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads])
        norms = torch.linalg.vector_norm(per_param, dim=0)
        coef = (CLIP / (norms + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_norms = norms.tolist()
        return losses.detach().tolist()

    def worker_params(self, w: int) -> list[Tensor]:
        """Worker w's parameters as views into the stacked ones (writes through)."""
        return [p.detach()[w] for p in self.params]


def make(kind: str, models: list[torch.nn.Module]) -> LoopStep | BatchedStep:
    """ "loop" (sdpa, as the simulator runs), "loop_eager", "batched_sdpa" or "batched_eager"."""
    if kind.startswith("batched_"):
        return BatchedStep(models, kind.removeprefix("batched_"))
    if kind == "loop_eager":
        for m in models:
            m.config._attn_implementation = "eager"
    return LoopStep(models)


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest |a - b| over two [steps][workers] tables."""
    return max(abs(x - y) for row, ref in zip(a, b, strict=True) for x, y in zip(row, ref, strict=True))


def check(dataset, vocab: int, workers: int, batch: int, seq: int, steps: int) -> dict:
    """Loop against batched from the same weights (a different seed per worker) on real shards.

    Each batched variant is compared with the loop (sdpa, what the simulator runs) and with a loop
    using the same attention implementation: eager and sdpa attention differ in float rounding,
    which Adam's first steps (update ~ sign of the gradient) amplify where gradients are ~0.
    """
    record: dict = {"workers": workers, "batch": batch, "seq_len": seq, "steps": steps}
    streams = {}
    for kind in ("loop", "loop_eager", *CONTENDERS[1:]):
        models = [build_model("tiny", vocab, seed=w) for w in range(workers)]
        initial = [[p.detach().clone() for p in m.parameters()] for m in models]
        batches = [dataset.shard(w, workers).batches(batch, seq, seed=0) for w in range(workers)]
        runner = make(kind, models)
        losses, norms = [], []
        for _ in range(steps):
            losses.append(runner.step([next(b) for b in batches]))
            norms.append(runner.grad_norms)
        params = [runner.worker_params(w) for w in range(workers)]
        streams[kind] = (losses, norms, params)
    ref_losses, ref_norms, ref_params = streams["loop"]
    record["loop_max_param_change"] = max(
        float((p - q).abs().max())
        for w in range(workers)
        for p, q in zip(ref_params[w], initial[w], strict=True)
    )
    record["loop_grad_norms"] = ref_norms
    record["loop_losses"] = ref_losses
    for kind, reference in (
        ("loop_eager", "loop"),
        ("batched_sdpa", "loop"),
        ("batched_eager", "loop"),
        ("batched_eager", "loop_eager"),
    ):
        losses, norms, params = streams[kind]
        ref_losses, ref_norms, ref_params = streams[reference]
        record[f"{kind}_vs_{reference}"] = {
            "max_abs_param_diff": max(
                float((p - q).abs().max())
                for w in range(workers)
                for p, q in zip(params[w], ref_params[w], strict=True)
            ),
            "max_abs_loss_diff": max_diff(losses, ref_losses),
            "max_abs_grad_norm_diff": max_diff(norms, ref_norms),
        }
    return record


def time_config(
    vocab: int, workers: int, batch: int, seq: int, repeats: int, warmup: int, budget: float
) -> list[dict]:
    """One record per thread count. Every (contender, thread count) pair is interleaved round by
    round, in rotating order, so that a busy neighbour falls on all of them alike. Rounds stop
    early (after at least MIN_REPEATS) once they outrun `budget` seconds, so that the whole run
    fits in ten minutes on a busy machine."""
    gen = torch.Generator().manual_seed(workers * 1000 + seq)
    pool = [[torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(workers)] for _ in range(4)]
    base = build_model("tiny", vocab, seed=0)
    # One runner per pair: the same weights and AdamW states would otherwise be stepped by both.
    pairs = [(kind, threads) for threads in THREADS for kind in CONTENDERS]
    runners: dict[tuple[str, int], Callable[[list[Tensor]], list[float]]] = {
        pair: make(pair[0], [copy.deepcopy(base) for _ in range(workers)]).step for pair in pairs
    }
    times: dict[tuple[str, int], list[float]] = {pair: [] for pair in pairs}
    started = time.perf_counter()
    for i in range(warmup + repeats):
        if i >= warmup + MIN_REPEATS and time.perf_counter() - started > budget:
            break
        for pair in pairs[i % len(pairs) :] + pairs[: i % len(pairs)]:
            torch.set_num_threads(pair[1])
            start = time.perf_counter()
            runners[pair](pool[i % len(pool)])
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[pair].append(elapsed)
    records = []
    for threads in THREADS:
        seconds = {kind: times[kind, threads] for kind in CONTENDERS}
        medians = {k: statistics.median(v) for k, v in seconds.items()}
        minima = {k: min(v) for k, v in seconds.items()}
        records.append(
            {
                "workers": workers,
                "batch": batch,
                "seq_len": seq,
                "threads": threads,
                "repeats": len(seconds["loop"]),
                "median_seconds": medians,
                "min_seconds": minima,
                "ratio_to_loop": {k: medians[k] / medians["loop"] for k in CONTENDERS[1:]},
                "ratio_to_loop_of_minima": {k: minima[k] / minima["loop"] for k in CONTENDERS[1:]},
                "seconds": seconds,
            }
        )
    return records


def best_settings(records: list[dict]) -> list[dict]:
    """Per (workers, shape): the fastest loop and the fastest batched step over thread counts."""
    out = []
    for workers in WORKERS:
        for batch, seq in SHAPES:
            rows = [r for r in records if (r["workers"], r["batch"], r["seq_len"]) == (workers, batch, seq)]
            loop = min((r["median_seconds"]["loop"], r["threads"], "loop") for r in rows)
            batched = min((r["median_seconds"][k], r["threads"], k) for r in rows for k in CONTENDERS[1:])
            out.append(
                {
                    "workers": workers,
                    "batch": batch,
                    "seq_len": seq,
                    "best_loop": {"threads": loop[1], "median_seconds": loop[0]},
                    "best_batched": {"kind": batched[2], "threads": batched[1], "median_seconds": batched[0]},
                    "ratio_best_batched_to_best_loop": batched[0] / loop[0],
                }
            )
    return out


def measure(repeats: int, warmup: int, check_steps: int, budget: float) -> dict:
    load_before = os.getloadavg()
    tokenizer = load_tokenizer(None)
    dataset = load_dataset(tokenizer)
    vocab = tokenizer.vocab_size
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.set_num_threads(1)
        checks = [check(dataset, vocab, 4, 4, 64, check_steps)]
    notes += sorted({str(w.message) for w in caught})
    for c in checks:
        print(
            f"check W={c['workers']} {c['batch']}x{c['seq_len']}, {c['steps']} steps "
            f"(loop moved params by up to {c['loop_max_param_change']:.2e}; "
            f"pre-clip grad norms {min(min(n) for n in c['loop_grad_norms']):.2f}.."
            f"{max(max(n) for n in c['loop_grad_norms']):.2f}, clip {CLIP})"
        )
        for k, v in c.items():
            if k.endswith(("_vs_loop", "_vs_loop_eager")):
                print(
                    f"  {k:<28} max|dparam| {v['max_abs_param_diff']:.2e}  "
                    f"max|dloss| {v['max_abs_loss_diff']:.2e}  max|dnorm| {v['max_abs_grad_norm_diff']:.2e}"
                )
    records = []
    print(
        "median ms per step of all W workers (min in brackets); ratios of medians\n"
        f"{'thr':>3} {'W':>2} {'shape':>7} {'loop ms':>15} {'sdpa ms':>15} {'eager ms':>15} "
        f"{'sdpa/loop':>10} {'eager/loop':>10} {'rounds':>6}"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch, seq in SHAPES:
            for workers in WORKERS:
                for r in time_config(vocab, workers, batch, seq, repeats, warmup, budget):
                    records.append(r)
                    m, lo, q = r["median_seconds"], r["min_seconds"], r["ratio_to_loop"]
                    cells = " ".join(f"{m[k] * 1e3:7.0f} [{lo[k] * 1e3:5.0f}]" for k in CONTENDERS)
                    print(
                        f"{r['threads']:>3} {workers:>2} {f'{batch}x{seq}':>7} {cells} "
                        f"{q['batched_sdpa']:10.3f} {q['batched_eager']:10.3f} {r['repeats']:>6}",
                        flush=True,
                    )
    best = best_settings(records)
    print("fastest over thread counts (medians):")
    for b in best:
        print(
            f"  W={b['workers']} {b['batch']}x{b['seq_len']}: loop@{b['best_loop']['threads']} "
            f"{b['best_loop']['median_seconds'] * 1e3:.0f} ms, {b['best_batched']['kind']}@"
            f"{b['best_batched']['threads']} {b['best_batched']['median_seconds'] * 1e3:.0f} ms, "
            f"ratio {b['ratio_best_batched_to_best_loop']:.3f}"
        )
    return {
        "benchmark": "inner_batching",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "model": "tiny",
        "vocab_size": vocab,
        "repeats": repeats,
        "warmup": warmup,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "notes": notes,
        "checks": checks,
        "best": best,
        "records": records,
    }


def main() -> None:
    ran = tree_state(ROOT)  # the code that runs: read before, so a run never ends unrecorded
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--check-steps", type=int, default=5)
    parser.add_argument("--config-budget", type=float, default=45.0, help="seconds per (W, shape)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "inner_batching.json")
    args = parser.parse_args()
    result = measure(args.repeats, args.warmup, args.check_steps, args.config_budget)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {**ran, **result}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
