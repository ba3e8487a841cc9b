"""Compile ``fragment.proto`` into ``fragment_pb2.py`` and ``fragment_pb2_grpc.py`` beside it.

The generated files are committed; ``tests/test_wire.py`` fails when they are stale. The proto is
compiled under the virtual path ``cgad/protocol/`` so the generated gRPC module imports its
messages as ``cgad.protocol.fragment_pb2``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
GENERATED = ("fragment_pb2.py", "fragment_pb2_grpc.py")


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Compile ``proto_dir/fragment.proto`` into ``out_dir``; return the generated modules' paths."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-Icgad/protocol={proto_dir}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"{proto_dir / 'fragment.proto'}",
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on fragment.proto")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            target = out_dir / name
            shutil.copyfile(Path(tmp) / "cgad" / "protocol" / name, target)
            written.append(target)
        return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
        print(path)
