"""`disagg demo` (an alias of the README's first command, `disagg launch`), the offline
`disagg generate`, and what the command line imports and does at its end."""

from __future__ import annotations

import subprocess
import sys


def test_demo_is_the_launch_demo():
    """`disagg demo` (the old first command) runs `disagg launch` without -c, whose end to
    end test is in test_launch.py."""
    from disagg.cli import build_parser
    from disagg.launch import run

    args = build_parser().parse_args(["demo", "--max-tokens", "8", "--keep-running"])
    assert args.func is run and args.config is None and args.model is None
    assert args.max_tokens == 8 and args.keep_running and args.timeout > 0
    assert args.message == "What is the capital of France?"
    # The demo's model choice (SmolLM2, else tiny) can be overridden as with `launch`.
    assert build_parser().parse_args(["demo", "--model", "tiny"]).model == "tiny"


def test_generate_cli(tiny_llama):
    proc = subprocess.run([sys.executable, "-m", "disagg.cli", "generate", tiny_llama, "-p",
                           "Hello", "--max-tokens", "5", "--kv-cache-tokens", "512"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "prompt: 'Hello'" in proc.stdout and "5 tokens" in proc.stdout


def test_cli_reports_bad_option(tiny_llama):
    proc = subprocess.run([sys.executable, "-m", "disagg.cli", "generate", tiny_llama,
                           "--top-p", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "top_p" in proc.stderr


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120)


def test_a_command_imports_only_its_own_module():
    """`disagg serve` builds serve's parser alone (no router, bench, deploy ... imports at every
    worker's start); no command, or one it does not know, gets every command's."""
    from disagg.cli import SUBCOMMANDS

    code = """if True:
        import sys
        from disagg import cli
        mods = {m for _, m in cli.SUBCOMMANDS}
        parser = cli.build_parser(sys.argv[1] if len(sys.argv) > 1 else None)
        print(sorted(m for m in mods if m in sys.modules))
        print(sorted(parser._subparsers._group_actions[0].choices))
    """
    alone = _python(code, "serve")
    assert alone.stdout.split("\n")[:2] == ["['disagg.server.cli']", "['serve']"], alone.stderr
    for command in ((), ("serv",)):
        every = _python(code, *command)
        assert every.stdout.split("\n")[1] == str(sorted(c for c, _ in SUBCOMMANDS)), every
    # the one-command parser is the full parser's subcommand: same options, same usage
    proc = subprocess.run([sys.executable, "-m", "disagg.cli", "serve", "--port", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: disagg serve ")
    assert "argument --port: invalid int value: 'x'" in proc.stderr


def test_the_command_freezes_the_heap_as_it_ends():
    """``cli.run`` (the console script, ``python -m disagg.cli``) ends with every object in the
    collector's permanent generation (procs.freeze_for_exit) and its exit code; ``main``, which
    tests and scripts call, leaves the heap alone."""
    show = "import atexit, gc; atexit.register(lambda: print('frozen', gc.get_freeze_count()))"
    ran = _python(f"{show}\nfrom disagg.cli import run\nrun()")
    assert ran.returncode == 2 and "usage: disagg" in ran.stdout  # no command: help, 2
    frozen = int(ran.stdout.rsplit("frozen", 1)[1])
    assert frozen > 10000, ran.stdout
    called = _python(f"{show}\nfrom disagg.cli import main\nmain([])")
    assert called.returncode == 0 and called.stdout.rstrip().endswith("frozen 0"), called
