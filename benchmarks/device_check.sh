#!/usr/bin/env bash
# The prepared device check for a lent TPU VM or GPU machine: under 8 minutes, from a checkout.
#
#   bash benchmarks/device_check.sh          # summary: $OUT/device_check.json (else runs/device_check/)
#
# 1. Finds the accelerator (nvidia-smi: GPU; /dev/accel* or /dev/vfio: TPU; else CPU, smoke mode).
# 2. Installs what is missing: the matching jax (`pip install -e .[tpu]` / `.[gpu]`) when jax does
#    not see the accelerator, then any of hotswap's own dependencies that do not import. An offline
#    machine installs them from wheels in $HOTSWAP_WHEELS (default .whl/) when that folder exists.
#    A jax that already sees the accelerator is kept as it is (hotswap runs from the checkout).
# 3. Runs benchmarks/device_check.py (its docstring lists the parts) within what is left of the
#    budget, and writes its JSON summary; a failed install writes a summary that says so.
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET_S=${DEVICE_CHECK_BUDGET_S:-470}
START=$(date +%s)
OUTDIR=${OUT:-runs/device_check}
mkdir -p "$OUTDIR"
SUMMARY="$OUTDIR/device_check.json"
LOG="$OUTDIR/device_check.log"
PY=${PYTHON:-python3}
WHEELS=${HOTSWAP_WHEELS:-.whl}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
left() { echo $((BUDGET_S - ($(date +%s) - START))); }
log() { echo "device_check.sh: $*" | tee -a "$LOG"; }
fail() {
  log "FAILED: $1"
  printf '{"ok": false, "stage": "%s", "error": "%s"}\n' "$2" "$1" >"$SUMMARY"
  cat "$SUMMARY"
  exit 1
}
pip_install() {  # pip_install ARGS...: from the wheel folder when there is one, else the index
  local t=$(($(left) - 300))  # keep >= 5 minutes for the check itself
  ((t > 20)) || return 1
  if [ -d "$WHEELS" ]; then
    timeout "$t" "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$@" 2>&1 | tail -5 | tee -a "$LOG"
  else
    timeout "$t" "$PY" -m pip install -q "$@" 2>&1 | tail -5 | tee -a "$LOG"
  fi
}
: >"$LOG"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  platform=gpu jax_platform=cuda
  nvidia-smi -L | tee -a "$LOG"
elif compgen -G "/dev/accel*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null; then
  platform=tpu jax_platform=tpu
else
  platform=cpu jax_platform=cpu
fi
log "platform: $platform"

sees() { JAX_PLATFORMS=$jax_platform timeout 120 "$PY" -c "import jax; assert jax.default_backend() == '$platform', jax.default_backend(); print(jax.__version__, jax.devices())" 2>&1 | tail -1 | tee -a "$LOG"; }
if ! sees; then
  [ "$platform" = cpu ] && fail "no jax on this machine" install
  log "jax does not see the $platform: pip install -e .[$platform]"
  pip_install -e ".[$platform]"
  sees || fail "jax does not see the $platform after pip install -e .[$platform]" install
fi

# hotswap's own dependencies, by module (pip name): what the check and the kernel tests import.
missing=$("$PY" - <<'EOF'
import importlib.util as u
need = {"gguf": "gguf", "orbax": "orbax-checkpoint", "tokenizers": "tokenizers", "safetensors": "safetensors",
        "jinja2": "jinja2", "tqdm": "tqdm", "ml_dtypes": "ml_dtypes", "optax": "optax",
        "huggingface_hub": "huggingface_hub", "pytest": "pytest", "hypothesis": "hypothesis"}
print(" ".join(pip for mod, pip in need.items() if u.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
  log "installing missing modules: $missing"
  pip_install $missing || log "could not install: $missing (the parts that need them will fail)"
fi

t=$(($(left) - 10))
((t > 60)) || fail "under a minute left after the install" install
log "running benchmarks/device_check.py (budget ${t}s)"
JAX_PLATFORMS=$jax_platform timeout "$t" "$PY" benchmarks/device_check.py --json "$SUMMARY" \
  --budget-s $((t - 20)) $([ "$platform" = cpu ] && echo --smoke) 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
[ -s "$SUMMARY" ] || fail "device_check.py wrote no summary (rc $rc)" run
log "rc $rc, $(($(date +%s) - START))s; summary $SUMMARY"
cat "$SUMMARY"
exit "$rc"
