"""The wheels the GPU check carries to a machine with no network (``bash bench/gpu_check.sh --fetch``).

The GPU image has torch 2.11 and no DeepSpeed, pydantic or hjson (shared notes, gpu-facts). ``--fetch`` carries
DeepSpeed and its whole requirement closure, each pinned to the version this venv runs (the versions the suite
tests), torch's own subtree left out (the image's torch serves it)::

    python bench/gpu_check_wheels.py pins                 # deepspeed==0.19.8, einops==..., typing-extensions==...
    python bench/gpu_check_wheels.py stub-torch DIR 2.11.0  # a metadata-only torch wheel: the image's torch

The stub stands for the image's preinstalled torch in the offline check that ``--fetch`` ends with: ``pip install
--dry-run --no-index --find-links .whl --find-links STUB`` for Python 3.12 on the target's platform, so a pin that
is missing, a dependency not fetched or a wheel of the wrong platform fails here, not on the GPU machine.
Standard library only (runs under the venv's python; ``importlib.metadata`` reads what it installed).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import re
import sys
import zipfile
from pathlib import Path

ROOT_PACKAGE = "deepspeed"
LEFT_TO_THE_IMAGE = ("torch",)  # preinstalled on the GPU image (with its own dependencies): never carried


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(dist: md.Distribution) -> list[str]:
    """Names of ``dist``'s unconditional requirements and those whose marker holds for CPython 3.12 on Linux (no
    extras): a marker this parser cannot decide keeps the requirement (fetching one too many is harmless)."""
    names = []
    for req in dist.requires or []:
        spec, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        if marker.strip() and not _marker_holds(marker):
            continue
        names.append(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec).group(1))
    return names


def _marker_holds(marker: str) -> bool:
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "os_name": "posix", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "platform_machine": "x86_64"}  # fmt: skip
    try:
        from packaging.markers import Marker  # the venv has it (pip and DeepSpeed need it)

        return Marker(marker).evaluate(env)
    except Exception:
        return True


def pins(root: str = ROOT_PACKAGE) -> list[str]:
    """``name==version`` of ``root`` and every requirement it pulls in, as installed here, torch's subtree left
    out; ``root`` first, the rest sorted."""
    seen: dict[str, str] = {}

    def walk(name: str) -> None:
        key = _norm(name)
        if key in seen or key in LEFT_TO_THE_IMAGE:
            return
        dist = md.distribution(name)
        seen[key] = dist.version
        for dep in _requirement_names(dist):
            walk(dep)

    walk(root)
    first = _norm(root)
    return [f"{first}=={seen[first]}"] + sorted(f"{k}=={v}" for k, v in seen.items() if k != first)


def stub_wheel(folder: Path, name: str, version: str, requires: list[str] | tuple = ()) -> Path:
    """A metadata-only ``name-version-py3-none-any.whl`` in ``folder`` (``requires``: its Requires-Dist lines):
    what pip's resolver needs to take a package the target machine already has as given (it installs nothing
    real); the tests build a whole offline index of them."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpu_check_wheels\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}  # fmt: skip
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    out = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["pins"]:
        print("\n".join(pins(*argv[1:2])))
        return 0
    if argv[:1] == ["stub-torch"] and len(argv) == 3:
        print(stub_wheel(Path(argv[1]), "torch", argv[2]))
        return 0
    print("usage: gpu_check_wheels.py pins [PACKAGE] | stub-torch DIR VERSION", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
