"""Every environment variable the package reads, in one place: name, type, default, meaning.

Other modules read the environment only through these objects (``DIST_TIMEOUT_S.get()``), so
that a bad value fails with a message naming the variable instead of a bare ``ValueError``
deep in a worker, and so that this table is the complete list. Values are read at each
``get()`` (not at import): tests and launchers may change the environment at any time.

=========================  ==============  ========================  =========================
variable                   type            default                   what it does
=========================  ==============  ========================  =========================
DISAGG_CLUSTER_TOKEN       str (secret)    none                      the cluster's shared secret
                                                                     when ``--cluster-token`` /
                                                                     ``cluster_token`` is unset
DISAGG_API_KEY             str (secret)    none                      the API key clients send
                                                                     (``Authorization: Bearer``)
                                                                     when ``--api-key`` /
                                                                     ``api_key`` is unset (the
                                                                     router and the workers)
DISAGG_CPU_KERNELS         on/off or list  ``1`` (all)               the CPU C++ kernels to use:
                                                                     1/0 (yes/no, on/off ...) or
                                                                     names: ``attention,linear,``
                                                                     ``elementwise,decoder``
DISAGG_CUDA_ATTENTION      triton | torch  ``triton``                attention on CUDA: Triton
                                                                     kernels or PyTorch's SDPA
DISAGG_CACHE_DIR           path            ``~/.cache/disagg``       root of the compiled CPU
                                                                     kernels (``kernels/``)
DISAGG_CACHE               path            ``$XDG_CACHE_HOME/disagg``  root of the tiny demo
                                           (``~/.cache/disagg``)     model and launch logs
DISAGG_DIST_TIMEOUT_S      float > 0       300                       seconds a collective / send
                                                                     / recv between ranks waits
DISAGG_STARTUP_TIMEOUT_S   float > 0       600                       seconds the ranks of a
                                                                     parallel worker get to load
DISAGG_KV_DEVICE_DIRECT    boolean         true                      false: never hand GPU memory
                                                                     to UCX (stage KV in pinned
                                                                     host memory)
DISAGG_KV_RECV_POOL        boolean         true                      false: a fresh host receive
                                                                     buffer per KV pull (no reuse;
                                                                     for A/B benchmarks)
DISAGG_KV_RUNS             boolean         true                      false: KV payloads are
                                                                     staged (gather, one UCX
                                                                     message, receive buffer +
                                                                     install; A/B only)
DISAGG_KV_IPC              boolean         true                      false: never read a
                                                                     context rank's GPU KV
                                                                     cache mapped into this
                                                                     process (same host, CUDA
                                                                     IPC); move the bytes
CUDA_VISIBLE_DEVICES       list of ids     unset: all GPUs           GPUs ``disagg launch`` may
                                                                     give its workers
UCX_TLS                    str             unset                     UCX's transports: read only
                                                                     to explain staging decisions
OPENAI_API_KEY             str             none                      ``disagg bench``'s default
                                                                     ``--api-key``
DISAGG_ROUTER_UVLOOP       boolean         unset: uvloop if there    ``disagg router``'s event
                                                                     loop: true uvloop (an error
                                                                     without it), false asyncio's
DISAGG_TORCH_CUDA_PY       boolean         false                     true: torch imports CUDA's
                                                                     Python packages even where
                                                                     its build has no GPU
                                                                     (``torch_import.py``)
DISAGG_LAUNCH_ID           str             none                      set by ``disagg launch``,
                                                                     fresh for each child start:
                                                                     ``disagg serve`` / ``router``
                                                                     name it as ``launch_id`` in
                                                                     ``/health`` (procs.py)
=========================  ==============  ========================  =========================

Writes stay where they happen, each for a reason: ``transfer/ucx.py`` sets UCX's own
variables with ``setdefault`` before libucx loads (libucx reads them, not us), and
``launch.py`` builds its children's environment (a fresh cluster token, unbuffered output,
``CUDA_VISIBLE_DEVICES`` per worker, a launch id per start).

Torch-free and dependency-free: anything may import it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("0", "false", "no", "off", "n")


class EnvError(ValueError):
    """An environment variable holds a value its parser rejects; the message names it."""


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One variable: ``get()`` is its parsed value, or ``default`` when it is unset.

    ``parse`` gets the raw text (possibly empty: an empty variable is a value, not unset, for
    variables that give it a meaning, e.g. ``CUDA_VISIBLE_DEVICES=""`` means no GPU) and
    raises ``ValueError`` saying what it expected; ``get`` adds the variable's name.
    """

    name: str
    parse: Callable[[str], T]
    default: T
    help: str

    def raw(self) -> str | None:
        """The text as set (None: unset)."""
        return os.environ.get(self.name)

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise EnvError(f"${self.name}={raw!r}: {e}") from None


