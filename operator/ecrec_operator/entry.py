"""The `ecrec-operator` console script: says what to install when the operator's own dependencies are missing.

`pip install ecrec` installs the script but not kopf or the Kubernetes client (they are the `operator` extra),
and `ecrec_operator.main` needs both at import: without this a user would get a bare ImportError traceback.
"""

from __future__ import annotations

import importlib.util

NEEDS = ("kopf", "kubernetes")


def missing() -> list[str]:
    return [name for name in NEEDS if importlib.util.find_spec(name) is None]


def main(argv: list[str] | None = None) -> None:
    if lacking := missing():
        raise SystemExit(
            f"ecrec-operator needs {' and '.join(lacking)}, which {'is' if len(lacking) == 1 else 'are'} not "
            "installed: pip install 'ecrec[operator]' (or use the ecrec-operator image, dockerfiles/)"
        )
    from ecrec_operator.main import main as run

    run(argv)
