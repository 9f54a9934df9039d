"""``disagg doctor``: check a KV transfer link before serving over it.

Moves test blocks (by default 2048 tokens of an 8B model's KV per rank, 256 MiB) through the KV
transfer backend a worker would use, between two processes, and prints the bandwidth, the
latency of small reads, the transports UCX selected (or the TCP socket's route) and a verdict
against a reference: memcpy on this host (measured in the same run) for a peer on this host,
the expected link rate (``--expected-link-gbps``, YAML ``expected_link_gbps``) for a peer on
another host. Below ``--min-share`` of the reference (default 0.5 of a link rate, 0.2 of
memcpy) it says SLOW on stderr too and exits 1. The measurement is
``disagg.transfer.linkcheck``'s (its docstring says what is timed).

Modes::

    disagg doctor [--local]              # serve test blocks here, pull them in a child process
                                         # (this host: the backend, its transports, vs memcpy)
    disagg doctor --serve-kv HOST:PORT   # host A: serve test blocks until interrupted
    disagg doctor --peer HOST:PORT       # host B: pull them from host A, judge the link

``-c FILE`` (a worker YAML or a disagg cluster YAML: its generation section, the pulling side)
gives the defaults of ``--backend`` / ``--ucx-profile`` (``cache_transceiver_config``),
``--cluster-token`` (``cluster_token``, else ``$DISAGG_CLUSTER_TOKEN``) and
``--expected-link-gbps`` (``expected_link_gbps``); flags win. Both ends of a two-host check
need the same cluster token and the same block flags. ``--json`` prints the judged result as
one JSON object instead of the report.

Exit codes: 0 ok (or measured without a reference: another host and no expected rate), 1 slow
or failed (no test blocks could be read), 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import sys
import threading
from typing import Any

from disagg.config import ConfigError
from disagg.transfer.linkcheck import (
    DEFAULT_LATENCY_READS,
    DEFAULT_REPS,
    DEFAULT_TIMEOUT_S,
    DTYPE_SIZES,
    MIN_SHARE,
    ProbeBlocks,
)

UCX_PROFILES = ("auto", "same_host", "cross_host")
_DEFAULT_BLOCKS = ProbeBlocks()


def _at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _share(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (0.5: half), got {text}")
    return value


def _address(text: str) -> str:
    from disagg.transfer.base import parse_address

    try:
        parse_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}") from None
    return text


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor", help="check a KV transfer link: bandwidth, latency and transports against "
        "memcpy or the expected link rate", description=__doc__.split("\n\n")[0]
        + " Modes: --local (the default), --serve-kv on one host + --peer on another.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true",
                      help="(the default) serve test blocks here and pull them in a second "
                      "process on this host; judged against memcpy")
    mode.add_argument("--serve-kv", type=_address, metavar="HOST:PORT",
                      help="serve test blocks on HOST:PORT (port 0: any free one) until "
                      "interrupted, for `disagg doctor --peer` on another host")
    mode.add_argument("--peer", type=_address, metavar="HOST:PORT",
                      help="pull the test blocks of `disagg doctor --serve-kv` at HOST:PORT; "
                      "judged against --expected-link-gbps (memcpy when on this host)")
    p.add_argument("-c", "--config", metavar="YAML",
                   help="a worker YAML or a disagg cluster YAML: defaults for --backend, "
                   "--ucx-profile, --cluster-token and --expected-link-gbps")
    p.add_argument("--backend", type=str.lower, choices=("ucx", "tcp"),
                   help="KV transfer backend (default: the YAML's, else UCX when ucxx "
                   "imports, else TCP: what a worker picks)")
    p.add_argument("--ucx-profile", choices=UCX_PROFILES,
                   help="UCX transports (default: the YAML's, else auto: cross_host unless the "
                   "KV address is loopback)")
    p.add_argument("--cluster-token", metavar="TOKEN",
                   help="the cluster's shared secret, the same on both ends (default: the "
                   "YAML's, else $DISAGG_CLUSTER_TOKEN; --local makes one up)")
    p.add_argument("--expected-link-gbps", type=_positive_float, metavar="GB/S",
                   help="the link rate a peer on another host should reach, in GB/s (e.g. "
                   "12.5 for 100 Gb/s; YAML expected_link_gbps)")
    p.add_argument("--min-share", type=_share, metavar="F",
                   help=f"slow below this share of the reference (default "
                   f"{MIN_SHARE['link']:g} of a link rate, {MIN_SHARE['memcpy']:g} of memcpy)")
    g = p.add_argument_group("test blocks (both ends the same)")
    g.add_argument("--tokens", type=_at_least(1), default=_DEFAULT_BLOCKS.tokens,
                   help="tokens of KV per read (default %(default)s)")
    g.add_argument("--layers", type=_at_least(1), default=_DEFAULT_BLOCKS.layers,
                   help="layers per rank (default %(default)s)")
    g.add_argument("--kv-heads", type=_at_least(1), default=_DEFAULT_BLOCKS.kv_heads,
                   help="kv heads per rank (default %(default)s)")
    g.add_argument("--head-dim", type=_at_least(1), default=_DEFAULT_BLOCKS.head_dim,
                   help="default %(default)s")
    g.add_argument("--kv-parts", type=int, choices=(1, 2), default=_DEFAULT_BLOCKS.kv_parts,
                   help="2: K and V; 1: an MLA latent (default %(default)s)")
    g.add_argument("--tokens-per-block", type=_at_least(1),
                   default=_DEFAULT_BLOCKS.tokens_per_block, help="default %(default)s")
    g.add_argument("--dtype", choices=tuple(DTYPE_SIZES), default=_DEFAULT_BLOCKS.dtype,
                   help="default %(default)s")
    m = p.add_argument_group("measurement")
    m.add_argument("--reps", type=_at_least(1), default=DEFAULT_REPS,
                   help="timed reads of all blocks (default %(default)s)")
    m.add_argument("--latency-reads", type=_at_least(1), default=DEFAULT_LATENCY_READS,
                   help="timed small reads (default %(default)s)")
    m.add_argument("--timeout", type=_positive_float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="seconds one read may take (default %(default)g)")
    m.add_argument("--json", action="store_true",
                   help="print the result as one JSON object")
    p.set_defaults(func=_cmd_doctor, _parser=p)


# ---- settings ---------------------------------------------------------------------------------


def _file_options(path: str) -> Any:
    """The ``WorkerOptions`` of a worker YAML, or of a cluster YAML's generation section (else
    its context section, else its top-level worker keys); ``ConfigError`` naming the key."""
    from disagg.config import read_yaml
    from disagg.contracts.cluster import SECTIONS, load_cluster_config
    from disagg.contracts.options import (
        WorkerOptions,
        load_worker_yaml,
        options_from_yaml,
        worker_yaml_keys,
    )

    data = read_yaml(path)
    if isinstance(data, dict) and any(k in data for k in (*SECTIONS, "disagg_cluster")):
        cfg = load_cluster_config(path)
        group = cfg.generation_servers or cfg.context_servers
        if group is not None:
            return group.options()
        keys = worker_yaml_keys()
        return WorkerOptions(**options_from_yaml({k: v for k, v in data.items() if k in keys},
                                                 path))
    return WorkerOptions(**load_worker_yaml(path))


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Backend, UCX profile, token and expected rate: flags > the YAML > defaults.
    ``ConfigError`` on a bad YAML."""
    from disagg.cluster_auth import cluster_token_or_none

    opts = _file_options(args.config) if args.config else None
    backend = args.backend or (opts.kv_transfer_backend if opts else None)
    if not backend:
        from disagg.transfer.backends import default_backend

        backend = default_backend()[0]
    return {
        "backend": backend.upper(),
        "ucx_profile": args.ucx_profile or (opts.ucx_profile if opts else "auto"),
        "token": args.cluster_token or cluster_token_or_none(opts.cluster_token if opts
                                                             else None),
        "expected_flag": args.expected_link_gbps,
        "expected": args.expected_link_gbps or (opts.expected_link_gbps if opts else None),
    }


