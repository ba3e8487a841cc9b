"""The daemon's training throughput against a bare PyTorch loop of the same model and batch.

Both run in this process, one after the other and then again in the opposite order (the
machine is shared: the medians of alternating repeats are compared). The daemon is a real
`Node`: network transport up (a swarm of one), outer steps with 4-bit encoding of every
pseudo-gradient, held-out evaluation every ``--eval-every`` rounds, checkpoints off. Throughput
counts inner-step tokens over the wall time of the whole run, outer steps included.

    python bench/overhead.py [--rounds 6] [--inner-steps 50] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cgad.bench.wan.provenance import tree_state
from cgad.node.config import JoinConfig
from cgad.node.daemon.node import Node
from cgad.node.training.data import load_dataset
from cgad.node.training.model import build_model
from cgad.node.training.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent

RESULT = Path(__file__).parent / "results" / "overhead.json"


def bare_loop(model_name: str, steps: int, batch: int, seq: int) -> tuple[float, float]:
    """Tokens per wall second and per CPU second of the plainest loop: forward, backward, clip,
    AdamW."""
    tokenizer = load_tokenizer(None)
    dataset = load_dataset(tokenizer)
    model = build_model(model_name, tokenizer.vocab_size, seed=0)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95), foreach=True
    )
    batches = dataset.shard(0, 1).batches(batch, seq, seed=1)
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        ids = next(batches)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    tokens = steps * batch * seq
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - start_cpu)


def daemon(
    model_name: str, rounds: int, inner_steps: int, batch: int, seq: int, eval_every: int
) -> tuple[float, float]:
    """The same per wall and CPU second (this process's threads, the transport's included)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = JoinConfig(
            run_id="overhead", model=model_name, inner_steps=inner_steps, batch_size=batch, seq_len=seq,
            max_rounds=rounds, eval_every=eval_every, maddrs_file=str(Path(tmp) / "maddrs"), admin_port=0,
        )  # fmt: skip
        node = Node(config)
        # from the first inner step on it is all training: start the clocks there
        start: dict[str, float] = {}
        inner_step = node.trainer.step

        def timed_step() -> float:
            if not start:
                start.update(wall=time.perf_counter(), cpu=time.process_time(), tokens=node.trainer.tokens)
            return inner_step()

        node.trainer.step = timed_step
        try:
            node.run()
            elapsed = time.perf_counter() - start["wall"]
            elapsed_cpu = time.process_time() - start["cpu"]
            tokens = node.trainer.tokens - start["tokens"]
            return tokens / elapsed, tokens / elapsed_cpu
        finally:
            node.close()


def main() -> None:
    ran = tree_state(ROOT)  # the code that runs: read before, so a run never ends unrecorded
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in both loops")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps = args.rounds * args.inner_steps
    runs: dict[str, list[tuple[float, float]]] = {"bare": [], "daemon": []}
    for i in range(args.repeats):
        for which in ("bare", "daemon") if i % 2 == 0 else ("daemon", "bare"):
            if which == "bare":
                runs[which].append(bare_loop(args.model, steps, args.batch_size, args.seq_len))
            else:
                shape = (
                    args.model,
                    args.rounds,
                    args.inner_steps,
                    args.batch_size,
                    args.seq_len,
                    args.eval_every,
                )
                runs[which].append(daemon(*shape))
            wall, cpu = runs[which][-1]
            print(
                f"repeat {i + 1}/{args.repeats} {which}: {wall:.0f} tokens/s, {cpu:.0f} tokens/CPU-s",
                flush=True,
            )

    def median(which: str, column: int) -> float:
        return statistics.median(r[column] for r in runs[which])

    result = {
        "benchmark": "overhead",
        "model": args.model,
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "batch": [args.batch_size, args.seq_len],
        "eval_every": args.eval_every,
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "bare_tokens_per_second": [r[0] for r in runs["bare"]],
        "daemon_tokens_per_second": [r[0] for r in runs["daemon"]],
        "bare_tokens_per_cpu_second": [r[1] for r in runs["bare"]],
        "daemon_tokens_per_cpu_second": [r[1] for r in runs["daemon"]],
        "median_ratio": median("daemon", 0) / median("bare", 0),
        "median_cpu_ratio": median("daemon", 1) / median("bare", 1),
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    result = {**ran, **result}
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    wall, cpu = result["median_ratio"], result["median_cpu_ratio"]
    print(
        f"daemon / bare loop: {wall:.3f} per wall second, {cpu:.3f} per CPU second (medians); wrote {RESULT}"
    )


if __name__ == "__main__":
    main()
