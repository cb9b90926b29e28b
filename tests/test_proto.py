"""The committed gRPC stubs match ecrec.proto (regenerate with `make proto`)."""

from __future__ import annotations

from pathlib import Path

from ecrec.proto.generate import PROTO_DIR, generate


def test_committed_stubs_are_current(tmp_path: Path):
    generate(tmp_path)
    for name in ("ecrec_pb2.py", "ecrec_pb2_grpc.py"):
        fresh = (tmp_path / "ecrec" / "proto" / name).read_text()
        assert fresh == (PROTO_DIR / name).read_text(), f"{name} is stale: run `make proto`"
