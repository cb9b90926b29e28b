"""Images: THE mapping from a container image to a local program (`image_for`), in one place.

Images map to local programs in ONE place, `image_for` below: any image named `ecrec` (`ecrec:dev`,
`ghcr.io/o/ecrec:1`, `ecrec:0.1.0-cuda`) or `ecrec-operator` is this repository's `.venv`, with the image's
ENTRYPOINT (`ecrec`, `ecrec-operator`); any other image fails the pod (ErrImagePull), it is never run.
`which` finds a container's executable the way that image would.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
VENV = REPO / ".venv"
RUNTIME = "ecrec-test"  # scheme of containerID / imageID, like docker:// or containerd://


@dataclass(frozen=True)
class Image:
    """What an image stands for locally: PATH entries put first, its ENTRYPOINT and CMD, and its ENV."""

    path: tuple[str, ...]
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


ECREC_IMAGE = Image(
    path=(str(VENV / "bin"),),
    entrypoint=("ecrec",),  # the console script of pyproject.toml; command: [...] replaces it
    env=(("PYTHONUNBUFFERED", "1"), ("VIRTUAL_ENV", str(VENV))),
)
OPERATOR_IMAGE = Image(  # dockerfiles/Dockerfile, target operator: the same venv, ENTRYPOINT ecrec-operator
    path=ECREC_IMAGE.path, entrypoint=("ecrec-operator",), env=ECREC_IMAGE.env
)
IMAGES = {"ecrec": ECREC_IMAGE, "ecrec-operator": OPERATOR_IMAGE}


def image_name(ref: str) -> str:
    """`ghcr.io/org/ecrec:0.1@sha256:..` -> `ecrec`: the last path component without tag or digest."""
    return ref.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]


def image_for(ref: str) -> Image | None:
    """THE image mapping: the local stand-in of image `ref`, or None when there is none (the pod fails).

    Any image whose last path component is named `ecrec` (`ecrec:dev`, `ghcr.io/org/ecrec:0.1`,
    `localhost:5000/ecrec@sha256:...`, `ecrec:0.1.0-cuda`) or `ecrec-operator` runs from this repository's
    .venv: `.venv/bin` comes first on PATH, so `python`, `python3`, `ecrec`, `ecrec-operator`, `uvicorn` ...
    are the venv's, and an absolute command whose basename is in `.venv/bin` (`/usr/local/bin/python`) is
    the venv's too. ENTRYPOINT is `ecrec` (`ecrec-operator` for that image), ENV PYTHONUNBUFFERED=1.
    """
    return IMAGES.get(image_name(ref))


def which(cmd: str, env: dict[str, str]) -> str | None:
    """The executable for argv[0]: looked up on the container's PATH; an absolute path whose basename is
    in .venv/bin is the venv's (`/usr/local/bin/python` of an image)."""
    if "/" not in cmd:
        return shutil.which(cmd, path=env.get("PATH"))
    if not cmd.startswith("/"):
        return None
    twin = VENV / "bin" / Path(cmd).name
    if twin.exists():
        return str(twin)
    return cmd if os.access(cmd, os.X_OK) and Path(cmd).is_file() else None
