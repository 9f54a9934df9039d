"""The ``bench`` package's rules (bench/README.md): its modules run as ``python -m bench.<name>``
from the repository root, none edits ``sys.path``, none reaches for a private (underscore)
name of disagg, and the client modules that run inside other virtualenvs import nothing but
the standard library."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# Private names a module still uses, each with its reason (remove the entry with the use).
PRIVATE_ALLOWED = {
    ("structured_outputs.py", "eng._masks"):
        "times the engine's mask filler, which LLMEngine does not expose publicly yet",
}


def _sources() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.py") if "results" not in p.relative_to(BENCH).parts)


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def _path_edits(tree: ast.AST) -> list[str]:
    """``sys.path`` changed in place (a method call on it, an item or slice set) or rebound,
    and ``site.addsitedir``."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and (_is_sys_path(node.func.value) or node.func.attr == "addsitedir")):
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if _is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)):
                    found.append(ast.unparse(node))
    return found


def test_no_module_edits_sys_path() -> None:
    edits = {str(p.relative_to(ROOT)): e for p in _sources()
             if (e := _path_edits(ast.parse(p.read_text(), filename=str(p))))}
    assert edits == {}


def test_the_path_check_sees_an_edit() -> None:
    for code in ("import sys\nsys.path.insert(0, 'x')", "import sys\nsys.path[:0] = ['x']",
                 "import sys\nsys.path += ['x']", "import site\nsite.addsitedir('x')"):
        assert _path_edits(ast.parse(code)), code


def _private_uses(path: Path) -> set[str]:
    """Underscore names imported from disagg, and ``obj._name`` on anything but self / cls
    (a module, an engine, a sibling module: ``bench`` reads only what they publish)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("disagg"):
            if any(p.startswith("_") for p in node.module.split(".")):
                found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if a.name.startswith("_") and not a.name.startswith("__"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("disagg")
                         and any(p.startswith("_") for p in a.name.split(".")))
        elif (isinstance(node, ast.Attribute) and node.attr.startswith("_")
              and not node.attr.startswith("__")
              and ast.unparse(node.value) not in ("self", "cls")):
            found.add(ast.unparse(node))
    return found


def test_no_private_names() -> None:
    found = {(str(p.relative_to(BENCH)), use) for p in _sources() for use in _private_uses(p)}
    assert found - set(PRIVATE_ALLOWED) == set()
    assert set(PRIVATE_ALLOWED) - found == set(), "an allowed private use is gone: drop it"


def test_every_module_imports() -> None:
    """Every module imports as ``bench.<name>`` from the repository root (in a subprocess:
    some set process-wide settings, e.g. OMP_WAIT_POLICY, when imported)."""
    mods = [_module(p) for p in _sources() if p.name != "__main__.py"
            and not p.name.endswith("_client.py")]  # (their libraries live in other venvs)
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    cp = subprocess.run([sys.executable, "-c", code, *mods], cwd=ROOT, capture_output=True,
                        text=True, timeout=240)
    assert cp.returncode == 0, cp.stderr[-3000:]


@pytest.mark.parametrize("module", sorted(
    _module(p) for p in (BENCH / "clients").glob("*_client.py")))
def test_client_modules_need_only_the_standard_library(module: str) -> None:
    """As the harness runs them in a library's virtualenv, here without site-packages (``-S``):
    the package, ``common`` and the module's own top level import nothing else (the library
    itself is imported inside the case functions)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(ROOT)
    cp = subprocess.run([sys.executable, "-S", "-m", module, "--help"], env=env,
                        cwd=BENCH / "results", capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert f"usage: python -m {module} " in cp.stdout