def _blocks(args: argparse.Namespace) -> ProbeBlocks:
    return ProbeBlocks(tokens=args.tokens, layers=args.layers, kv_parts=args.kv_parts,
                       kv_heads=args.kv_heads, head_dim=args.head_dim,
                       tokens_per_block=args.tokens_per_block, dtype=args.dtype)


def _profile(profile: str, host: str) -> str:
    from disagg.transfer.ucx import resolve_ucx_profile

    return resolve_ucx_profile(profile, host)[0]


# ---- the modes --------------------------------------------------------------------------------


def _print_result(result: dict[str, Any], as_json: bool) -> int:
    from disagg.transfer.linkcheck import report_lines, verdict_line

    if as_json:
        print(json.dumps(result), flush=True)
    else:
        print("\n".join(report_lines(result)), flush=True)
    if result["verdict"] in ("slow", "failed"):
        what = "SLOW KV LINK" if result["verdict"] == "slow" else "KV LINK CHECK FAILED"
        print(f"disagg doctor: {what}: {result.get('address')}: {verdict_line(result)}",
              file=sys.stderr, flush=True)
        return 1
    return 0


def _peer(args: argparse.Namespace, s: dict[str, Any]) -> int:
    from disagg.transfer.base import parse_address
    from disagg.transfer.linkcheck import judge, measure_link, same_host

    local = same_host(args.peer)
    # The YAML's expected link rate is for another host; the flag applies anywhere.
    expected = s["expected_flag"] if local else s["expected"]
    host, _ = parse_address(args.peer)
    try:
        result = measure_link(args.peer, _blocks(args), s["backend"], s["token"],
                              ucx_profile=_profile(s["ucx_profile"], host), reps=args.reps,
                              latency_reads=args.latency_reads, timeout_s=args.timeout,
                              memcpy=local)
    except (RuntimeError, ValueError, OSError) as e:  # LinkCheckError, or no ucxx for UCX
        return _print_result({"address": args.peer, "verdict": "failed", "error": str(e)},
                             args.json)
    return _print_result(judge(result, expected, args.min_share), args.json)


