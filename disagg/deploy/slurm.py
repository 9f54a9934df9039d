"""An sbatch script of a ``DeployPlan`` (``disagg deploy slurm``).

One allocation of ``1 + sum(num_instances)`` nodes, one job step per process: the router on
the first node, then every worker on a node of its own (``--gpus-per-task`` = tp * pp on GPU
groups). Node addresses come from ``scontrol show hostnames "$SLURM_JOB_NODELIST"``; each
worker binds every interface and registers ``NODE:PORT`` with the router (``--router-url``,
``--advertise-host NODE``). The job's files live in ``$SLURM_SUBMIT_DIR/disagg-$SLURM_JOB_ID``
(``$DISAGG_JOB_DIR`` overrides): the YAMLs, a generated model, ``logs/<step>.log``. It must be
on a filesystem every node sees (the usual home / project filesystem).

The cluster token is made fresh per job (unless ``$DISAGG_CLUSTER_TOKEN`` is set) and reaches
the steps through their environment only. API keys in the YAML stay the owner's: the script is
mode 0700 and writes the job's files under ``umask 077``. The script waits for the router's
``/health`` (every worker registered and healthy), prints the endpoint, and then keeps the
cluster up until the job ends: a stop signal (``scancel``, or ``--signal=B:TERM`` before the
time limit) drains and stops every step and exits 0; a step that exits on its own stops the
rest and exits 1; a start-up that fails or times out too. Stopping is bounded: steps still
running after the drain timeout plus a margin are killed, and every step is reaped before the
script exits.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from disagg.deploy.plan import BIND_ALL, DeployError, DeployPlan, dump_yaml

MODELS_DIR = "models"  # generated models, relative to the job folder


@dataclass(frozen=True)
class SlurmOptions:
    job_name: str = "disagg"
    time: str = "01:00:00"  # sbatch --time
    partition: str | None = None
    account: str | None = None
    startup_timeout_s: int = 1800  # the router healthy (models loaded, workers registered)

    def __post_init__(self) -> None:
        for flag, value in (("--job-name", self.job_name), ("--time", self.time),
                            ("--partition", self.partition), ("--account", self.account)):
            if value is not None and (not value or any(c.isspace() or c in "'\"$`\\#"
                                                       for c in value)):
                raise DeployError(f"{flag}: {value!r}: no spaces, quotes or shell characters")
        if self.startup_timeout_s <= 0:
            raise DeployError(f"--startup-timeout: must be > 0, got {self.startup_timeout_s}")


@dataclass(frozen=True)
class _Step:
    name: str  # router, context0, generation1, ...
    node: int  # index into NODES
    srun_options: tuple[str, ...]
    argv: tuple[str, ...]  # words; a word starting with "$" is a shell expansion


def _steps(plan: DeployPlan) -> Iterator[_Step]:
    yield _Step("router", 0, (), ("disagg", "router", "-c", "router.yaml", "--host", BIND_ALL,
                                  "--port", str(plan.router_port)))
    node = 1
    for g in plan.groups:
        resources = (f"--gpus-per-task={g.gpus}",) if g.gpus else (f"--cpus-per-task={g.world}",)
        for i, port in enumerate(g.ports):
            yield _Step(f"{g.role}{i}", node, resources, (
                "disagg", "serve", "--config", f"{g.role}.yaml", "--role", g.role,
                "--host", BIND_ALL, "--port", str(port), "--router-url", "$ROUTER_URL",
                "--advertise-host", f"${{NODES[{node}]}}"))
            node += 1


def _word(word: str) -> str:
    """A shell word: an expansion double-quoted, anything else quoted as needed."""
    return f'"{word}"' if word.startswith("$") else shlex.quote(word)


def _step_lines(step: _Step) -> list[str]:
    srun = ["srun", "--nodes=1", "--ntasks=1", f'--nodelist="${{NODES[{step.node}]}}"',
            *step.srun_options, f"--output=logs/{step.name}.log"]
    words = [_word(w) for w in step.argv]
    # the command on lines of at most 6 words after the first (readable, diffable)
    lines = [" ".join(words[i:i + 6]) for i in range(0, len(words), 6)]
    cmd = " \\\n    ".join(lines)
    return [" ".join(srun) + " \\", f"  {cmd} &",
            f'track {step.name} "${{NODES[{step.node}]}}"']


def _heredoc(path: str, text: str) -> list[str]:
    marker = "DISAGG_EOF"
    if marker in text:  # cannot happen with YAML dumped from validated options
        raise DeployError(f"{path}: contains {marker}")
    return [f"cat > {path} <<'{marker}'", *text.rstrip("\n").split("\n"), marker]


def _model_lines(plan: DeployPlan) -> list[str]:
    lines = []
    for m in plan.models:
        if m.generated:  # a folder (tiny: its config.json says it is whole) or a .gguf file
            done = m.path if m.path.lower().endswith(".gguf") else f"{m.path}/config.json"
            lines.append(f"[[ -e {shlex.quote(done)} ]] || disagg "
                         + " ".join(shlex.quote(a) for a in m.prepare_args()))
        else:
            path = shlex.quote(m.path)
            lines.append(f'[[ -e {path} ]] || fail "model {path} not found on '
                         f'$(hostname) (it must be on a filesystem every node sees)"')
    return lines


def render(plan: DeployPlan, opts: SlurmOptions, command: str) -> str:
    """The sbatch script."""
    steps = list(_steps(plan))
    gpus = max((g.gpus for g in plan.groups), default=0)
    drain = max(g.grace_period_s for g in plan.groups)
    sbatch = [f"--job-name={opts.job_name}", f"--nodes={len(steps)}", "--ntasks-per-node=1",
              f"--time={opts.time}", "--output=disagg-%j.out",
              # SIGTERM to this script before the time limit: the workers drain.
              f"--signal=B:TERM@{drain + 15}"]
    if gpus:  # every node gets the most any worker needs: the router's node idles them
        sbatch.append(f"--gpus-per-node={gpus}")
    if opts.partition:
        sbatch.append(f"--partition={opts.partition}")
    if opts.account:
        sbatch.append(f"--account={opts.account}")
    layout = "\n".join(f"#   node {s.node}: {s.name}" for s in steps)
    out = [_HEAD.format(command=command, source=plan.source, nodes=len(steps), layout=layout,
                        port=plan.router_port),
           *(f"#SBATCH {o}" for o in sbatch), "",
           _SETUP.format(nodes=len(steps), port=plan.router_port, grace=drain,
                         startup=opts.startup_timeout_s), ""]
    out += ["# The configuration: the router's YAML (workers register; no urls) and one worker "
            "YAML a group."]
    if plan.holds_api_keys:
        out += ["umask 077  # the YAMLs hold API keys: readable by the job's owner only"]
    out += _heredoc("router.yaml", dump_yaml(plan.router_options))
    for g in plan.groups:
        out += _heredoc(f"{g.role}.yaml", dump_yaml(g.options))
    out += ["", "# The model", *_model_lines(plan), "",
            "# The steps: the router on the first node, every worker on a node of its own."]
    for step in steps:
        out += _step_lines(step)
    model = plan.groups[0].options.get("served_model_name")
    out += ["", _RUN.format(model=shlex.quote(str(model)))]
    return "\n".join(out) + "\n"


def write(plan: DeployPlan, opts: SlurmOptions, path: Path, command: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = render(plan, opts, command)
    # API keys in the YAMLs (written into the script): the owner's only, as they are there.
    mode = 0o700 if plan.holds_api_keys else 0o755
    path.touch(mode=mode, exist_ok=True)
    path.chmod(mode)
    path.write_text(text)
    return path


_HEAD = """\
#!/bin/bash
# Rendered by `{command}` from {source}; re-render instead of editing.
#
# A disagg cluster as one Slurm job of {nodes} nodes, one step a process:
{layout}
# Submit from a folder every node sees (the job's files go to ./disagg-<jobid>/), with `disagg`
# on the PATH (e.g. a virtual environment activated before sbatch; steps inherit the
# environment):
#
#   sbatch job.sbatch          # then: grep 'cluster ready' disagg-<jobid>.out
#
# The router listens on the first node's port {port} (OpenAI API: /v1/completions,
# /v1/chat/completions). scancel drains and stops the cluster."""

