#!/usr/bin/env bash
# Install torch into a venv before anything that depends on it (the Makefile's $(STAMP) rule calls this):
#
#   scripts/torch_install.sh [--print] PYTHON
#
# PYTHON is the venv's python (pip runs as `PYTHON -m pip install -q ...`); --print prints what it would run and
# installs nothing. The pin is torch==2.13.0, the release the suite runs; which build of it comes from where:
#
#   * TORCH_INDEX_URL set: torch==2.13.0 from that index (TORCH_SPEC, e.g. torch==2.13.0+cu126, replaces the pin);
#   * no working `nvidia-smi`: torch==2.13.0 from pip's configured index (the CPU path: where pip is configured with
#     a local wheel folder, as on the project's CPU machines, the CPU wheel comes from there);
#   * a working `nvidia-smi`: torch==2.13.0+cuXYZ from https://download.pytorch.org/whl/cuXYZ, the newest CUDA
#     build in VARIANTS below whose minimum driver the one nvidia-smi reports meets; none: it stops, naming the
#     driver and TORCH_INDEX_URL. (The +cuXYZ local version makes pip replace a 2.13.0+cpu already in the venv,
#     which plain torch==2.13.0 would leave in place.)
#   * that CUDA index cannot be reached (a machine that reaches only PyPI) and the driver is >= 580: PyPI's plain
#     torch==2.13.0 from PYPI_INDEX_URL (default https://pypi.org/simple), which since torch 2.11 is the CUDA 13.0
#     build on Linux and runs on the same driver; below 580 it stops in one line (PyPI has no CUDA 12 build).
#     Reached means: "$PYTHON" fetches $CUDA_INDEX_BASE/cuXYZ/torch/ within PROBE_TIMEOUT_S seconds (default 20).
#
# It prints one line saying what it chose and why. After installing on a node with a working nvidia-smi it checks
# torch.cuda.is_available() and fails with one line if it is False (skipped when TORCH_INDEX_URL ends in /cpu:
# a CPU build was asked for).
set -euo pipefail

# torch 2.13's CUDA builds, newest first, as CUDA-tag:minimum-Linux-driver. torch 2.13 ships CUDA 12.6 and 13.0
# (stable) and 13.2 (experimental) for Linux x86_64 and aarch64 (pytorch/pytorch RELEASE.md, Release
# Compatibility Matrix and CUDA Support Matrix, PR #187075; pytorch.org quick-start for 2.13.0: 12.6 / 13.0 / 13.2).
# The wheels bundle their CUDA runtime, so the driver floor is the major version's under NVIDIA's minor-version
# compatibility: CUDA 13.x >= 580, CUDA 12.x >= 525.60.13 (CUDA Toolkit release notes; docs.nvidia.com/deploy/
# cuda-compatibility/minor-version-compatibility.html). 13.2 is left out on purpose: it is the release's
# experimental build, and its driver floor is 13.0's, so it serves no driver that 13.0 does not; ask for it with
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cu132. Not verified here (no network when this was written):
# that the download.pytorch.org indexes list torch 2.13.0 for every (arch, tag) pair below, and that NVIDIA's
# floors, published for Linux x86_64, hold for aarch64 (sbsa) drivers too.
VARIANTS="cu130:580 cu126:525.60.13"
ARCHES="x86_64 aarch64"
PIN=torch==2.13.0
INDEX_BASE=${CUDA_INDEX_BASE:-https://download.pytorch.org/whl}  # the tests point it at a fake index
PYPI_FLOOR=580  # PyPI's plain Linux torch (2.11 on) is the CUDA 13.0 build: CUDA 13's driver floor
PYPI=${PYPI_INDEX_URL:-https://pypi.org/simple}

say() { echo "torch_install: $*"; }
die() { echo "torch_install: $*" >&2; exit 2; }

# version_ge A B: A >= B, comparing dot-separated numeric fields (560.35.03 >= 525.60.13).
version_ge() {
    local -a a b
    local i x y
    IFS=. read -r -a a <<<"$1"
    IFS=. read -r -a b <<<"$2"
    for ((i = 0; i < ${#a[@]} || i < ${#b[@]}; i++)); do
        x=$((10#${a[i]:-0})) y=$((10#${b[i]:-0}))
        ((x > y)) && return 0
        ((x < y)) && return 1
    done
    return 0
}

# reachable URL: the index answers within PROBE_TIMEOUT_S (the venv's python, else python3, fetches it)
reachable() {
    local probe=$py
    [[ -x $probe ]] || probe=python3
    "$probe" -c 'import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])).read(1)' "$1" "${PROBE_TIMEOUT_S:-20}" \
        >/dev/null 2>&1
}

print_only=0
if [[ ${1:-} == --print ]]; then print_only=1; shift; fi
py=${1:-python3}

arch=$(uname -m)
driver=""
gpu=0
if command -v nvidia-smi >/dev/null 2>&1; then
    if out=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null); then
        gpu=1
        driver=$(printf '%s\n' "$out" | head -n 1 | tr -d '[:space:]')
        smi="nvidia-smi works"
    else
        smi="nvidia-smi fails (exit $?)"
    fi
else
    smi="no nvidia-smi"
fi

index=""
spec=${TORCH_SPEC:-$PIN}
if [[ -n ${TORCH_INDEX_URL:-} ]]; then
    index=$TORCH_INDEX_URL
    why="TORCH_INDEX_URL is set ($arch, $smi${driver:+, driver $driver})"
elif ((gpu == 0)); then
    why="$smi, so no CUDA build ($arch)"
else
    [[ $driver =~ ^[0-9]+(\.[0-9]+)*$ ]] ||
        die "nvidia-smi reports driver version '$driver', not a version; choose the index with TORCH_INDEX_URL=$INDEX_BASE/cuXYZ"
    [[ " $ARCHES " == *" $arch "* ]] ||
        die "torch 2.13 has no CUDA wheels for $arch (driver $driver); choose an index with TORCH_INDEX_URL"
    for v in $VARIANTS; do
        tag=${v%%:*} floor=${v#*:}
        if version_ge "$driver" "$floor"; then
            index=$INDEX_BASE/$tag
            [[ -n ${TORCH_SPEC:-} ]] || spec=$PIN+$tag
            why="$arch, driver $driver >= $floor: CUDA build $tag"
            break
        fi
    done
    oldest=${VARIANTS##* }
    [[ -n $index ]] ||
        die "NVIDIA driver $driver is too old for every CUDA build of torch 2.13 (the oldest, ${oldest%%:*}, needs >= ${oldest#*:}); upgrade the driver or choose an index with TORCH_INDEX_URL=$INDEX_BASE/cuXYZ"
    if ! reachable "$index/torch/"; then
        version_ge "$driver" "$PYPI_FLOOR" ||
            die "$index cannot be reached and PyPI's torch (the CUDA 13.0 build) needs driver >= $PYPI_FLOOR, not $driver; choose a reachable index with TORCH_INDEX_URL=$INDEX_BASE/cuXYZ"
        index=$PYPI spec=${TORCH_SPEC:-$PIN}
        why="$arch, driver $driver >= $PYPI_FLOOR; $INDEX_BASE/${tag} cannot be reached: PyPI's plain $PIN (the CUDA 13.0 build)"
    fi
fi

cmd=("$py" -m pip install -q "$spec")
[[ -z $index ]] || cmd+=(--index-url "$index")
default="pip's configured index"
say "$spec from ${index:-$default}; $why"
if ((print_only)); then
    line=$(printf '%q ' "${cmd[@]}")
    echo "${line% }"
    exit 0
fi
"${cmd[@]}"

((gpu)) || exit 0
[[ $index != */cpu && $index != */cpu/ ]] || exit 0
if ! info=$("$py" -c 'import sys, torch
print(f"{torch.__version__} (torch.version.cuda {torch.version.cuda})")
sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null); then
    die "torch ${info:-(import failed)} was installed without working CUDA (torch.cuda.is_available() is False; driver $driver, $arch); choose another index with TORCH_INDEX_URL=$INDEX_BASE/cuXYZ"
fi
say "torch $info sees CUDA"