def _local(args: argparse.Namespace, s: dict[str, Any]) -> int:
    from disagg.transfer.backends import make_backend
    from disagg.transfer.linkcheck import (
        LinkCheckError,
        run_peer_check,
        serve_probe_blocks,
    )

    host = "127.0.0.1"
    profile = _profile(s["ucx_profile"], host)
    blocks = _blocks(args)
    token = s["token"] or secrets.token_hex(16)  # both ends are ours
    backend = make_backend({"backend": s["backend"], "ucx_profile": profile})
    try:
        server = serve_probe_blocks(blocks, backend, token, host)
    except (RuntimeError, OSError, ValueError) as e:
        print(f"disagg doctor: error: cannot serve test blocks over {s['backend']}: {e}",
              file=sys.stderr)
        return 1
    try:
        if not args.json:
            print(f"serving test blocks over {s['backend']} on {server.address}; pulling "
                  f"them in a second process ...", flush=True)
        result = run_peer_check(server.address, blocks, s["backend"], token,
                                ucx_profile=profile, reps=args.reps,
                                latency_reads=args.latency_reads, timeout_s=args.timeout,
                                expected_gbps=s["expected_flag"], min_share=args.min_share)
    except LinkCheckError as e:
        result = {"address": server.address, "verdict": "failed", "error": str(e)}
    finally:
        server.stop()
    return _print_result(result, args.json)


def _serve(args: argparse.Namespace, s: dict[str, Any]) -> int:
    from disagg.addresses import first_non_loopback, host_port, is_wildcard
    from disagg.transfer.backends import make_backend
    from disagg.transfer.base import parse_address
    from disagg.transfer.linkcheck import serve_probe_blocks

    if not s["token"]:
        print("disagg doctor: error: --serve-kv needs the cluster token (--cluster-token, "
              "cluster_token in -c YAML, or $DISAGG_CLUSTER_TOKEN): the peer proves it",
              file=sys.stderr)
        return 2
    host, port = parse_address(args.serve_kv)
    # A wildcard bind: peers use this host's address (as a worker would advertise it).
    shown = (first_non_loopback() or host) if is_wildcard(host) else host
    backend = make_backend({"backend": s["backend"],
                            "ucx_profile": _profile(s["ucx_profile"], shown)})
    blocks = _blocks(args)
    try:
        server = serve_probe_blocks(blocks, backend, s["token"], host, port,
                                    advertise_host=shown)
    except (RuntimeError, OSError, ValueError) as e:
        print(f"disagg doctor: error: cannot serve on {args.serve_kv}: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        detail = _describe_backend(backend)
        print(f"serving KV test blocks ({blocks.describe()}) over {s['backend']}{detail}",
              flush=True)
        print(f"listening on {server.address}", flush=True)
        port = parse_address(server.address)[1]
        print(f"on the other host: disagg doctor --peer {host_port(shown, port)} "
              f"[the same block flags] --expected-link-gbps GB/S; Ctrl-C stops", flush=True)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.stop()
    return 0


def _describe_backend(backend: Any) -> str:
    """The UCX profile, UCX_TLS and context transports of a started backend ("" for TCP)."""
    describe = getattr(backend, "describe", None)
    if describe is None:
        return ""
    d = describe()
    return (f" (profile {d['profile']}, UCX_TLS={d['ucx_tls']}; context transports "
            f"{', '.join(d['transports']) or '?'})")


def _cmd_doctor(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args._parser
    if args.serve_kv and (args.expected_link_gbps or args.min_share or args.json):
        parser.error("--expected-link-gbps, --min-share and --json judge a pull (--peer or "
                     "--local); the --serve-kv end only serves")
    try:
        s = _settings(args)
        _blocks(args)
    except (ConfigError, ValueError) as e:
        print(f"disagg doctor: error: {e}", file=sys.stderr)
        return 2
    if args.peer and not s["token"]:
        print("disagg doctor: error: --peer needs the cluster token of the --serve-kv end "
              "(--cluster-token, cluster_token in -c YAML, or $DISAGG_CLUSTER_TOKEN)",
              file=sys.stderr)
        return 2
    if args.serve_kv:
        return _serve(args, s)
    if args.peer:
        return _peer(args, s)
    return _local(args, s)


def main(argv: list[str] | None = None) -> int:
    """``python -m disagg.doctor ARGS``: ``disagg doctor ARGS`` without importing the other
    subcommands (the link check's child process starts faster)."""
    parser = argparse.ArgumentParser(prog="disagg")
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
