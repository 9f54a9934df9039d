#!/usr/bin/env bash
# The one script run on the GPU machine (issue 25): installs the carried wheels, records the
# machine, runs the GPU tests, every bench/gpu/check_*.py (as python3 -m bench.gpu.check_NAME),
# then python3 -m bench.gpu.bench, each step under `timeout`, the whole run within TOTAL_S
# seconds (default 530: the device allows 600 a call). Writes at most 8 files under $OUT:
#   run.log         machine info + the output of every step + the summary
#   pytest.log      pytest -m gpu tests/test_gpu.py (-v -rA, full tracebacks)
#   bench.log       bench.fused_projections's and bench.gpu.bench's output
#   gpu.md          the report bench.py writes (copy it to bench/results/gpu.md)
#   profile.md      bench.gpu.profile_decode's report (profile.log: its output)
#   checks/NAME.txt each check script's --out file (at most 4)
#
#   OUT=/tmp/out bash bench/gpu/run_all.sh
#   STEPS=bench OUT=... bash bench/gpu/run_all.sh        # only some of: ipc,tests,profile,
#                                                        # checks,fused,bench
#   BENCH_ARGS="--sections llama8b" ...                  # extra bench.py arguments
#   CHECKS=check_kv,check_graph ...                      # only these check scripts
# Exit status: 0 when every step passed, else 1 (every step runs regardless).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
: "${OUT:?set OUT to the folder results go to}"
TOTAL_S=${TOTAL_S:-530}
STEPS=${STEPS:-ipc,tests,profile,checks,fused,bench}
BENCH_ARGS=${BENCH_ARGS:-}
PYTEST_ARGS=${PYTEST_ARGS:-}  # the GPU tests to run (pytest arguments; empty: tests/test_gpu.py)
CHECKS=${CHECKS:-}  # comma list of check names (check_attn,...) to run; empty: all
START=$SECONDS
mkdir -p "$OUT/checks"
LOG="$OUT/run.log"
: > "$LOG"
declare -a SUMMARY=()
status=0

log() { echo "$*" | tee -a "$LOG"; }
left() { echo $((TOTAL_S - (SECONDS - START))); }
want() { [[ ",$STEPS," == *",$1,"* ]]; }

# run NAME LIMIT_S CMD...: one step under timeout, output appended to run.log (or to $STEPLOG)
run() {
  local name=$1 limit=$2 rc t0=$SECONDS dest=${STEPLOG:-$LOG}
  shift 2
  if (( limit < 10 )); then
    SUMMARY+=("SKIP $name (no time left)"); log "=== $name: skipped, no time left"; return
  fi
  log "=== $name (limit ${limit}s, $(left)s of ${TOTAL_S}s left): $*"
  timeout -k 15 "$limit" "$@" >> "$dest" 2>&1
  rc=$?
  if [[ $dest != "$LOG" ]]; then tail -n 25 "$dest" >> "$LOG"; fi
  local verdict=ok
  if (( rc == 124 || rc == 137 )); then verdict="TIMEOUT"; elif (( rc != 0 )); then verdict="FAIL"; fi
  if [[ $verdict != ok ]]; then status=1; fi
  SUMMARY+=("$verdict $name (rc $rc, $((SECONDS - t0))s)")
  log "=== $name: $verdict rc=$rc in $((SECONDS - t0))s"
}

# ---- wheels (fastapi, uvicorn, pydantic, ucxx...; fetched by bench/gpu/fetch_wheels.sh)
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >> "$LOG" 2>&1 || log "wheel install FAILED (see above)"
  export PYTHONPATH=/tmp/site:$PWD
else
  log "no .whl/ wheels carried: fastapi/uvicorn/pydantic/ucxx only if already installed"
  export PYTHONPATH=$PWD
fi
export DISAGG_CACHE_DIR=${DISAGG_CACHE_DIR:-/tmp/disagg-kcache}
export PYTHONUNBUFFERED=1

