#!/usr/bin/env bash
# The GPU check, prepared once and run whenever a GPU is lent (stages, order, budgets: bench/gpu_check.py's docstring).
#
#   bash bench/gpu_check.sh --fetch                  # here, on the CPU machine: DeepSpeed + its missing deps as
#                                                    #   x86_64 wheels in .whl/ (the lent H100/H200 is x86_64)
#   bash bench/gpu_check.sh --fetch --arch aarch64   # the same for a GH200 (aarch64); --print: the commands only
#   bash bench/gpu_check.sh                          # on the GPU machine (repository root): every stage, at most
#                                                    #   7 minutes, JSON to $OUT after every setting
#   bash bench/gpu_check.sh --quick                  # the subset, at most 4 minutes
#   bash bench/gpu_check.sh --dry-run                # any CPU: every stage at toy size (the test suite runs this)
#
# The GPU machine has torch but no project venv, no DeepSpeed or Ray and no network: the code runs from
# the working tree with PYTHONPATH=$PWD, and DeepSpeed comes from wheels carried in .whl/ (ignored by git;
# name it in the device tool's `carry`). Only the wheels of this machine's architecture are installed; without
# them the deepspeed stage records "skipped". The deadline (--deadline-s, default 420 s, --quick 240 s) counts
# from this script's start, the wheel install included; each stage runs in a child process that is killed at its
# deadline, and every finished setting is already in its JSON. With $OUT set, the whole output is also in
# $OUT/gpu_check.log. At the end every measured number is printed beside its prediction for this GPU from
# bench/results/true_shape.json (the time rows of an H200, GH200 or H100 SXM on that GPU, none on any other; the
# memory, planner and kernel-count rows on every GPU).
set -uo pipefail
export GPU_CHECK_T0="$(date +%s.%N)"  # the deadline counts from here (gpu_check.py --deadline-s)
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--fetch" ]]; then
    shift
    ARCH=x86_64 PRINT=0
    while (($#)); do
        case "$1" in
            --arch) ARCH="${2:-}"; shift 2 || shift ;;
            --arch=*) ARCH="${1#--arch=}"; shift ;;
            x86_64 | aarch64 | arm64) ARCH="$1"; shift ;;
            --print) PRINT=1; shift ;;
            *) echo "error: --fetch takes [--arch x86_64|aarch64] [--print]; got '$1'" >&2; exit 2 ;;
        esac
    done
    # pip matches manylinux tags exactly: name every glibc level the wheels are published under.
    case "$ARCH" in
        x86_64) PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
                           manylinux1_x86_64) ;;
        aarch64 | arm64) ARCH=aarch64
                         PLATFORMS=(manylinux_2_28_aarch64 manylinux_2_27_aarch64 manylinux_2_17_aarch64
                                    manylinux2014_aarch64) ;;
        *) echo "error: --arch must be x86_64 or aarch64; got '$ARCH'" >&2; exit 2 ;;
    esac
    run() { if ((PRINT)); then printf '%q ' "$@"; echo; else "$@"; fi; }
    set -e
    PYV=$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)  # DeepSpeed's setup.py imports torch
    DS_VERSION=$("$PYV" -c "import importlib.metadata as m; print(m.version('deepspeed'))" 2>/dev/null || echo 0.19.8)
    if ((!PRINT)); then
        grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
        mkdir -p .whl
    fi
    # DeepSpeed is a source package: built here into one py3-none-any wheel that serves both architectures.
    run "$PYV" -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$DS_VERSION"
    # What the GPU image lacks (KINDS.md); pydantic-core is compiled, so its wheel is per architecture.
    PLATFORM_ARGS=()
    for p in "${PLATFORMS[@]}"; do PLATFORM_ARGS+=(--platform "$p"); done
    run python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORM_ARGS[@]}" -d .whl hjson pydantic pydantic-core annotated-types typing-inspection
    ((PRINT)) || ls -la .whl
    exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DRY=0
for a in "$@"; do [[ "$a" == "--dry-run" ]] && DRY=1; done
if ((!DRY)) && compgen -G ".whl/*.whl" >/dev/null; then
    # Wheels fetched for both architectures may share .whl/: take this machine's and the pure-Python ones.
    mapfile -t WHEELS < <(compgen -G ".whl/*.whl" | grep -E -- "(-any|_$(uname -m))\.whl$")
    if ((${#WHEELS[@]})); then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/gpu-check-site "${WHEELS[@]}" && export PYTHONPATH="$PYTHONPATH:/tmp/gpu-check-site"
    fi
fi
# $PYTHON if set; a dry run here prefers the project venv; the GPU machine's python3 holds torch.
PY="${PYTHON:-}"
[[ -z "$PY" && -x .venv/bin/python && $DRY == 1 ]] && PY=.venv/bin/python
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1
if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    "$PY" bench/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check$( ((DRY)) && echo _dryrun).log"
    exit "${PIPESTATUS[0]}"
fi
exec "$PY" bench/gpu_check.py "$@"
