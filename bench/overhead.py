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
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cgad.node.config import NodeConfig
from cgad.node.daemon import Node
from cgad.node.data import load_dataset
from cgad.node.model import build_model
from cgad.node.tokenizer import load_tokenizer

RESULT = Path(__file__).parent / "results" / "overhead.json"


def bare_loop(model_name: str, steps: int, batch: int, seq: int) -> float:
    """Tokens per second of the plainest loop: forward, backward, clip, AdamW."""
    tokenizer = load_tokenizer(None)
    dataset = load_dataset(tokenizer)
    model = build_model(model_name, tokenizer.vocab_size, seed=0)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95), foreach=True
    )
    batches = dataset.shard(0, 1).batches(batch, seq, seed=1)
    start = time.perf_counter()
    for _ in range(steps):
        ids = next(batches)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps * batch * seq / (time.perf_counter() - start)


def daemon(model_name: str, rounds: int, inner_steps: int, batch: int, seq: int, eval_every: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        config = NodeConfig(
            run_id="overhead", model=model_name, inner_steps=inner_steps, batch_size=batch, seq_len=seq,
            max_rounds=rounds, eval_every=eval_every, maddrs_file=str(Path(tmp) / "maddrs"),
        )  # fmt: skip
        node = Node(config)
        try:
            node.run()
            elapsed = time.perf_counter() - node.training_started
            return (node.trainer.tokens - node.tokens_at_start) / elapsed
        finally:
            node.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    steps = args.rounds * args.inner_steps
    bare, node = [], []
    for i in range(args.repeats):
        order = ("bare", "node") if i % 2 == 0 else ("node", "bare")
        for which in order:
            if which == "bare":
                bare.append(bare_loop(args.model, steps, args.batch_size, args.seq_len))
            else:
                node.append(
                    daemon(
                        args.model,
                        args.rounds,
                        args.inner_steps,
                        args.batch_size,
                        args.seq_len,
                        args.eval_every,
                    )
                )
            latest = (bare if which == "bare" else node)[-1]
            print(f"repeat {i + 1}/{args.repeats} {which}: {latest:.0f} tokens/s", flush=True)
    result = {
        "benchmark": "overhead",
        "model": args.model,
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "batch": [args.batch_size, args.seq_len],
        "eval_every": args.eval_every,
        "threads": torch.get_num_threads(),
        "bare_tokens_per_second": bare,
        "daemon_tokens_per_second": node,
        "median_ratio": statistics.median(node) / statistics.median(bare),
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    ratio = result["median_ratio"]
    print(f"daemon / bare loop throughput: {ratio:.3f} (median of {args.repeats}); wrote {RESULT}")


if __name__ == "__main__":
    main()
