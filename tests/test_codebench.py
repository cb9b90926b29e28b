"""`ecrec bench codes` runs from the command line and reports both codes: xor (r = 1) and P + Q (r = 2)."""

from __future__ import annotations

import json

import pytest

from ecrec.cli import main


def test_bench_codes_prints_and_writes_a_row_per_code(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as code:
        main(["bench", "codes", "--rows", "64", "--width", "8", "--seconds", "0.05", "--out", str(out)])
    assert code.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# ecrec bench codes: k=4, records of 8 floats")
    rows = [line for line in lines if line.startswith("| xor ") or line.startswith("| pq ")]
    assert [r.split(" | ")[0] for r in rows] == ["| xor", "| pq"]
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["code"], s["parity records r"], s["lost"]) for s in summary] == [("xor", 1, 1), ("pq", 2, 2)]
    for s in summary:
        assert s["encode data rows/s"] > 0 and s["delta rows/s"] > 0 and s["decode stripes/s"] > 0
        assert s["rebuilt rows/s"] == pytest.approx(s["decode stripes/s"] * s["lost"], abs=s["lost"])
