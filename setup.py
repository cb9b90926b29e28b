"""The C extension only; everything else about the package is in pyproject.toml.

ecrec.core._heldrows is the parity servers' version-ordered xor apply (services/ecrec/core/_heldrows.c, see
ecrec/core/heldrows.py). Optional: where no C compiler is, the install still succeeds and the numpy path runs.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ecrec.core._heldrows",
            sources=["services/ecrec/core/_heldrows.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
