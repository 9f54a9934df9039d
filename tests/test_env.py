"""disagg/env.py: each environment variable parses as documented; a bad value names it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from disagg import env
from disagg.env import EnvError

PACKAGE = Path(env.__file__).parent


def test_every_variable_is_documented_in_the_module_table() -> None:
    doc = env.__doc__ or ""
    names = [v.name for v in env.VARIABLES]
    assert len(set(names)) == len(names)
    for var in env.VARIABLES:
        assert var.name in doc and var.help, var.name


def test_unset_gives_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in env.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)
    assert env.CLUSTER_TOKEN.get() is None
    assert env.CPU_KERNELS.get() == frozenset({"attention", "linear", "elementwise", "decoder"})
    assert env.CUDA_ATTENTION.get() == "triton"
    assert env.DIST_TIMEOUT_S.get() == 300.0
    assert env.STARTUP_TIMEOUT_S.get() == 600.0
    assert env.KV_DEVICE_DIRECT.get() is True
    assert env.CUDA_VISIBLE_DEVICES.get() is None
    assert env.UCX_TLS.get() == ""
    assert env.OPENAI_API_KEY.get() is None
    assert env.TORCH_CUDA_PY.get() is False
    home = str(Path.home())
    assert env.cache_root() == f"{home}/.cache/disagg"
    assert env.kernel_cache_root() == f"{home}/.cache/disagg"


def test_values_parse_as_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = [
        (env.CLUSTER_TOKEN, "s3cret", "s3cret"),
        (env.CLUSTER_TOKEN, "", None),  # empty: as if unset
        (env.CPU_KERNELS, "0", frozenset()),
        (env.CPU_KERNELS, "", frozenset()),
        (env.CPU_KERNELS, "off", frozenset()),
        (env.CPU_KERNELS, "Yes", frozenset({"attention", "linear", "elementwise", "decoder"})),
        (env.CPU_KERNELS, "all", frozenset({"attention", "linear", "elementwise", "decoder"})),
        (env.CPU_KERNELS, "elementwise", frozenset({"elementwise"})),
        (env.CPU_KERNELS, " linear ", frozenset({"linear"})),
        (env.CPU_KERNELS, "attention,linear", frozenset({"attention", "linear"})),
        (env.CUDA_ATTENTION, "torch", "torch"),
        (env.CUDA_ATTENTION, " Triton ", "triton"),
        (env.DIST_TIMEOUT_S, "12.5", 12.5),
        (env.STARTUP_TIMEOUT_S, "60", 60.0),
        (env.KV_DEVICE_DIRECT, "0", False),
        (env.KV_DEVICE_DIRECT, "no", False),
        (env.KV_DEVICE_DIRECT, "OFF", False),
        (env.KV_DEVICE_DIRECT, "1", True),
        (env.KV_DEVICE_DIRECT, "", True),  # set but empty: the default
        (env.CUDA_VISIBLE_DEVICES, "", []),  # set and empty: no GPU at all
        (env.CUDA_VISIBLE_DEVICES, "2, 3,", ["2", "3"]),
        (env.UCX_TLS, "tcp,cuda_copy", "tcp,cuda_copy"),
        (env.OPENAI_API_KEY, "sk-1", "sk-1"),
        (env.CACHE, "/tmp/x", "/tmp/x"),
        (env.KERNEL_CACHE_DIR, "/tmp/k", "/tmp/k"),
        (env.XDG_CACHE_HOME, "/tmp/xdg", "/tmp/xdg"),
        (env.TORCH_CUDA_PY, "1", True),
        (env.TORCH_CUDA_PY, "off", False),
    ]
    for var, raw, expected in cases:
        monkeypatch.setenv(var.name, raw)
        assert var.get() == expected, (var.name, raw)
        assert var.raw() == raw


def test_cache_roots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISAGG_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/tmp/xdg")
    assert env.cache_root() == "/tmp/xdg/disagg"
    monkeypatch.setenv("DISAGG_CACHE", "/tmp/dc")
    assert env.cache_root() == "/tmp/dc"
    monkeypatch.setenv("DISAGG_CACHE_DIR", "/tmp/kc")
    assert env.kernel_cache_root() == "/tmp/kc"


@pytest.mark.parametrize(("var", "raw", "says"), [
    (env.CPU_KERNELS, "linear,fast", "unknown kernel"),
    (env.CUDA_ATTENTION, "cudnn", "one of triton, torch"),
    (env.DIST_TIMEOUT_S, "five", "seconds > 0"),
    (env.DIST_TIMEOUT_S, "0", "seconds > 0"),
    (env.DIST_TIMEOUT_S, "nan", "seconds > 0"),
    (env.STARTUP_TIMEOUT_S, "", "seconds > 0"),
    (env.STARTUP_TIMEOUT_S, "-1", "seconds > 0"),
    (env.KV_DEVICE_DIRECT, "maybe", "boolean"),
    (env.TORCH_CUDA_PY, "sometimes", "boolean"),
])
def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, var: env.EnvVar,
                                        raw: str, says: str) -> None:
    monkeypatch.setenv(var.name, raw)
    with pytest.raises(EnvError, match=says) as info:
        var.get()
    assert str(info.value).startswith(f"${var.name}={raw!r}: ")
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still do


def test_readers_go_through_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg.cluster_auth import api_key_or_none, cluster_token_or_none, resolve_cluster_token
    from disagg.launch import visible_gpus
    from disagg.transfer.ucx import device_direct_wanted

    monkeypatch.setenv("DISAGG_API_KEY", "key")
    assert api_key_or_none() == "key" and api_key_or_none("given") == "given"
    monkeypatch.setenv("DISAGG_API_KEY", "")
    assert api_key_or_none() is None
    monkeypatch.setenv("DISAGG_CLUSTER_TOKEN", "tok")
    assert resolve_cluster_token() == "tok" and cluster_token_or_none() == "tok"
    assert cluster_token_or_none("given") == "given"
    monkeypatch.setenv("DISAGG_CLUSTER_TOKEN", "")
    assert cluster_token_or_none() is None
    with pytest.raises(ValueError, match=r"\$DISAGG_CLUSTER_TOKEN"):
        resolve_cluster_token()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert visible_gpus() == ["1", "0"]
    monkeypatch.setenv("DISAGG_KV_DEVICE_DIRECT", "false")
    assert device_direct_wanted() == (False, "DISAGG_KV_DEVICE_DIRECT=false forces host staging")
    monkeypatch.setenv("DISAGG_DIST_TIMEOUT_S", "soon")
    from disagg.parallel.worker import dist_timeout_s

    with pytest.raises(EnvError, match=r"^\$DISAGG_DIST_TIMEOUT_S='soon'"):
        dist_timeout_s()


def test_no_module_reads_os_environ_but_env_py() -> None:
    """Reads (``os.environ.get``, ``os.environ[...]`` loads, ``os.getenv``) happen only in
    env.py; writing a child's environment or UCX's own variables elsewhere is allowed."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "env.py" and path.parent == PACKAGE:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = ast.unparse(node.func)
                if target in ("os.environ.get", "os.getenv"):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                    and ast.unparse(node.value) == "os.environ"):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []
