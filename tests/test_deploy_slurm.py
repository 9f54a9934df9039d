"""``disagg deploy slurm``: the rendered sbatch script is shellcheck-clean for every config, and
it really runs a cluster: under a fake ``srun`` / ``scontrol`` (tests/fake_slurm/) that starts
each job step inside its own network namespace (one "node" each, tests/netns.py), the cluster
answers a completion through the router with the KV moving between the namespaces; a stop
signal (scancel) drains and reaps every step, and a step that dies takes the job down with it
(exit 1, the other steps stopped and reaped)."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from netns import NetLab, require_netns

from disagg import procs
from disagg.cli import main as disagg_main

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
FAKE_SLURM = Path(__file__).resolve().parent / "fake_slurm"
READY_TIMEOUT_S = 90.0  # two tiny workers load and register (2 shared cores)
STOP_TIMEOUT_S = 30.0  # drain (2 s here) + the script's bounded teardown


def render(tmp_path: Path, config: Path, *extra: str) -> Path:
    out = tmp_path / f"{config.stem}.sbatch"
    assert disagg_main(["deploy", "slurm", "-c", str(config), "-o", str(out), *extra]) == 0
    return out


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
@pytest.mark.parametrize("extra", [(), ("--cpu",)], ids=["gpu", "cpu"])
def test_rendered_script_is_shellcheck_clean(tmp_path: Path, config: Path,
                                             extra: tuple[str, ...]) -> None:
    script = render(tmp_path, config, *extra)
    cp = subprocess.run(["shellcheck", "--severity=info", str(script)], capture_output=True,
                        text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    text = script.read_text()
    # one node for the router + one per worker; GPUs per task = tp * pp on GPU groups
    import yaml

    raw = yaml.safe_load(config.read_text())
    workers = sum(raw[s]["num_instances"] for s in ("context_servers", "generation_servers")
                  if s in raw)
    assert f"#SBATCH --nodes={1 + workers}\n" in text
    assert text.count("\nsrun ") == 1 + workers
    for section in ("context_servers", "generation_servers"):
        if section not in raw:
            continue
        sec = raw[section]
        world = sec.get("tensor_parallel_size", 1) * sec.get("pipeline_parallel_size", 1)
        for url in sec["urls"]:
            assert f"--port {url.rsplit(':', 1)[1]} " in text
        flag = f"--cpus-per-task={world}" if extra else f"--gpus-per-task={world}"
        assert flag in text
    assert "DISAGG_CLUSTER_TOKEN=" in text and "cluster_token" not in text


def test_a_packaged_model_is_brought_as_its_gguf_file(tmp_path: Path) -> None:
    # smollm2: written once on the shared filesystem as its GGUF file, served as a .gguf.
    config = tmp_path / "c.yaml"
    config.write_text("model: smollm2\ngeneration_servers: {urls: ['h:8001']}\n")
    text = render(tmp_path, config, "--cpu").read_text()
    gguf = "models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # (the job folder's models/)
    assert f"[[ -e {gguf} ]] || disagg model fetch smollm2 models/smollm2 --gguf\n" in text
    assert f"\nmodel: {gguf}\n" in text


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_fake_slurm_is_shellcheck_clean() -> None:
    scripts = sorted(str(p) for p in FAKE_SLURM.iterdir())
    cp = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True, timeout=60)
    assert len(scripts) == 3 and cp.returncode == 0, cp.stdout + cp.stderr


def test_checked_in_example_is_up_to_date(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """deploy/slurm/job.sbatch is what the command renders today."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "job.sbatch"
    assert disagg_main(["deploy", "slurm", "-c", "configs/disagg_1ctx_1gen.yaml", "-o",
                        str(out)]) == 0
    checked_in = (REPO / "deploy/slurm/job.sbatch").read_text()
    rendered = out.read_text().replace(str(out), "deploy/slurm/job.sbatch")
    assert rendered == checked_in, ("deploy/slurm/job.sbatch is stale: re-render it with "
                                    "`disagg deploy slurm -c configs/disagg_1ctx_1gen.yaml -o "
                                    "deploy/slurm/job.sbatch`")


def test_api_keys_stay_the_owners(tmp_path: Path) -> None:
    """A YAML with API keys: the script is mode 0700 and writes the job's YAMLs under umask
    077 (mode 0600: other users of the shared filesystem cannot read the keys); one without
    keys keeps 0755 and the default umask."""
    config = tmp_path / "keyed.yaml"
    config.write_text("model: tiny\napi_key: key-r\ngeneration_servers: {urls: ['h:8001'], "
                      "api_key: key-g}\ncontext_servers: {urls: ['h:8002']}\n")
    script = render(tmp_path, config)
    assert stat.S_IMODE(script.stat().st_mode) == 0o700
    lines = script.read_text().splitlines()
    first_yaml = lines.index("cat > router.yaml <<'DISAGG_EOF'")
    assert "umask 077" in lines[first_yaml - 1]
    last = max(i for i, line in enumerate(lines) if line == "DISAGG_EOF")
    job = tmp_path / "job"
    job.mkdir()
    subprocess.run(["bash", "-c", "\n".join(lines[first_yaml - 1:last + 1])], cwd=job,
                   check=True, timeout=30)
    for name in ("router.yaml", "context.yaml", "generation.yaml"):
        assert stat.S_IMODE((job / name).stat().st_mode) == 0o600, name
    assert "key-g" in (job / "generation.yaml").read_text()
    plain = render(tmp_path, REPO / "configs" / "disagg_1ctx_1gen.yaml")
    assert stat.S_IMODE(plain.stat().st_mode) == 0o755
    assert "umask" not in plain.read_text()


