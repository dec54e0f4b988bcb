#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a GPU machine that reaches no registry, put in .gpu/ (ignored by git, named in
# the device call's `carry`): the embedded model's tokenizer, exported as a Hugging Face directory, and the wheels
# (CPython 3.12, x86-64 Linux) of the packages kvreuse imports that the machine's image lacks. Run it here, from the
# repository root, after `make install`. The versions are the ones installed in .venv, so the device runs what the
# tests here ran. torch and transformers are the device's own; fastapi, uvicorn, ray, redis and hiredis are not
# imported by the check.
set -euo pipefail

VENV="${VENV:-.venv}"
CARRY="${GPU_CARRY:-.gpu}"
MAX_MIB=48   # of the 64 MiB a device call carries, the rest is the repository
# Imported by the engine, the benches or the config, and missing from the device image (the device tool's KINDS.md).
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions gguf pyzmq msgspec)

rm -rf "$CARRY"
mkdir -p "$CARRY/wheels"
"$VENV/bin/kvreuse" tokenizer export "$CARRY/tokenizer" --max-model-len 8192

pins=()
for package in "${PACKAGES[@]}"; do
  pins+=("$package==$("$VENV/bin/python" -c "from importlib.metadata import version; print(version('$package'))")")
done
"$VENV/bin/pip" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$CARRY/wheels" "${pins[@]}"

total=$(du -sm "$CARRY" | cut -f1)
ls -1 "$CARRY/wheels"
echo "$CARRY: ${total} MiB (tokenizer and ${#pins[@]} wheels: ${pins[*]})"
if [ "$total" -gt "$MAX_MIB" ]; then
  echo "$CARRY is over ${MAX_MIB} MiB: the device call carries 64 MiB with the repository" >&2
  exit 1
fi