# ---- parsers: raise ValueError saying what was expected ---------------------------------------


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)})")


def parse_positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number of seconds > 0") from None
    if not value > 0:  # also NaN
        raise ValueError("expected a number of seconds > 0")
    return value


def _bool_default_true(text: str) -> bool:
    return parse_bool(text) if text.strip() else True  # set but empty: as if unset


def _optional_str(text: str) -> str | None:
    return text or None  # empty: as if unset


def _str(text: str) -> str:
    return text


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# Kernels of disagg/model/kernels.py (cpu_ops.py: elementwise; cpu_decoder.py: decoder) that
# DISAGG_CPU_KERNELS can name one by one.
CPU_KERNEL_NAMES = ("attention", "linear", "elementwise", "decoder")


def parse_cpu_kernels(text: str) -> frozenset[str]:
    """The enabled kernel names: on/off words switch all of them; ``""`` is off."""
    value = text.strip().lower()
    if value in (*_FALSE, ""):
        return frozenset()
    if value in (*_TRUE, "all"):
        return frozenset(CPU_KERNEL_NAMES)
    names = frozenset(_csv(value))
    unknown = sorted(names - set(CPU_KERNEL_NAMES))
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}: expected 1/0 (on/off) or a comma "
                         f"list of {', '.join(CPU_KERNEL_NAMES)}")
    return names


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return value
    return parse


def _path_or_none(text: str) -> str | None:
    return text or None  # empty: the default


# ---- the variables ------------------------------------------------------------------------------

CLUSTER_TOKEN: EnvVar[str | None] = EnvVar(
    "DISAGG_CLUSTER_TOKEN", _optional_str, None,
    "the cluster's shared secret when no --cluster-token / cluster_token is configured")
CPU_KERNELS: EnvVar[frozenset[str]] = EnvVar(
    "DISAGG_CPU_KERNELS", parse_cpu_kernels, frozenset(CPU_KERNEL_NAMES),
    "CPU C++ kernels to use: 1/0 for all/none, or a comma list of attention, linear")
CUDA_ATTENTION: EnvVar[str] = EnvVar(
    "DISAGG_CUDA_ATTENTION", _choice("triton", "torch"), "triton",
    "attention on CUDA: triton (the Triton kernels, when triton imports) or torch (SDPA)")
KERNEL_CACHE_DIR: EnvVar[str | None] = EnvVar(
    "DISAGG_CACHE_DIR", _path_or_none, None,
    "root of the compiled CPU kernels (default ~/.cache/disagg)")
CACHE: EnvVar[str | None] = EnvVar(
    "DISAGG_CACHE", _path_or_none, None,
    "root of the tiny demo model and launch logs (default $XDG_CACHE_HOME/disagg, else "
    "~/.cache/disagg)")
XDG_CACHE_HOME: EnvVar[str | None] = EnvVar(
    "XDG_CACHE_HOME", _path_or_none, None,
    "the user's cache folder (XDG base directories); DISAGG_CACHE's default lives in it")
DIST_TIMEOUT_S: EnvVar[float] = EnvVar(
    "DISAGG_DIST_TIMEOUT_S", parse_positive_float, 300.0,
    "seconds a collective / send / recv between the ranks of a worker may wait for a peer")
STARTUP_TIMEOUT_S: EnvVar[float] = EnvVar(
    "DISAGG_STARTUP_TIMEOUT_S", parse_positive_float, 600.0,
    "seconds the other ranks of a parallel worker get to load their shards and join")
