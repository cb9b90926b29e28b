"""`ecrec-operator` without kopf or the Kubernetes client says what to install instead of a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ecrec_operator import entry


def test_the_operator_without_kopf_says_what_to_install(monkeypatch):
    real = entry.importlib.util.find_spec
    monkeypatch.setattr(entry.importlib.util, "find_spec", lambda n: None if n == "kopf" else real(n))
    with pytest.raises(SystemExit) as e:
        entry.main(["--help"])
    assert "needs kopf, which is not installed" in str(e.value) and "ecrec[operator]" in str(e.value)


def test_the_console_script_runs_the_operator_when_its_dependencies_are_there():
    # the installed script (pyproject [project.scripts]) reaches the operator's own argument parser
    out = subprocess.run(
        [sys.executable, "-c", "from ecrec_operator.entry import main; main(['--help'])"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "usage: ecrec-operator" in out.stdout, out.stderr
