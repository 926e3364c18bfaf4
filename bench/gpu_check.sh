#!/usr/bin/env bash
# The GPU check, prepared once and run whenever a GPU is lent (stages: bench/gpu_check.py's docstring).
#
#   bash bench/gpu_check.sh --fetch     # here, on the CPU machine: DeepSpeed + its missing deps as wheels in .whl/
#   bash bench/gpu_check.sh             # on the GPU machine (repository root): every stage, JSON to $OUT
#   bash bench/gpu_check.sh --dry-run   # any CPU: every stage at toy size (the test suite runs this)
#
# The GPU machine has torch but no project venv, no DeepSpeed or Ray and no network: the code runs from
# the working tree with PYTHONPATH=$PWD, and DeepSpeed comes from wheels carried in .whl/ (ignored by git;
# name it in the device tool's `carry`). Without them the deepspeed stage records "skipped".
# Budget: under 8 minutes on one H100/H200 (each stage writes its JSON as soon as it ends). At the end it prints
# every measured number beside its prediction from bench/results/true_shape.json (bench/true_shape.py, no GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--fetch" ]]; then
    # py3-none-any DeepSpeed built here (it is a source package) + what the GPU image lacks (KINDS.md).
    set -e
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    PYV=$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)  # DeepSpeed's setup.py imports torch
    "$PYV" -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$("$PYV" -c "import importlib.metadata as m; print(m.version('deepspeed'))" 2>/dev/null || echo 0.19.8)"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        hjson pydantic pydantic-core annotated-types typing-inspection
    ls -la .whl
    exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${1:-}" != "--dry-run" ]] && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site \
        .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/gpu-check-site"
fi
# $PYTHON if set; a dry run here prefers the project venv; the GPU machine's python3 holds torch.
PY="${PYTHON:-}"
[[ -z "$PY" && -x .venv/bin/python && "${1:-}" == "--dry-run" ]] && PY=.venv/bin/python
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1
exec "$PY" bench/gpu_check.py "$@"