KV_DEVICE_DIRECT: EnvVar[bool] = EnvVar(
    "DISAGG_KV_DEVICE_DIRECT", _bool_default_true, True,
    "false: never hand GPU memory to UCX; a GPU KV cache stages in pinned host memory")
KV_RECV_POOL: EnvVar[bool] = EnvVar(
    "DISAGG_KV_RECV_POOL", _bool_default_true, True,
    "false: a generation worker allocates a fresh host receive buffer for every KV pull")
KV_RUNS: EnvVar[bool] = EnvVar(
    "DISAGG_KV_RUNS", _bool_default_true, True,
    "false: KV payloads are gathered into a staging buffer, sent as one UCX message and "
    "received into a buffer then installed, as before runs were sent and received in place")
KV_IPC: EnvVar[bool] = EnvVar(
    "DISAGG_KV_IPC", _bool_default_true, True,
    "false: a generation rank never maps a context rank's GPU KV cache (same host, CUDA IPC) "
    "and reads it from there; the payload bytes travel over the transport instead")
CUDA_VISIBLE_DEVICES: EnvVar[list[str] | None] = EnvVar(
    "CUDA_VISIBLE_DEVICES", _csv, None,
    "GPUs disagg launch may give its workers (unset: every GPU nvidia-smi lists)")
UCX_TLS: EnvVar[str] = EnvVar(
    "UCX_TLS", _str, "",
    "UCX's transport list (UCX reads it; the package only quotes it when it explains why KV "
    "is staged through host memory)")
API_KEY: EnvVar[str | None] = EnvVar(
    "DISAGG_API_KEY", _optional_str, None,
    "the API key clients of the router / a worker send when api_key (--api-key) is unset "
    "(Kubernetes: from a Secret)")
OPENAI_API_KEY: EnvVar[str | None] = EnvVar(
    "OPENAI_API_KEY", _optional_str, None, "disagg bench's default --api-key")
LAUNCH_ID: EnvVar[str | None] = EnvVar(
    "DISAGG_LAUNCH_ID", _optional_str, None,
    "set by disagg launch for each child it starts (fresh each time): the child names it as "
    "launch_id in GET /health, so the launcher tells its child's answer from another "
    "process's on that port (an identity, not a secret)")
ROUTER_UVLOOP: EnvVar[bool | None] = EnvVar(
    "DISAGG_ROUTER_UVLOOP", parse_bool, None,
    "disagg router's event loop: true uvloop (an error when it is not installed), false "
    "asyncio's own; unset: uvloop when installed (a dependency except on Windows)")

TORCH_CUDA_PY: EnvVar[bool] = EnvVar(
    "DISAGG_TORCH_CUDA_PY", parse_bool, False,
    "true: torch's import loads pynvml and cuda-bindings even where its build has no GPU (as "
    "without disagg); false / unset: import disagg keeps them out of a CPU-only torch's import")

VARIABLES: tuple[EnvVar, ...] = (
    CLUSTER_TOKEN, API_KEY, CPU_KERNELS, CUDA_ATTENTION, KERNEL_CACHE_DIR, CACHE, XDG_CACHE_HOME,
    DIST_TIMEOUT_S, STARTUP_TIMEOUT_S, KV_DEVICE_DIRECT, KV_RECV_POOL, KV_RUNS, KV_IPC,
    CUDA_VISIBLE_DEVICES,
    UCX_TLS, OPENAI_API_KEY, ROUTER_UVLOOP, LAUNCH_ID, TORCH_CUDA_PY)


def cache_root() -> str:
    """``$DISAGG_CACHE``, else ``$XDG_CACHE_HOME/disagg``, else ``~/.cache/disagg``."""
    xdg = XDG_CACHE_HOME.get() or os.path.join(os.path.expanduser("~"), ".cache")
    return CACHE.get() or os.path.join(xdg, "disagg")


def kernel_cache_root() -> str:
    """``$DISAGG_CACHE_DIR``, else ``~/.cache/disagg``."""
    return KERNEL_CACHE_DIR.get() or os.path.join(os.path.expanduser("~"), ".cache", "disagg")
