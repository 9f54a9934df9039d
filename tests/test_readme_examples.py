"""The README's serving examples run as written: its ``disagg serve`` command (the model folder
and the port swapped for the test's), its ``curl`` request, and every Python example that
talks to ``http://localhost:8001/v1`` (the port swapped), each run in a fresh interpreter
with the ``openai`` SDK."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_fixtures import start_worker_proc, stop_all, wait_all_healthy

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLE_URL = "localhost:8001"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), re.S | re.M)


def _serve_command() -> list[str]:
    """The Serving section's ``disagg serve /tmp/tiny --port 8001 ...`` arguments after the
    model folder, the port left out."""
    for block in _blocks("bash"):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            if line.startswith("disagg serve /tmp/tiny --port 8001 --served-model-name"):
                args = shlex.split(line)[3:]
                i = args.index("--port")
                return args[:i] + args[i + 2:]
    raise AssertionError("README: no 'disagg serve /tmp/tiny --port 8001 ...' command")


def _curl_command() -> str:
    for block in _blocks("bash"):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            if line.startswith(f"curl -s {EXAMPLE_URL}/v1/chat/completions"):
                return line
    raise AssertionError("README: no curl example of the worker")


PY_EXAMPLES = [b for b in _blocks("python") if f"http://{EXAMPLE_URL}/v1" in b]


@pytest.fixture(scope="module")
def worker(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("readme")
    w = start_worker_proc(tmp, model_dir, "readme", _serve_command(), {})
    try:
        wait_all_healthy([w], 120.0)
        yield w.url.removeprefix("http://")
    finally:
        stop_all([w])


def test_the_readme_has_the_examples() -> None:
    assert len(PY_EXAMPLES) >= 2  # structured outputs and tool calls; the Responses API
    assert any("responses.create" in b for b in PY_EXAMPLES)
    assert any('"role": "tool"' in b for b in PY_EXAMPLES)


def test_curl_example(worker: str) -> None:
    out = subprocess.run(["bash", "-c", _curl_command().replace(EXAMPLE_URL, worker)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and '"object":"chat.completion"' in out.stdout.replace(
        " ", ""), out.stdout + out.stderr


@pytest.mark.parametrize("example", range(len(PY_EXAMPLES)))
def test_python_example(worker: str, example: int, tmp_path: Path) -> None:
    code = PY_EXAMPLES[example].replace(EXAMPLE_URL, worker)
    path = tmp_path / "example.py"
    path.write_text(code)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"README example {example} failed:\n{code}\n{out.stderr}"
