#!/usr/bin/env bash
# The engine checked on a GPU machine, in one call (docs/features/gpu.md): install kvreuse without its dependencies
# and the wheels scripts/gpu_carry.sh put in .gpu/, then run `python -m kvreuse.bench.gpu_check --device cuda`.
# Run from the repository root. The report goes to $OUT (gpu_check.json, gpu_check.md, and this script's log,
# gpu_check.log); arguments are passed on to gpu_check (`--quick`, `--budget-s 200`, `--device cpu`, ...).
# Exit code: gpu_check's (1 if a step failed), 3 if the carried wheels would not install.
set -uo pipefail

OUT="${OUT:-out/gpu-check}"
CARRY="${GPU_CARRY:-.gpu}"
PY="${PYTHON:-python3}"
SITE="${GPU_SITE:-/tmp/kvreuse-site}"   # the carried packages, ahead of the image's own on PYTHONPATH
WORK="${GPU_WORK:-/tmp/kvreuse-gpu-check}"
mkdir -p "$OUT"

check() {
  echo "== $(date -u +%FT%TZ) $(uname -m), $("$PY" -V 2>&1) at $(command -v "$PY")"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  if compgen -G "$CARRY/wheels/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$CARRY"/wheels/*.whl || return 3
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if ! "$PY" -c "from importlib.metadata import version; version('kvreuse')" 2>/dev/null; then
    # Installed for its metadata and entry point; `python -m kvreuse...` from here imports the working tree.
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$SITE" . \
      || echo "kvreuse did not install; running it from the working tree"
  fi
  local tokenizer=()
  [ -f "$CARRY/tokenizer/tokenizer.json" ] && tokenizer=(--tokenizer "$CARRY/tokenizer")
  PYTHONUNBUFFERED=1 "$PY" -m kvreuse.bench.gpu_check --device cuda --out "$OUT" --work "$WORK" \
    "${tokenizer[@]}" "$@"
}

check "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
