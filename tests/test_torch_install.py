"""scripts/torch_install.sh, the torch step of ``make venv`` (issue: first contact with GPUs): on a GPU node the old
rule ran an unpinned ``pip install torch``, which could bring a CPU build (aarch64) or a CUDA build the driver cannot
run (x86_64), so ``torch.cuda.is_available()`` was False and training ran on the CPU without a word.

Each test runs the script with a PATH that holds only fakes and the two tools it needs (``head``, ``tr``): a fake
``uname`` (the architecture), a fake ``nvidia-smi`` (the driver, or a failure) or none, and a fake venv python
whose ``-m pip`` only logs its arguments and whose ``-c`` runs the real interpreter against a stub ``torch``
package. Nothing is installed; ``--print`` prints the one line saying what was chosen and the pip command.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "torch_install.sh"
BASH = shutil.which("bash")


@pytest.fixture(scope="module")
def fake_index(tmp_path_factory):
    """A CUDA index that answers: an HTTP server on a loopback port serving whl/cu130/torch/ and whl/cu126/torch/
    (CUDA_INDEX_BASE points the script at it; the real base is download.pytorch.org, which this machine cannot
    reach). Yields its base URL."""
    import functools
    import http.server
    import threading

    root = tmp_path_factory.mktemp("index")
    for tag in ("cu130", "cu126"):
        (root / "whl" / tag / "torch").mkdir(parents=True)
        (root / "whl" / tag / "torch" / "index.html").write_text(f"<a>torch-2.13.0+{tag}</a>\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl"
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def _index_env(fake_index, monkeypatch):
    """Every test's CUDA index is the fake one unless it names another (``CUDA_INDEX`` follows)."""
    monkeypatch.setattr(sys.modules[__name__], "CUDA_INDEX", f"{fake_index}/cu")
    yield


CUDA_INDEX = ""  # set per test by _index_env: the fake index's base + "/cu"
UNREACHABLE = "http://127.0.0.1:9/whl"  # the discard port: nothing listens, the connection is refused at once