# -- the script under a fake Slurm -----------------------------------------------------------


class FakeJob:
    """The rendered script run as a Slurm job would be, its steps in ``lab``'s hosts."""

    def __init__(self, lab: NetLab, script: Path, workdir: Path, nodes: int) -> None:
        self.hosts = [lab.add_host(f"node{i}") for i in range(nodes)]
        table = workdir / "nodes.txt"
        table.write_text("".join(f"{h.addr} {h.ns}\n" for h in self.hosts))
        env = {**os.environ,
               "PATH": f"{FAKE_SLURM}:{os.environ.get('PATH', '')}",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "FAKE_SLURM_NODES": str(table), "FAKE_SLURM_PYTHON": sys.executable,
               "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(workdir),
               "SLURM_JOB_NODELIST": ",".join(h.addr for h in self.hosts)}
        env.pop("DISAGG_CLUSTER_TOKEN", None)  # the job makes its own
        self.out = workdir / "disagg-4242.out"
        self.job_dir = workdir / "disagg-4242"
        self.proc = procs.spawn(["bash", str(script)], self.out, env=env, cwd=workdir,
                                die_with_parent=True)
        self.lab = lab

    def log(self) -> str:
        parts = [f"--- job output ---\n{procs.log_tail(self.out, 60)}"]
        for log in sorted((self.job_dir / "logs").glob("*.log")):
            parts.append(f"--- {log.name} ---\n{procs.log_tail(log, 30)}")
        return "\n".join(parts)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "cluster ready:" not in self.out.read_text():
            assert self.proc.poll() is None, f"the job exited ({self.proc.returncode})\n" \
                                             f"{self.log()}"
            assert time.monotonic() < deadline, f"not ready in {READY_TIMEOUT_S} s\n{self.log()}"
            time.sleep(0.2)  # start-up polling, bounded by the deadline

    def wait_exit(self) -> int:
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not stop in {STOP_TIMEOUT_S} s\n{self.log()}")

    def pids_in_namespaces(self) -> dict[str, list[str]]:
        out = {}
        for h in self.hosts:
            cp = subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True, text=True,
                                timeout=10)
            out[h.name] = cp.stdout.split()
        return out


@pytest.fixture
def fake_job(tmp_path: Path, model_dir: str):
    """The disagg_1ctx_1gen job (the tiny model, CPU, 2 s drain) on three fake nodes."""
    require_netns()
    script = render(tmp_path, REPO / "configs/disagg_1ctx_1gen.yaml", "--cpu", "--model",
                    model_dir, "--drain-timeout", "2", "--startup-timeout",
                    str(int(READY_TIMEOUT_S)))
    with NetLab() as lab:
        job = FakeJob(lab, script, tmp_path, nodes=3)
        try:
            yield job
        finally:
            procs.stop(job.proc, grace_s=STOP_TIMEOUT_S)



@pytest.mark.slow
def test_job_serves_across_namespaces_and_stops_on_scancel(fake_job: FakeJob,
                                                           model_dir: str) -> None:
    job = fake_job
    job.wait_ready()
    router, ctx, gen = job.hosts
    base = f"http://{router.addr}:8000"
    with httpx.Client(trust_env=False, timeout=60) as http:  # the lab: never a proxy
        # the workers registered the addresses of their own nodes (--advertise-host)
        info = http.get(f"{base}/cluster_info").json()
        assert [w["url"] for w in info["workers"]["context"]] == [f"{ctx.addr}:8001"]
        assert [w["url"] for w in info["workers"]["generation"]] == [f"{gen.addr}:8002"]
        r = http.post(f"{base}/v1/completions", json={
            "model": model_dir, "prompt": "Hello there", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        # the prompt's KV came from the context node to the generation node
        metrics = http.get(f"http://{gen.addr}:8002/metrics").text
        moved = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("disagg_kv_transfer_bytes_total")]
        assert moved and sum(moved) > 0, metrics[:2000]
    job.proc.send_signal(signal.SIGTERM)  # what scancel / the time limit's --signal do
    assert job.wait_exit() == 0, job.log()
    out = job.out.read_text()
    assert "stop signal: draining" in out and "cluster stopped" in out
    assert job.pids_in_namespaces() == {h.name: [] for h in job.hosts}, job.log()


@pytest.mark.slow
def test_a_dead_step_takes_the_job_down(fake_job: FakeJob) -> None:
    job = fake_job
    job.wait_ready()
    gen = job.hosts[2]
    for pid in job.pids_in_namespaces()[gen.name]:  # the generation worker dies
        os.kill(int(pid), signal.SIGKILL)
    assert job.wait_exit() == 1, job.log()
    out = job.out.read_text()
    assert "step generation0 exited" in out and "cluster stopped" in out, out
    assert job.pids_in_namespaces() == {h.name: [] for h in job.hosts}, job.log()