# ---- machine
{
  echo "=== machine ($(date -u +%FT%TZ))"
  nvidia-smi || echo "nvidia-smi failed"
  nvidia-smi topo -m 2>/dev/null || true
  python3 - <<'EOF'
import importlib, platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version(), "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs")
for mod in ("triton", "transformers", "fastapi", "uvicorn", "pydantic", "aiohttp", "httpx",
            "ucxx", "numpy"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception as e:
        print(mod, "NOT importable:", type(e).__name__, str(e)[:200])
try:
    from disagg.transfer.ucx import ucx_available
    print("disagg ucx_available:", ucx_available())
    import ucxx
    print("UCX", ucxx.get_ucx_version())
except Exception as e:
    print("ucx:", type(e).__name__, str(e)[:300])
EOF
  ucx_info -v 2>/dev/null || true
  echo "disagg commit: ${DISAGG_COMMIT:-not given (set DISAGG_COMMIT, the git metadata of the device copy may be stale)}"
} >> "$LOG" 2>&1
tail -n +1 "$LOG"

# ---- GPU tests
if want tests; then
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
  STEPLOG="$OUT/pytest.log" run "pytest -m gpu" "$(( $(left) < ${PYTEST_S:-150} ? $(left) - 5 : ${PYTEST_S:-150} ))" \
    python3 -m pytest -m gpu -v -rA --tb=long -p no:cacheprovider ${PYTEST_ARGS:-tests/test_gpu.py}
  # CPU tests that pick CUDA where it is present (e.g. tests/test_async_scheduling.py), all of
  # their tests (no -m gpu): PYTEST_PLAIN names them, PYTEST_PLAIN_S caps them (default 60 s)
  if [[ -n ${PYTEST_PLAIN:-} ]]; then
    # shellcheck disable=SC2086  # PYTEST_PLAIN is a list of words
    STEPLOG="$OUT/pytest.log" run "pytest (plain)" \
      "$(( $(left) < ${PYTEST_PLAIN_S:-60} ? $(left) - 5 : ${PYTEST_PLAIN_S:-60} ))" \
      python3 -m pytest -v -rA --tb=long -p no:cacheprovider ${PYTEST_PLAIN}
  fi
fi

# ---- CUDA IPC between two processes (what the same-node KV path needs), < 30 s
if want ipc; then
  run "bench.gpu.probe_ipc" "$(( $(left) < 60 ? $(left) - 5 : 60 ))" python3 -m bench.gpu.probe_ipc
fi

# ---- where a decode step's time goes (8B shape, batch 1 and 64), ~60 s on an H100
if want profile; then
  STEPLOG="$OUT/profile.log" run "bench.gpu.profile_decode" "$(( $(left) < 150 ? $(left) - 5 : 150 ))" \
    python3 -m bench.gpu.profile_decode --out "$OUT/profile.md"
fi

# ---- device check scripts of the other parts (each: --out FILE, < 90 s)
if want checks; then
  n=0
  for script in bench/gpu/check_*.py; do
    [[ -e $script ]] || continue
    name=$(basename "$script" .py)
    if [[ -n $CHECKS && ",$CHECKS," != *",$name,"* ]]; then continue; fi
    n=$((n + 1))
    if (( n <= 4 )); then out="$OUT/checks/$name.txt"; else out="/tmp/$name.txt"; fi
    run "$name" "$(( $(left) < 100 ? $(left) - 5 : 100 ))" python3 -m "bench.gpu.$name" --out "$out"
    if (( n > 4 )); then log "(more than 4 checks: $name's --out kept in run.log only)"; cat "$out" >> "$LOG" 2>/dev/null; fi
  done
  if (( n == 0 )); then log "no bench/gpu/check_*.py scripts present"; fi
fi

# ---- fused projections against the separate layers (eager decode steps, one engine a batch)
if want fused; then
  STEPLOG="$OUT/bench.log" run "bench.fused_projections" "$(( $(left) < 90 ? $(left) - 5 : 90 ))" \
    python3 -m bench.fused_projections --device cuda --batches 1,8,64 --steps 60
fi

# ---- the benchmark: budget = what is left, less a margin for its own shutdown
if want bench; then
  budget=$(( $(left) - 40 ))
  (( budget > 360 )) && budget=360
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
  STEPLOG="$OUT/bench.log" run "bench.gpu.bench" "$(( budget + 30 ))" \
    python3 -m bench.gpu.bench --out "$OUT/gpu.md" --budget-s "$budget" $BENCH_ARGS
fi

log ""
log "=== summary ($((SECONDS - START))s)"
for line in "${SUMMARY[@]}"; do log "$line"; done
exit "$status"
