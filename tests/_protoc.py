"""Compile ``protocol/fragment.proto`` into ``protocol/fragment_pb2.py``: a development tool.

Regenerate after editing the proto, from the repository root::

    .venv/bin/python tests/_protoc.py

The generated module is committed, so the runtime package never needs ``grpc_tools`` (a dev
dependency); ``tests/test_wire.py`` uses ``generate`` to fail when the committed module is
stale. The proto is compiled under the virtual path ``cgad/protocol/`` so that its descriptor has
a name no other project's ``fragment.proto`` can collide with. No gRPC stubs are generated: the transport
registers the service's methods itself, so that it can stream pre-serialized chunks
(``cgad.protocol.wire.serialized_response_stream``).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent.parent / "protocol"
GENERATED = ("fragment_pb2.py",)


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Compile ``proto_dir/fragment.proto`` into ``out_dir``; return the generated modules' paths."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-Icgad/protocol={proto_dir}",
            f"--python_out={tmp}",
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