def _exe(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def _bin(tmp_path: Path, arch: str, smi: str | None) -> Path:
    """A PATH directory: fake uname (and nvidia-smi when ``smi`` is its body), real head and tr, and python3 (the
    index probe's interpreter when the venv python given is not a file)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in ("head", "tr"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "python3").symlink_to(sys.executable)
    _exe(bin_dir / "uname", f'[ "$1" = -m ] && echo {arch} || echo Linux\n')
    if smi is not None:
        _exe(bin_dir / "nvidia-smi", smi)
    return bin_dir


def _driver(version: str, gpus: int = 1) -> str:
    """The body of an nvidia-smi that answers --query-gpu=driver_version like the real one (a line per GPU)."""
    return '[ "$1" = --query-gpu=driver_version ] || exit 64\n' + f"echo {version}\n" * gpus


def run(tmp_path: Path, *, arch: str = "x86_64", smi: str | None = None, env: dict | None = None,
        python: str = "/venv/bin/python", dry: bool = True) -> subprocess.CompletedProcess:
    bin_dir = _bin(tmp_path, arch, smi)
    args = [BASH, str(SCRIPT)] + (["--print"] if dry else []) + [python]
    base = {"PATH": str(bin_dir), "CUDA_INDEX_BASE": CUDA_INDEX.removesuffix("/cu"), "PROBE_TIMEOUT_S": "5"}
    return subprocess.run(args, env=base | (env or {}), capture_output=True, text=True, timeout=30)


def chosen(res: subprocess.CompletedProcess) -> tuple[str, list[str]]:
    """(the line saying what was chosen, the pip command) of a --print run."""
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("torch_install: "), res.stdout
    return lines[0], shlex.split(lines[1])


def index_of(cmd: list[str]) -> str | None:
    return cmd[cmd.index("--index-url") + 1] if "--index-url" in cmd else None


def one_error_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode != 0, res.stdout
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert "TORCH_INDEX_URL" in lines[0], lines[0]
    return lines[0]


def test_no_nvidia_smi_installs_the_pin_from_the_default_index(tmp_path):
    """Today's CPU path, unchanged: pip's configured index (on the CPU machines, a local wheel folder)."""
    line, cmd = chosen(run(tmp_path))
    assert cmd == ["/venv/bin/python", "-m", "pip", "install", "-q", "torch==2.13.0"]
    assert "no nvidia-smi" in line and "x86_64" in line


def test_failing_nvidia_smi_is_the_cpu_path(tmp_path):
    """An nvidia-smi that exits non-zero (no driver loaded, no device) is no GPU."""
    line, cmd = chosen(run(tmp_path, smi="echo 'NVIDIA-SMI has failed' >&2\nexit 9\n"))
    assert cmd == ["/venv/bin/python", "-m", "pip", "install", "-q", "torch==2.13.0"]
    assert "exit 9" in line


@pytest.mark.parametrize("driver, tag", [
    ("580.95.05", "cu130"),   # a CUDA 13 driver: the newest stable CUDA build
    ("580.65.06", "cu130"),   # CUDA 13.0 GA's driver
    ("575.57.08", "cu126"),   # CUDA 12.9's driver: below CUDA 13's floor (580)
    ("535.104.05", "cu126"),  # a CUDA 12.2 driver: CUDA 12.6 under minor-version compatibility
    ("525.60.13", "cu126"),   # exactly CUDA 12's floor
    # fields wider than the floor's: 105 > 60 and 147 > 60 as numbers, though "1" < "6" as text
    ("525.105.17", "cu126"),
    ("525.147.05", "cu126"),
])
def test_x86_64_gets_the_newest_cuda_build_its_driver_runs(tmp_path, driver, tag):
    line, cmd = chosen(run(tmp_path, smi=_driver(driver)))
    assert index_of(cmd) == f"{CUDA_INDEX}{tag[2:]}"
    assert cmd[:6] == ["/venv/bin/python", "-m", "pip", "install", "-q", f"torch==2.13.0+{tag}"]
    assert f"driver {driver}" in line and tag in line and "x86_64" in line


def test_several_gpus_read_one_driver(tmp_path):
    _, cmd = chosen(run(tmp_path, smi=_driver("580.95.05", gpus=4)))
    assert index_of(cmd) == f"{CUDA_INDEX}130"


@pytest.mark.parametrize("driver, tag", [("580.95.05", "cu130"), ("550.54.15", "cu126")])
def test_aarch64_gets_a_cuda_build_never_the_default_index(tmp_path, driver, tag):
    """GH200 nodes: the default index has served CPU-only aarch64 wheels, so a GPU node must name a CUDA index."""
    line, cmd = chosen(run(tmp_path, arch="aarch64", smi=_driver(driver)))
    assert index_of(cmd) == f"{CUDA_INDEX}{tag[2:]}"
    assert f"torch==2.13.0+{tag}" in cmd and "aarch64" in line


@pytest.mark.parametrize("driver", [
    "525.60.12",
    "470.256.02",
    "525.9.99",   # 9 < 60 as numbers, though "9" > "6" as text
    "525.60.09",  # a zero-padded field is decimal nine, not an invalid octal number for bash's arithmetic
])
def test_a_driver_too_old_for_every_cuda_build_fails_in_one_line(tmp_path, driver):
    line = one_error_line(run(tmp_path, smi=_driver(driver)))
    assert driver in line
    assert "525.60.13" in line  # what the oldest build needs


def test_an_architecture_without_cuda_wheels_fails_in_one_line(tmp_path):
    line = one_error_line(run(tmp_path, arch="ppc64le", smi=_driver("580.95.05")))
    assert "ppc64le" in line


@pytest.mark.parametrize("smi", [None, _driver("580.95.05"), _driver("470.256.02")],
                         ids=["no-gpu", "new-driver", "too-old-driver"])
def test_torch_index_url_wins(tmp_path, smi):
    """TORCH_INDEX_URL overrides the index, whatever the driver (even one too old for the chosen builds);
    the pin stays."""
    url = "https://download.pytorch.org/whl/cu126"
    line, cmd = chosen(run(tmp_path, smi=smi, env={"TORCH_INDEX_URL": url}))
    assert index_of(cmd) == url
    assert "torch==2.13.0" in cmd
    assert "TORCH_INDEX_URL" in line


def test_torch_spec_replaces_the_pin(tmp_path):
    _, cmd = chosen(run(tmp_path, smi=_driver("580.95.05"), env={"TORCH_SPEC": "torch==2.13.0+cu126"}))
    assert "torch==2.13.0+cu126" in cmd and index_of(cmd) == f"{CUDA_INDEX}130"


def _fake_python(tmp_path: Path, cuda: bool, version: str) -> tuple[Path, Path]:
    """A venv python: ``-m pip`` logs its arguments; ``-c`` runs the real interpreter with a stub torch first on
    sys.path, whose cuda.is_available() returns ``cuda``."""
    stub = tmp_path / "stub" / "torch"
    stub.mkdir(parents=True)
    cuda_version = "13.0" if "+cu" in version else None
    (stub / "__init__.py").write_text(
        "import types\n"
        f"__version__ = {version!r}\n"
        f"version = types.SimpleNamespace(cuda={cuda_version!r})\n"
        f"cuda = types.SimpleNamespace(is_available=lambda: {cuda})\n")
    log = tmp_path / "pip.log"
    py = tmp_path / "python"
    _exe(py, f'if [ "$1" = -m ]; then echo "$@" >> {log}; exit 0; fi\n'
             f'PYTHONPATH={stub.parent} exec {sys.executable} "$@"\n')
    return py, log


def test_install_then_no_cuda_fails_in_one_line_naming_torch_index_url(tmp_path):
    py, log = _fake_python(tmp_path, cuda=False, version="2.13.0+cpu")
    res = run(tmp_path, smi=_driver("580.95.05"), python=str(py), dry=False)
    line = one_error_line(res)
    assert "2.13.0+cpu" in line and "torch.version.cuda None" in line and "580.95.05" in line
    assert log.read_text().split() == ["-m", "pip", "install", "-q", "torch==2.13.0+cu130",
                                       "--index-url", f"{CUDA_INDEX}130"]


def test_install_then_cuda_succeeds(tmp_path):
    py, log = _fake_python(tmp_path, cuda=True, version="2.13.0+cu130")
    res = run(tmp_path, smi=_driver("580.95.05"), python=str(py), dry=False)
    assert res.returncode == 0, res.stderr
    assert "2.13.0+cu130" in res.stdout.splitlines()[-1]
    assert "--index-url" in log.read_text()


def test_without_a_gpu_cuda_is_not_checked(tmp_path):
    """The CPU path installs and stops: a CPU torch is what it asked for."""
    py, log = _fake_python(tmp_path, cuda=False, version="2.13.0+cpu")
    res = run(tmp_path, python=str(py), dry=False)
    assert res.returncode == 0, res.stderr
    assert log.read_text().split() == ["-m", "pip", "install", "-q", "torch==2.13.0"]


def test_a_cpu_index_asked_for_on_a_gpu_node_is_not_checked(tmp_path):
    py, _ = _fake_python(tmp_path, cuda=False, version="2.13.0+cpu")
    res = run(tmp_path, smi=_driver("580.95.05"), python=str(py), dry=False,
              env={"TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"})
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_an_unreachable_cuda_index_and_a_cuda_13_driver_install_pypis_plain_torch(tmp_path, arch):
    """A machine that reaches only PyPI: PyPI's plain torch==2.13.0 (the CUDA 13.0 build since 2.11) serves a
    driver >= 580; named as PyPI's index, so a configured local folder of CPU wheels cannot stand in for it."""
    line, cmd = chosen(run(tmp_path, arch=arch, smi=_driver("580.95.05"), env={"CUDA_INDEX_BASE": UNREACHABLE}))
    assert cmd == ["/venv/bin/python", "-m", "pip", "install", "-q", "torch==2.13.0",
                   "--index-url", "https://pypi.org/simple"]  # fmt: skip
    assert "cannot be reached" in line and "PyPI" in line and "580.95.05" in line and arch in line


def test_an_unreachable_cuda_index_and_a_cuda_12_driver_fail_in_one_line(tmp_path):
    line = one_error_line(run(tmp_path, smi=_driver("575.57.08"), env={"CUDA_INDEX_BASE": UNREACHABLE}))
    assert "cannot be reached" in line and "575.57.08" in line and ">= 580" in line


def test_an_unreachable_cuda_index_leaves_the_cpu_path_and_torch_index_url_alone(tmp_path):
    _, cmd = chosen(run(tmp_path / "cpu", env={"CUDA_INDEX_BASE": UNREACHABLE}))
    assert cmd == ["/venv/bin/python", "-m", "pip", "install", "-q", "torch==2.13.0"]
    url = "https://download.pytorch.org/whl/cu126"
    _, cmd = chosen(run(tmp_path / "gpu", smi=_driver("580.95.05"), env={"CUDA_INDEX_BASE": UNREACHABLE,
                                                               "TORCH_INDEX_URL": url}))  # fmt: skip
    assert index_of(cmd) == url


def test_pypis_torch_installed_then_cuda_is_asserted(tmp_path):
    """The PyPI path checks torch.cuda.is_available() as the CUDA index's does: a CPU build fails in one line."""
    py, log = _fake_python(tmp_path, cuda=True, version="2.13.0")
    res = run(tmp_path, smi=_driver("580.95.05"), python=str(py), dry=False, env={"CUDA_INDEX_BASE": UNREACHABLE})
    assert res.returncode == 0, res.stderr
    assert "sees CUDA" in res.stdout.splitlines()[-1]
    assert log.read_text().split() == ["-m", "pip", "install", "-q", "torch==2.13.0", "--index-url",
                                       "https://pypi.org/simple"]  # fmt: skip
    bad = tmp_path / "cpu"
    bad.mkdir()
    py, _ = _fake_python(bad, cuda=False, version="2.13.0+cpu")
    line = one_error_line(run(bad, smi=_driver("580.95.05"), python=str(py), dry=False,
                              env={"CUDA_INDEX_BASE": UNREACHABLE}))  # fmt: skip
    assert "torch.cuda.is_available() is False" in line


def test_the_real_cuda_index_is_download_pytorch_org():
    """The tests point CUDA_INDEX_BASE at a fake index; unset, the script uses the real one."""
    assert "INDEX_BASE=${CUDA_INDEX_BASE:-https://download.pytorch.org/whl}" in SCRIPT.read_text()


def test_the_makefile_calls_the_script():
    """``make venv`` installs torch through the script, with the Makefile's TORCH_INDEX_URL."""
    text = (REPO / "Makefile").read_text()
    assert "scripts/torch_install.sh $(BIN)/python" in text
    assert "TORCH_INDEX_URL='$(TORCH_INDEX_URL)'" in text
    assert os.access(SCRIPT, os.R_OK)
