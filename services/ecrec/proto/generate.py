"""Regenerate the committed gRPC stubs from ecrec.proto (`make proto`).

The stubs are committed so a plain `pip install` works without grpcio-tools; tests/test_proto.py fails if
they are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
SERVICES = PROTO_DIR.parent.parent  # services/ (so generated imports read `from ecrec.proto import ...`)


def generate(out_dir: Path = SERVICES) -> None:
    from grpc_tools import protoc

    proto = PROTO_DIR / "ecrec.proto"
    args = [
        "grpc_tools.protoc",
        f"-I{SERVICES}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(proto.relative_to(SERVICES)),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else SERVICES)
