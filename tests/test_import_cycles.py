"""No import cycles among disagg's modules.

Every ``import`` / ``from ... import`` of a disagg module counts, wherever it stands (module
level or inside a function: an import moved into a function still ties the two modules
together), except under ``if TYPE_CHECKING:``, which never runs. ``from pkg import name``
counts as an import of ``pkg.name`` when that is a module, and of ``pkg`` itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import disagg

PACKAGE_DIR = Path(disagg.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ("disagg", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # the ``else`` of ``if TYPE_CHECKING`` does run
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the disagg modules it imports."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                graph[mod].update(a.name for a in node.names if a.name in mods)
                continue
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            if base in mods:
                graph[mod].add(base)
            for a in node.names:
                if f"{base}.{a.name}" in mods:
                    graph[mod].add(f"{base}.{a.name}")
        graph[mod].discard(mod)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _edges(graph: dict[str, set[str]], comp: list[str]) -> str:
    members = set(comp)
    return "; ".join(f"{a} -> {b}" for a in comp for b in sorted(graph[a] & members))


def test_finder_sees_a_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_graph_covers_the_package() -> None:
    graph = import_graph()
    assert "disagg.server.app" in graph and "disagg.transfer.base" in graph
    assert "disagg.contracts.protocol" in graph["disagg.server.app"]  # from pkg import module


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = find_cycles(graph)
    report = "\n".join(f"  {' <-> '.join(c)}  ({_edges(graph, c)})" for c in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) among disagg modules:\n{report}"


# ---- layering: who may import whom ------------------------------------------------------------

# The contracts every side shares import only each other and these torch-free modules.
CONTRACT_DEPS = ("disagg.config", "disagg.env", "disagg.layout", "disagg.request",
                 "disagg.structured.spec", "disagg.structured.bounds")
# The router, the launcher, deploy and bench are clients of the workers: they share the
# contracts with them, never the worker server's code.
WORKER_CLIENTS = ("disagg.router", "disagg.launch", "disagg.deploy", "disagg.bench",
                  "disagg.contracts")


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_contracts_import_only_contracts_and_pure_modules() -> None:
    graph = import_graph()
    bad = {m: sorted(d for d in deps if not _under(d, ("disagg.contracts", *CONTRACT_DEPS))
                     and d != "disagg")
           for m, deps in graph.items() if _under(m, ("disagg.contracts",))}
    assert not {m: d for m, d in bad.items() if d}, bad


def test_worker_clients_never_import_the_worker_server() -> None:
    graph = import_graph()
    bad = {m: sorted(d for d in deps if _under(d, ("disagg.server",)))
           for m, deps in graph.items() if _under(m, WORKER_CLIENTS)}
    assert not {m: d for m, d in bad.items() if d}, bad


# The model is the bottom of the engine's stack: the scheduler, the CUDA graphs and the runner
# drive it, the engine and the KV connector sit above them; the model knows none of them.
ABOVE_THE_MODEL = ("disagg.scheduler", "disagg.cuda_graph", "disagg.runner", "disagg.engine",
                   "disagg.kv_connector", "disagg.transfer", "disagg.server", "disagg.router")


def test_the_model_imports_nothing_above_it() -> None:
    graph = import_graph()
    assert "disagg.model.static_decode" in graph["disagg.model.llama"]
    bad = {m: sorted(d for d in deps if _under(d, ABOVE_THE_MODEL))
           for m, deps in graph.items() if _under(m, ("disagg.model",))}
    assert not {m: d for m, d in bad.items() if d}, bad


# The transfer package is the transport, leases and the server: what to pull and how it lands
# in a cache (plan, receive buffers, install) is the KV connector's, above it.
ABOVE_THE_TRANSFER = ("disagg.kv_connector", "disagg.engine", "disagg.scheduler",
                      "disagg.runner", "disagg.server", "disagg.router", "disagg.parallel")


def test_transfer_imports_nothing_above_it() -> None:
    graph = import_graph()
    assert "disagg.transfer.service" in graph["disagg.kv_connector.pull"]
    bad = {m: sorted(d for d in deps if _under(d, ABOVE_THE_TRANSFER))
           for m, deps in graph.items() if _under(m, ("disagg.transfer",))}
    assert not {m: d for m, d in bad.items() if d}, bad


def test_the_engine_package_imports_light() -> None:
    """The server imports the engine's outputs, errors and client without loading torch (the
    engines themselves load on first use)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import disagg.engine\n"
            "from disagg.engine import EngineClient, RequestOutput, QueueFullError\n"
            "import disagg.engine.client, disagg.engine.outputs, disagg.engine.errors\n"
            "import disagg.contracts.kv_mode\n"
            "print(sorted({'torch', 'fastapi', 'numpy'} & set(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_launch_and_deploy_plan_through_the_contracts() -> None:
    """One plan from a cluster YAML: launch and deploy both build on contracts/plan.py,
    which knows only the contracts and the config (a model catalog is handed to it)."""
    graph = import_graph()
    for target in ("disagg.launch", "disagg.deploy.plan"):
        assert "disagg.contracts.plan" in graph[target], target
    assert graph["disagg.contracts.plan"] <= {"disagg.contracts.cluster",
                                              "disagg.contracts.options",
                                              "disagg.contracts.roles", "disagg.config"}


def test_router_launch_and_deploy_load_neither_torch_nor_fastapi() -> None:
    """What importing them loads, in a fresh interpreter (the static graph above does not
    see third-party imports)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import disagg.router.app, disagg.router.cli, disagg.launch, disagg.deploy.cli\n"
            "import disagg.deploy.plan, disagg.deploy.k8s, disagg.deploy.slurm\n"
            "import disagg.contracts.cluster, disagg.contracts.protocol\n"
            "import disagg.contracts.responses, disagg.contracts.plan\n"
            "heavy = {'torch', 'fastapi', 'starlette', 'uvicorn'}\n"
            "print(sorted(heavy & set(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
