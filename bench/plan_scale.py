"""What a 1B and a 7B swarm would move and hold: a plan computed from the wire format and the
member's buffers, with every assumption named (issue 28, point 5).

Nothing here is measured on a 1B or 7B model: the bytes per parameter are the codecs' exact
encoded sizes (``protocol/codec.py: encoded_size``), the snapshot's is the int8 snapshot's, and
the host memory is the sum of the model-sized buffers a member holds (listed in
``HOST_BUFFERS``, each with where it lives in the code). The compute side is an assumption: a
GPU's dense bf16 peak at a given model-FLOPs utilisation, 6 N FLOPs per trained token. Where a
measured figure exists (``bench/results/join.json``: the snapshot's bytes per parameter and the
download's rate against the link's) it is printed beside the computed one.

Writes ``bench/results/plan_1b_7b.json`` and prints the tables that docs/SCALE.md quotes.

    python bench/plan_scale.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from cgad.protocol.codec import encoded_size

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

MODELS = {"1b": 981_534_720, "7b": 6_738_415_616}  # the 1b preset at a 4096 vocabulary; Llama-2-7B's count
LINKS_MBIT = (10, 100, 1000)
CODECS = ("fp16", "int8", "4bit", "2bit", "sparse")
FAN_IN = 4  # --fan-in: peers' deltas a member takes per fragment and round
# assumptions on the compute side
GPUS = {"A100": 312e12, "H100": 989e12}  # dense bf16 peak FLOP/s
MFU = 0.40
TOKENS_PER_STEP = 8 * 2048  # batch 8 of 2048 tokens

# model-sized buffers a member holds in host memory beside the inner loop (bytes per parameter),
# as the code stands, and as planned (the buffers the method needs: φ, its momentum, one delta)
HOST_BUFFERS = {
    "phi (OuterLoop.phi, fp32)": (4.0, 4.0),
    "outer momentum (the method's optimizer state, fp32)": (4.0, 4.0),
    "phi0 for int8 snapshots (Phi0, int8 blocks)": (1.02, 1.02),
    "own delta until the outer step (OuterLoop._turn)": (4.0, 4.0),
    "yardstick for clipping (sender.Yardstick: built at a step that judges, from what is held)": (0.0, 0.0),
    "error feedback residual (protocol/feedback.py, bfloat16)": (2.0, 2.0),
    "own delta as sent (Sender._sent: the store's encoded bytes)": (0.0, 0.0),
    "peers' deltas decoded, up to fan-in (the inbox)": (4.0 * FAN_IN, 0.0),
    "peers' deltas encoded, up to fan-in (planned: decoded one at a time)": (0.0, 0.5625 * FAN_IN),
    "own encoded deltas kept to serve (store, keep_versions 2, 4bit)": (2 * 0.5625, 2 * 0.5625),
    # at most keep_reserved 8 per fragment, and each publisher's 2 newest versions: 8 at a full fan-in
    "peers' deltas kept to serve onward (store, 2 versions x fan-in, 4bit)": (
        2 * FAN_IN * 0.5625,
        2 * FAN_IN * 0.5625,
    ),
    "snapshots kept to serve (two own, int8)": (2 * 1.016, 2 * 1.016),
    # while --mixing late sends phi (the peers' deltas came late): the two newest versions, fp32
    "own phi kept to measure drift at (Mixer.published, 2 versions)": (8.0, 8.0),
    # planned: the kept phi a view of these served bytes (fp32 on the wire): one copy, not two
    "own phi as published for mixing (store, keep_versions 2, fp32)": (8.0, 0.0),
}


def per_parameter(codec: str) -> float:
    return encoded_size(1_000_000, codec) / 1e6


def plan() -> dict[str, Any]:
    rows = []
    now_bytes = sum(now for now, _ in HOST_BUFFERS.values())
    planned_bytes = sum(planned for _, planned in HOST_BUFFERS.values())
    for name, params in MODELS.items():
        snapshot = params * per_parameter("int8")
        for gpu, peak in GPUS.items():
            tokens_per_second = MFU * peak / (6 * params)
            step = TOKENS_PER_STEP / tokens_per_second
            for mbit in LINKS_MBIT:
                rate = mbit * 1e6 / 8
                for codec in CODECS:
                    delta = params * per_parameter(codec)
                    # a round brings up to FAN_IN peers' deltas down and sends about as many up
                    exchange = FAN_IN * delta / rate
                    rows.append({
                        "model": name, "parameters": params, "gpu": gpu, "link_mbit": mbit,
                        "codec": codec, "delta_bytes": delta, "round_bytes_down": FAN_IN * delta,
                        "exchange_seconds": exchange, "step_seconds": step,
                        "h_to_hide_exchange": max(1, math.ceil(exchange / step)),
                        "snapshot_bytes": snapshot, "join_seconds": snapshot / rate,
                    })  # fmt: skip
    memory = {
        name: {
            "host_gb_now": params * now_bytes / 1e9,
            "host_gb_planned": params * planned_bytes / 1e9,
            "inner_loop_gb": params * 16 / 1e9,  # fp32 weights, gradients, AdamW (on the GPU)
        }
        for name, params in MODELS.items()
    }
    buffers = {k: {"now": a, "planned": b} for k, (a, b) in HOST_BUFFERS.items()}
    measured = RESULTS / "join.json"
    join = json.loads(measured.read_text())["summary"] if measured.exists() else None
    return {
        "assumptions": {
            "fan_in": FAN_IN, "gpus_peak_flops": GPUS, "mfu": MFU, "tokens_per_step": TOKENS_PER_STEP,
            "flops_per_token": "6 N", "links_mbit": LINKS_MBIT,
        },
        "host_buffers_bytes_per_parameter": buffers,
        "host_bytes_per_parameter": {"now": now_bytes, "planned": planned_bytes},
        "memory": memory,
        "rows": rows,
        "measured_join_small": join,
    }  # fmt: skip


def main() -> None:
    result = plan()
    (RESULTS / "plan_1b_7b.json").write_text(json.dumps(result, indent=1))
    print("| model | GPU | step s | link | codec | MB per Δ | exchange s per round | H to hide it | join |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        if row["codec"] not in ("4bit", "sparse"):
            continue
        r = row
        print(
            f"| {r['model']} | {r['gpu']} | {r['step_seconds']:.2f} | {r['link_mbit']} Mbit | {r['codec']}"
            f" | {r['delta_bytes'] / 1e6:,.0f} | {r['exchange_seconds']:,.0f} | {r['h_to_hide_exchange']:,}"
            f" | {r['snapshot_bytes'] / 1e9:.2f} GB, {r['join_seconds'] / 60:,.1f} min |"
        )
    print()
    for name, memory in result["memory"].items():
        print(name, {k: round(v, 1) for k, v in memory.items()})
    print(result["host_bytes_per_parameter"])


if __name__ == "__main__":
    main()
