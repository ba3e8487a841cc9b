"""Fragment transfer between two peers on loopback, per codec and path, against a raw TCP socket.

A publisher peer runs in a child process (its own interpreter, gRPC server and p2pd), the fetcher
in this one. For each fragment size (fp32 bytes before encoding) and codec, the publisher encodes
a random tensor and holds the bytes; the fetcher pulls them over each path (``grpc``: a direct
gRPC stream; ``libp2p``: hivemind's libp2p protobuf stream through both p2pd daemons), checking
the sha256 on the way as the transport always does. In the same run the child sends the same
number of bytes over a plain TCP socket on loopback: that is the ceiling the ratios refer to.
Each number is the median of ``--repeats``, interleaved (raw, grpc, libp2p, raw, ...) so that
machine noise falls on all alike.

``cpu_seconds_per_gb`` is the CPU time of every process involved (both Python processes and both
p2pd daemons) per GB of encoded bytes delivered: what a transfer takes from training.
The codec table times ``encode`` and ``decode`` of the 64 MB fp32 tensor (GB/s of fp32 input;
CPU seconds per GB of fp32 input, summed over torch's threads) on one torch thread, as the
transport runs them, and again on two.

    python bench/transfer.py [--repeats 5] [--sizes-mb 64 256] [--out bench/results/transfer.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

import hivemind
import torch

from cgad.bench.wan.provenance import tree_state
from cgad.protocol.codec import Codec, decode, encode
from cgad.protocol.config import PATHS, NetworkOptions
from cgad.protocol.network import NetworkTransport
from cgad.protocol.records import Holdings
from cgad.protocol.transport import FragmentKey
from cgad.protocol.wire import content_hash

ROOT = Path(__file__).resolve().parent.parent

RUN = "bench"
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes, all their threads included."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICKS


def _transport(**overrides: object) -> NetworkTransport:
    return NetworkTransport(NetworkOptions(run_id=RUN, **overrides), num_fragments=1, fragment_numel={})


def publisher(initial_peers: list[str], commands: Connection) -> None:
    """The child: holds encoded fragments for the fetcher, and sends raw bytes on request."""
    transport = _transport(peers=initial_peers, keep_versions=1)
    assert transport.p2p is not None
    commands.send((transport.peer_id, transport.grpc_endpoint, transport.p2p._child.pid))
    data = b""
    while True:
        command, *args = commands.recv()
        if command == "publish":
            numel, codec = args
            data = encode(torch.randn(numel) * 0.01, codec)
            key = FragmentKey(RUN, 0, 0, transport.peer_id)
            transport.publish_encoded(key, data, codec=Codec(codec), numel=numel, tokens=0)
            digest = content_hash(data)
            while transport.store.get(digest) is None:  # the store is filled on the transport's loop
                time.sleep(0.01)
            commands.send((digest, len(data)))
        elif command == "raw":
            with socket.create_server(("127.0.0.1", 0)) as server:
                commands.send(server.getsockname()[1])
                connection, _ = server.accept()
                with connection:
                    connection.sendall(memoryview(data))
        elif command == "stop":
            transport.close()
            return


def raw_socket_seconds(commands: Connection, nbytes: int, buffer: bytearray) -> float:
    commands.send(("raw",))
    port = commands.recv()
    view = memoryview(buffer)[:nbytes]
    with socket.create_connection(("127.0.0.1", port)) as connection:
        start = time.perf_counter()
        received = 0
        while received < nbytes:
            count = connection.recv_into(view[received:])
            if count == 0:
                raise ConnectionError("raw sender stopped early")
            received += count
        return time.perf_counter() - start


def codec_speeds(numel: int, repeats: int, threads: int) -> list[dict]:
    """Encode and decode speeds on a thread that runs ``threads`` torch threads (the transport
    runs its codec work on one)."""
    with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,)) as worker:
        return worker.submit(_codec_speeds, numel, repeats).result()


def _codec_speeds(numel: int, repeats: int) -> list[dict]:
    x = torch.randn(numel) * 0.01
    rows = []
    for codec in Codec:
        encode_times, decode_times = [], []
        data = encode(x, codec)  # warm the per-thread scratch buffers
        decode(data)
        encode_cpu = decode_cpu = 0.0
        for _ in range(repeats):
            start, cpu = time.perf_counter(), time.process_time()
            data = encode(x, codec)
            encode_times.append(time.perf_counter() - start)
            encode_cpu += time.process_time() - cpu
            start, cpu = time.perf_counter(), time.process_time()
            decode(data)
            decode_times.append(time.perf_counter() - start)
            decode_cpu += time.process_time() - cpu
        gb = numel * 4 / 1e9
        rows.append(
            {
                "codec": str(codec),
                "encode_gb_per_s": round(gb / statistics.median(encode_times), 3),
                "decode_gb_per_s": round(gb / statistics.median(decode_times), 3),
                # the fastest repeat: the least disturbed by other work on the machine
                "encode_gb_per_s_best": round(gb / min(encode_times), 3),
                "decode_gb_per_s_best": round(gb / min(decode_times), 3),
                "encode_cpu_seconds_per_gb": round(encode_cpu / (repeats * gb), 3),
                "decode_cpu_seconds_per_gb": round(decode_cpu / (repeats * gb), 3),
                "encoded_bytes": len(data),
            }
        )
        print(f"codec {codec:>4} ({torch.get_num_threads()} thread): {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ran = tree_state(ROOT)  # the code that runs: read before, so a run never ends unrecorded
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--codec-repeats", type=int, default=7)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "transfer.json")
    args = parser.parse_args()

    load_before = os.getloadavg()
    codecs = codec_speeds(64 * 2**20 // 4, args.codec_repeats, threads=1)
    codecs_two_threads = codec_speeds(64 * 2**20 // 4, args.codec_repeats, threads=2)

    fetcher = _transport()
    parent_end, child_end = multiprocessing.get_context("spawn").Pipe()
    child = multiprocessing.get_context("spawn").Process(
        target=publisher, args=(fetcher.maddrs(), child_end), daemon=True
    )
    child.start()
    records = []
    try:
        peer_id, endpoint, child_daemon = parent_end.recv()
        assert fetcher.p2p is not None
        pids = [os.getpid(), child.pid, fetcher.p2p._child.pid, child_daemon]
        holder = Holdings(peer_id=peer_id, grpc=endpoint, offers=[])
        buffer = bytearray(max(args.sizes_mb) * 2**20 + 2**20)
        steps = len(args.sizes_mb) * len(Codec)
        for step, (size_mb, codec) in enumerate(((s, c) for s in args.sizes_mb for c in Codec), 1):
            size_bytes = size_mb * 2**20
            parent_end.send(("publish", size_bytes // 4, str(codec)))
            digest, length = parent_end.recv()
            seconds: dict[str, list[float]] = {path: [] for path in ("raw", *PATHS)}
            cpu: dict[str, list[float]] = {path: [] for path in ("raw", *PATHS)}
            for _ in range(args.repeats):
                for path in ("raw", *PATHS):
                    cpu_before = cpu_seconds(pids)
                    if path == "raw":
                        elapsed = raw_socket_seconds(parent_end, length, buffer)
                    else:
                        start = time.perf_counter()
                        data = fetcher.download(holder, digest, length, path)
                        elapsed = time.perf_counter() - start
                        assert len(data) == length
                        del data
                    cpu[path].append(cpu_seconds(pids) - cpu_before)
                    seconds[path].append(elapsed)
            raw_mb_per_s = length / 1e6 / statistics.median(seconds["raw"])
            for path in ("raw", *PATHS):
                mb_per_s = length / 1e6 / statistics.median(seconds[path])
                records.append(
                    {
                        "path": "raw_socket" if path == "raw" else path,
                        "codec": str(codec),
                        "size_bytes": size_bytes,
                        "wire_bytes": length,
                        "seconds": round(statistics.median(seconds[path]), 4),
                        "mb_per_s": round(mb_per_s, 1),
                        "fp32_mb_per_s": round(size_bytes / 1e6 / statistics.median(seconds[path]), 1),
                        "ratio_to_raw_socket": round(mb_per_s / raw_mb_per_s, 3),
                        # summed over the repeats: /proc counts CPU time in 10 ms ticks
                        "cpu_seconds_per_gb": round(sum(cpu[path]) / (len(cpu[path]) * length / 1e9), 3),
                    }
                )
            summary = ", ".join(f"{r['path']} {r['mb_per_s']:.0f} MB/s" for r in records[-3:])
            print(f"[{step}/{steps}] {size_mb} MB {codec}: {summary}", file=sys.stderr, flush=True)
        parent_end.send(("stop",))
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
        fetcher.close()

    result = {
        "benchmark": "transfer",
        "description": "one fragment between two peers (separate processes) on 127.0.0.1; medians",
        "units": {
            "size_bytes": "fp32 bytes before encoding",
            "mb_per_s": "encoded (wire) bytes per second / 1e6",
            "fp32_mb_per_s": "fp32 bytes before encoding per second / 1e6",
            "cpu_seconds_per_gb": "CPU of both processes and both p2pd daemons per 1e9 wire bytes",
        },
        "repeats": args.repeats,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "hivemind": hivemind.__version__,
            # other work on the machine slows every number alike; the ratios suffer least
            "load_average_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        },
        "records": [r for r in records if r["path"] != "raw_socket"],
        "raw_socket": [r for r in records if r["path"] == "raw_socket"],
        "codecs": codecs,  # one torch thread, as the transport runs them
        "codecs_two_torch_threads": codecs_two_threads,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {**ran, **result}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
