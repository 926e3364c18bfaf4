#!/usr/bin/env bash
# The GPU check, prepared once and run whenever a GPU is lent (stages, order, budgets: bench/gpu_check.py's docstring).
#
#   bash bench/gpu_check.sh --fetch                  # here, on the CPU machine: DeepSpeed + its pinned deps as
#                                                    #   x86_64 wheels in .whl/ (the lent H100/H200 is x86_64)
#   bash bench/gpu_check.sh --fetch --arch aarch64   # the same for a GH200 (aarch64); --print: the commands only
#   bash bench/gpu_check.sh                          # on the GPU machine (repository root): every stage, at most
#                                                    #   7 minutes, JSON to $OUT after every setting; the decode
#                                                    #   settings that fit (it prints the ones it leaves out)
#   bash bench/gpu_check.sh --all-settings --deadline-s 3600   # the opt-in decode settings too
#   bash bench/gpu_check.sh --stages nfe --nfe-settings NAME,...  # named settings only (the rows that diverge:
#                                                    #   llada-8b/b3/dual/reduce-overhead/4L/diverge/tdlm, ~4 min)
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
    # the venv whose versions are pinned: $PYTHON if set, else the project venv, else python3 (DeepSpeed's setup.py
    # imports torch, and the pins are read from what that interpreter has installed)
    PYV=${PYTHON:-}
    [[ -z $PYV && -x .venv/bin/python ]] && PYV=.venv/bin/python
    PYV=${PYV:-python3}
    IMAGE_TORCH=2.11.0  # the GPU image's torch (shared notes): the offline check resolves DeepSpeed against it
    if ((!PRINT)); then
        grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
        mkdir -p .whl
    fi
    # DeepSpeed and its requirement closure, each pinned to the version this venv runs, torch's subtree left to the
    # image (bench/gpu_check_wheels.py): typing-extensions, pydantic-core, annotated-types... all come along.
    mapfile -t PINS < <("$PYV" bench/gpu_check_wheels.py pins deepspeed)
    [[ ${PINS[0]:-} == deepspeed==* ]] || { echo "error: cannot read DeepSpeed's requirements from $PYV" >&2; exit 2; }
    # DeepSpeed is a source package: built here into one py3-none-any wheel that serves both architectures.
    run "$PYV" -m pip wheel -q --no-deps --no-build-isolation -w .whl "${PINS[0]}"
    # The rest as Python 3.12 wheels of the target's platform (pydantic-core, msgpack, psutil... are compiled).
    PLATFORM_ARGS=(--only-binary=:all: --python-version 3.12 --implementation cp)
    for p in "${PLATFORMS[@]}"; do PLATFORM_ARGS+=(--platform "$p"); done
    run "$PYV" -m pip download -q --no-deps "${PLATFORM_ARGS[@]}" -d .whl "${PINS[@]:1}"
    ((PRINT)) || printf '%s\n' "${PINS[@]}" > .whl/requirements.txt
    # Offline check: into an empty Python 3.12 that has only the image's torch (a metadata-only stub wheel), the
    # pins install from .whl alone, every dependency included. A missing wheel fails here, not on the GPU machine.
    STUB=$( ((PRINT)) && echo /tmp/gpu-check-stub || mktemp -d)
    ((PRINT)) || "$PYV" bench/gpu_check_wheels.py stub-torch "$STUB" "$IMAGE_TORCH" >/dev/null
    run "$PYV" -m pip install -q --dry-run --ignore-installed --no-index --find-links .whl --find-links "$STUB" \
        "${PLATFORM_ARGS[@]}" --target "$STUB/site" --report "$STUB/report.json" "torch==$IMAGE_TORCH" "${PINS[@]}"
    if ((!PRINT)); then
        "$PYV" -c 'import json, sys; r = [i["metadata"] for i in json.load(open(sys.argv[1]))["install"]]
print("offline check: pip install --dry-run --no-index resolves", len(r), "packages from .whl:",
      " ".join(m["name"] + "==" + m["version"] for m in r))' "$STUB/report.json"
        rm -rf "$STUB"
    fi
    ((PRINT)) || ls -la .whl
    exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DRY=0
for a in "$@"; do [[ "$a" == "--dry-run" ]] && DRY=1; done
if ((!DRY)) && compgen -G ".whl/*.whl" >/dev/null; then
    # Wheels fetched for both architectures may share .whl/: take this machine's and the pure-Python ones. Of those,
    # only what this image lacks or holds at a version DeepSpeed refuses (pip's own resolver, offline, against the
    # installed packages); a pip that cannot say (too old for --dry-run / --report) installs them all.
    mapfile -t WHEELS < <(compgen -G ".whl/*.whl" | grep -E -- "(-any|_$(uname -m))\.whl$")
    DS_REQ=$(head -n 1 .whl/requirements.txt 2>/dev/null || echo deepspeed)
    if python3 -m pip install -q --dry-run --no-index --find-links .whl --break-system-packages \
        --report /tmp/gpu-check-wheels.json "$DS_REQ" 2>/tmp/gpu-check-wheels.err; then
        mapfile -t WHEELS < <(python3 -c 'import json, sys
for i in json.load(open(sys.argv[1]))["install"]: print(i["download_info"]["url"].removeprefix("file://"))' \
            /tmp/gpu-check-wheels.json)
    fi
    echo "[gpu_check.sh] carried wheels to install: ${#WHEELS[@]} (${WHEELS[*]##*/})"
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