_SETUP = """\
set -euo pipefail

NODES_NEEDED={nodes}
ROUTER_PORT={port}
STOP_GRACE_S={grace}  # a worker's drain timeout plus a margin to exit
STARTUP_TIMEOUT_S={startup}
: "${{SLURM_JOB_ID:?not in a Slurm job (submit with sbatch)}}"
JOB_DIR="${{DISAGG_JOB_DIR:-${{SLURM_SUBMIT_DIR:-$PWD}}/disagg-$SLURM_JOB_ID}}"
mkdir -p "$JOB_DIR/logs"
cd "$JOB_DIR"

fail() {{ echo "disagg job: error: $*" >&2; exit 1; }}

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
(( ${{#NODES[@]}} >= NODES_NEEDED )) \\
  || fail "needs $NODES_NEEDED nodes, the allocation has ${{#NODES[@]}}: ${{NODES[*]}}"
ROUTER_URL="http://${{NODES[0]}}:$ROUTER_PORT"

# The cluster token: fresh for this job, handed to the steps in their environment only.
if [[ -z "${{DISAGG_CLUSTER_TOKEN:-}}" ]]; then
  DISAGG_CLUSTER_TOKEN="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')"
fi
export DISAGG_CLUSTER_TOKEN

STEP_PIDS=()
STEP_NAMES=()
track() {{  # record the step just started in the background: NAME NODE
  STEP_PIDS+=("$!")
  STEP_NAMES+=("$1")
  echo "started $1 on $2 (log $JOB_DIR/logs/$1.log)"
}}
running() {{  # is this background job still running?
  local pid
  for pid in $(jobs -rp); do [[ $pid == "$1" ]] && return 0; done
  return 1
}}
report_exited() {{  # name the steps that are no longer running, with their log tails
  local i
  for i in "${{!STEP_PIDS[@]}}"; do
    if ! running "${{STEP_PIDS[$i]}}"; then
      echo "disagg job: step ${{STEP_NAMES[$i]}} exited; last lines of its log:" >&2
      tail -n 20 "logs/${{STEP_NAMES[$i]}}.log" >&2 || true
    fi
  done
}}
# shellcheck disable=SC2317  # teardown and on_signal run from the traps
teardown() {{  # SIGTERM every step (workers drain), kill what outlives the grace period, reap
  trap - EXIT INT TERM
  (( ${{#STEP_PIDS[@]}} )) || return 0
  echo "stopping the cluster (up to $STOP_GRACE_S s)"
  kill -TERM "${{STEP_PIDS[@]}}" 2>/dev/null || true
  sleep "$STOP_GRACE_S" &
  local timer=$! pid left
  while :; do
    left=0
    for pid in "${{STEP_PIDS[@]}}"; do if running "$pid"; then left=1; fi; done
    if (( left == 0 )) || ! running "$timer"; then break; fi
    wait -n || true
  done
  kill -KILL "${{STEP_PIDS[@]}}" "$timer" 2>/dev/null || true
  wait 2>/dev/null || true
  echo "cluster stopped"
}}
# shellcheck disable=SC2317
on_signal() {{ echo "stop signal: draining"; teardown; exit 0; }}
trap teardown EXIT
trap on_signal INT TERM"""

_RUN = """\
# Ready once every worker has registered and is healthy.
health() {{  # GET /health, never through a proxy of the environment (the nodes are local)
  python3 -c 'import sys, urllib.request as u
u.build_opener(u.ProxyHandler({{}})).open(sys.argv[1], timeout=5)' "$ROUTER_URL/health" 2>/dev/null
}}
deadline=$((SECONDS + STARTUP_TIMEOUT_S))
until health; do
  for pid in "${{STEP_PIDS[@]}}"; do
    running "$pid" || {{ report_exited; fail "a step exited during start-up"; }}
  done
  (( SECONDS < deadline )) || fail "the router was not healthy in $STARTUP_TIMEOUT_S s"
  sleep 2
done
echo "cluster ready: $ROUTER_URL (model {model}; POST /v1/completions, /v1/chat/completions)"

# Up until the job is stopped (the trap) or a step exits on its own.
wait -n || true
report_exited
fail "a step exited: stopping the cluster\""""
