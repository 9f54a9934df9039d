"""torch imported without CUDA's Python packages on a build without a GPU
(``disagg/torch_import.py``): the version check, the hiding on a stand-in torch package (a
CPU and a CUDA build, in fresh interpreters), and the installed torch after ``import disagg``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from disagg.torch_import import build_has_no_gpu

REPO = Path(__file__).resolve().parent.parent

CPU_VERSION = """from typing import Optional
__version__ = '2.13.0+cpu'
cuda: Optional[str] = None
hip: Optional[str] = None
"""


@pytest.mark.parametrize("text, expected", [
    (CPU_VERSION, True),
    ("cuda = None\nhip = None\n", True),
    (CPU_VERSION.replace("cuda: Optional[str] = None", "cuda: Optional[str] = '12.8'"), False),
    (CPU_VERSION.replace("hip: Optional[str] = None", "hip: Optional[str] = '6.4.4'"), False),
    ("cuda = None\n", False),            # hip not said: cannot tell
    ("cuda = CUDA_VERSION\nhip = None\n", False),
    ("this is not python (", False),
])
def test_build_has_no_gpu_reads_version_py(text: str, expected: bool) -> None:
    assert build_has_no_gpu(text) is expected


def _run(code: str, path: list[Path], env: dict[str, str] | None = None) -> dict[str, object]:
    """``code`` in a fresh interpreter with ``path`` first on sys.path; its last stdout line
    is JSON."""
    full_env = {k: v for k, v in os.environ.items() if k != "DISAGG_TORCH_CUDA_PY"}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join([*map(str, path), str(REPO)])
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fake_torch(root: Path, cuda: str | None) -> Path:
    """A stand-in ``torch`` (its __init__ tries pynvml and cuda.bindings, as torch's does)
    and stand-ins of those two, under ``root``."""
    pkg = root / "torch"
    pkg.mkdir(parents=True)
    (pkg / "version.py").write_text(CPU_VERSION.replace(
        "cuda: Optional[str] = None", f"cuda: Optional[str] = {cuda!r}"))
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        try:
            import pynvml  # noqa: F401
            HAS_PYNVML = True
        except ImportError:
            HAS_PYNVML = False
        try:
            from cuda.bindings import runtime  # noqa: F401
            HAS_BINDINGS = True
        except ImportError:
            HAS_BINDINGS = False
    """))
    (root / "pynvml.py").write_text("LOADED = True\n")
    (root / "cuda" / "bindings").mkdir(parents=True)
    (root / "cuda" / "bindings" / "__init__.py").write_text("")
    (root / "cuda" / "bindings" / "runtime.py").write_text("")
    return root


PROBE = """
    import json, sys
    {first}
    import torch
    seen = {{"pynvml": torch.HAS_PYNVML, "bindings": torch.HAS_BINDINGS,
             "finder_left": any(type(f).__name__ == "_TorchFinder" for f in sys.meta_path),
             "loader": type(torch.__spec__.loader).__name__}}
    {middle}
    import pynvml
    from cuda.bindings import runtime  # importable afterwards (ucxx's rmm imports it)
    seen["after"] = pynvml.LOADED
    print(json.dumps(seen))
"""


def test_a_cpu_build_is_imported_without_them(tmp_path: Path) -> None:
    root = _fake_torch(tmp_path, None)
    seen = _run(PROBE.format(first="import disagg", middle=""), [root])
    assert seen == {"pynvml": False, "bindings": False, "finder_left": False,
                    "loader": "SourceFileLoader", "after": True}


def test_a_bad_switch_value_is_an_error_naming_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DISAGG_TORCH_CUDA_PY"}
    env.update(DISAGG_TORCH_CUDA_PY="sometimes", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", "import disagg"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "$DISAGG_TORCH_CUDA_PY='sometimes': expected a boolean" in proc.stderr


def test_a_cuda_build_or_the_switch_or_torch_first_are_left_alone(tmp_path: Path) -> None:
    probe = PROBE.format(first="import disagg", middle="")
    seen = _run(probe, [_fake_torch(tmp_path / "cu", "12.8")])
    assert (seen["pynvml"], seen["bindings"], seen["finder_left"]) == (True, True, False)
    cpu = _fake_torch(tmp_path / "cpu", None)
    seen = _run(probe, [cpu], {"DISAGG_TORCH_CUDA_PY": "1"})
    assert (seen["pynvml"], seen["bindings"], seen["finder_left"]) == (True, True, False)
    # torch imported before disagg: nothing to do, and no finder is left behind
    late = ("import disagg; seen['finder_after_disagg'] = any("
            "type(f).__name__ == '_TorchFinder' for f in sys.meta_path)")
    seen = _run(PROBE.format(first="", middle=late), [cpu])
    assert (seen["pynvml"], seen["finder_after_disagg"]) == (True, False)


def test_the_installed_cpu_torch_after_import_disagg() -> None:
    """This machine's torch: on a CPU-only build with NVML's bindings installed (UCX's CUDA
    12 build brings them), ``import disagg`` then ``import torch`` loads neither them nor
    cuda-bindings, and torch computes."""
    code = """
        import json, sys
        import disagg
        import torch
        out = {"cpu_build": torch.version.cuda is None and torch.version.hip is None,
               "pynvml": "pynvml" in sys.modules,
               "bindings": "cuda.bindings" in sys.modules,
               "sum": float(torch.arange(4.0).sum())}
        print(json.dumps(out))
    """
    seen = _run(code, [])
    assert seen["sum"] == 6.0
    if not seen["cpu_build"]:
        pytest.skip("this torch has CUDA or ROCm: left alone")
    if importlib.util.find_spec("pynvml") is None:
        pytest.skip("NVML's Python bindings are not installed here")
    assert (seen["pynvml"], seen["bindings"]) == (False, False)
