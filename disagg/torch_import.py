"""torch imported without CUDA's Python packages where the installed torch cannot use them.

torch's import loads NVML's bindings (``pynvml``) and ``cuda-bindings`` whenever they are
installed, a CPU-only build too, which never calls them. UCX's CUDA 12 build (``disagg[ucx]``,
part of ``[serve]``) installs both, so on a CPU machine every disagg process held them: ``import
torch`` is 218 MiB of RSS without them, 230 with them (2-core Xeon, torch 2.13 CPU), and ~40 ms
longer.

``install()`` (run by ``import disagg``) puts a finder first on ``sys.meta_path`` that acts
once, on the first import of ``torch`` in the process, and only when ``torch/version.py`` says
the build has neither CUDA nor ROCm (``cuda = None``, ``hip = None``): while torch's
``__init__`` runs, ``pynvml`` and ``cuda.bindings`` are entries of ``None`` in ``sys.modules``
(an import of them raises ``ImportError``, which torch catches: ``torch.cuda._HAS_PYNVML`` and
``torch.cuda._utils._HAS_CUDA_BINDINGS`` are False, as without the packages); then they are
removed, so a later ``import cuda.bindings`` (ucxx's, through rmm) imports them as usual. A
torch imported before disagg, or a CUDA / ROCm build, is left alone. ``DISAGG_TORCH_CUDA_PY=1``
(``env.TORCH_CUDA_PY``) turns it off.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from disagg.env import TORCH_CUDA_PY

# What a CPU-only torch imports for nothing (cuda-bindings's site .pth imports the "cuda"
# namespace package itself at start-up: its "bindings" is what is blocked)
HIDDEN = ("pynvml", "cuda.bindings")


def build_has_no_gpu(version_py: str) -> bool:
    """Whether torch's ``version.py`` (its text) has ``cuda`` and ``hip`` both ``None``.
    False where it cannot tell (a file it does not parse, a name it does not find)."""
    try:
        tree = ast.parse(version_py)
    except (SyntaxError, ValueError):
        return False
    found: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name)):
            target, value = node.targets[0].id, node.value
        else:
            continue
        if target in ("cuda", "hip"):
            found[target] = value.value if isinstance(value, ast.Constant) else "?"
    return found.get("cuda", "?") is None and found.get("hip", "?") is None


class _HidingLoader(importlib.abc.Loader):
    """torch's own loader, with ``HIDDEN`` blocked while its ``__init__`` runs."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module sees its real loader (importlib.resources and friends ask it).
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        blocked = [name for name in HIDDEN if name not in sys.modules]
        for name in blocked:
            sys.modules[name] = None  # type: ignore[assignment]
        try:
            self.inner.exec_module(module)
        finally:
            for name in blocked:
                if name in sys.modules and sys.modules[name] is None:
                    del sys.modules[name]


class _TorchFinder(importlib.abc.MetaPathFinder):
    """Finds ``torch`` through the other finders, once; its loader wrapped when the build has
    no GPU (see the module docstring)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        uninstall()  # once: the first import of torch decides
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not spec.submodule_search_locations:
            return spec
        version_py = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
        try:
            with open(version_py, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            return spec
        if build_has_no_gpu(text):
            spec.loader = _HidingLoader(spec.loader)  # type: ignore[arg-type]
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (nothing when torch is imported already, or
    ``DISAGG_TORCH_CUDA_PY`` is true: a value that is not a boolean raises ``EnvError`` naming
    it); idempotent."""
    if "torch" in sys.modules or TORCH_CUDA_PY.get():
        return
    if not any(isinstance(f, _TorchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchFinder())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchFinder)]
