"""Bad training data is found before anything starts: `check_data` reads each Criteo file's first lines as the
workers' reader would, and `ecrec local` / `ecrec validate` stop with one line naming the file and the line."""

from __future__ import annotations

import gzip
import subprocess
import sys

import pytest

from ecrec.data import CHECK_LINES, CriteoFileData, SyntheticData, check_data, write_criteo_tsv
from tests.conftest import REPO, make_ctx, processes_mentioning

CTX = make_ctx("x")  # preset tiny: 13 integer columns, 4 tables
D, SIZES = CTX.model.num_dense, CTX.model.table_sizes
WIDTH = 1 + D + len(SIZES)


def spec_for(*paths):
    return make_ctx("x", data__source="criteo", data__paths=f"[{','.join(map(str, paths))}]").spec


def good_file(path, n=50):
    write_criteo_tsv(path, SyntheticData(SIZES, D, seed=1), n)
    return path


def line(label="1", dense=None, cats=None) -> str:
    dense = ["3"] * D if dense is None else dense
    cats = ["0000001a"] * len(SIZES) if cats is None else cats
    return "\t".join([label, *dense, *cats])


def with_line_3(tmp_path, bad: str):
    """A good file whose third line is `bad`."""
    path = good_file(tmp_path / "train.tsv")
    lines = path.read_text().splitlines()
    lines[2] = bad
    path.write_text("\n".join(lines) + "\n")
    return path


def test_generated_files_and_synthetic_jobs_pass(tmp_path):
    a, b = good_file(tmp_path / "a.tsv"), good_file(tmp_path / "b.tsv")
    assert check_data(spec_for(a, b)) == []
    assert check_data(make_ctx("x").spec) == []  # synthetic: no files


def test_what_the_reader_accepts_passes(tmp_path):
    # Empty fields (missing values), CRLF endings, blank lines, negative counts, ids wider than the table.
    lines = [
        line(),
        line(label="", dense=[""] * D, cats=[""] * len(SIZES)),
        "",
        line(label="0", dense=["-2"] + ["0"] * (D - 1), cats=["ffffffffffff"] * len(SIZES)),
    ]
    path = tmp_path / "edge.tsv"
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    assert check_data(spec_for(path)) == []
    assert len(CriteoFileData([path], SIZES, D, eval_fraction=0.0).train) == 3  # the reader agrees


BAD_LINES = {
    "columns": (line() + "\t0000", f"expected {WIDTH} tab-separated columns"),
    "spaces": (line().replace("\t", " "), "got 1"),
    "label 2": (line(label="2"), "label must be 0 or 1, got '2'"),
    "label text": (line(label="yes"), "label must be 0 or 1, got 'yes'"),
    "float count": (line(dense=["3"] * 4 + ["1.5"] + ["3"] * (D - 5)), "column I5 is not an integer: '1.5'"),
    "hex count": (line(dense=["a1"] + ["3"] * (D - 1)), "column I1 is not an integer: 'a1'"),
    "bad id": (line(cats=["0000001a", "zz", "1", "2"]), "column C2 is not a hexadecimal id: 'zz'"),
    "huge count": (line(dense=["9" * 25] + ["3"] * (D - 1)), "column I1 is out of the int64 range"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_bad_line_is_named_with_its_file_and_number(tmp_path, case):
    bad, expected = BAD_LINES[case]
    path = with_line_3(tmp_path, bad)
    (problem,) = check_data(spec_for(path))
    assert problem.startswith(f"spec.data.paths[0]: {path}:3: ") and expected in problem, problem
    # The workers' reader refuses the same file: the check reports what would fail later, nothing else.
    with pytest.raises((ValueError, OverflowError)):
        CriteoFileData([path], SIZES, D)


def test_missing_unreadable_and_binary_files(tmp_path):
    good = good_file(tmp_path / "good.tsv")
    gz = tmp_path / "train.tsv.gz"
    gz.write_bytes(gzip.compress(good.read_bytes()))
    problems = check_data(spec_for(tmp_path / "nope.tsv", good, tmp_path, gz))
    assert problems == [
        f"spec.data.paths[0]: {tmp_path / 'nope.tsv'}: no such file",
        f"spec.data.paths[2]: {tmp_path}: is a directory, not a Criteo TSV file",
        f"spec.data.paths[3]: {gz}:1: not ASCII text (gzip-compressed? decompress it first)",
    ]


def test_files_without_samples(tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_text("\n\n")
    (problem,) = check_data(spec_for(empty))
    assert "no samples" in problem
    assert check_data(spec_for(empty, good_file(tmp_path / "g.tsv"))) == []  # one empty file among others


def test_only_the_first_lines_are_read(tmp_path):
    path = good_file(tmp_path / "train.tsv", n=10)
    with open(path, "a") as f:
        f.write(line(label="7") + "\n")  # line 11
    assert check_data(spec_for(path), lines=10) == []
    assert ":11: label must be 0 or 1" in check_data(spec_for(path), lines=11)[0]
    assert CHECK_LINES >= 100


def ecrec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ecrec.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=300
    )


def job_args(*paths) -> list[str]:
    sets = ["model.preset=tiny", "data.source=criteo", f"data.paths=[{','.join(map(str, paths))}]"]
    return ["examples/local-small.yaml", *(a for s in sets for a in ("--set", s))]


def test_ecrec_local_stops_with_one_line_before_starting_anything(tmp_path):
    path = with_line_3(tmp_path, line(label="2"))
    out = tmp_path / "out"
    res = ecrec("local", *job_args(path, tmp_path / "missing.tsv"), "--quiet", "--out", str(out))
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines == [
        f"error: spec.data.paths[0]: {path}:3: label must be 0 or 1, got '2' "
        "(and 1 more: ecrec validate lists them)"
    ]
    assert not out.exists() and processes_mentioning(str(out)) == []  # no log dir: no process was started


def test_ecrec_validate_lists_every_data_problem(tmp_path):
    path = with_line_3(tmp_path, line(label="2"))
    res = ecrec("validate", *job_args(path, tmp_path / "missing.tsv"))
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        f"error: spec.data.paths[0]: {path}:3: label must be 0 or 1, got '2'",
        f"error: spec.data.paths[1]: {tmp_path / 'missing.tsv'}: no such file",
    ]
    # Paths that exist only on the pods' volumes: the spec alone can still be validated.
    res = ecrec("validate", *job_args(path, tmp_path / "missing.tsv"), "--skip-data-check")
    assert res.returncode == 0 and '"source": "criteo"' in res.stdout, res.stderr
    good = good_file(tmp_path / "good.tsv")
    assert ecrec("validate", *job_args(good)).returncode == 0
