"""Helpers shared by the sandbox tests that run in every setting (backend x cgroup / no cgroup): the settings, their
limits, one probe run per setting, and the controls' hook that weakens the seccomp filter's rule tables."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from conftest import SANDBOX_BACKENDS, sandbox_limits_for

from tdlm.evaluation.sandbox import host

SETTINGS = [(b, cg) for b in SANDBOX_BACKENDS for cg in ("cgroup", "nocgroup")]
_probed: dict[tuple, object] = {}


def limits_for(backend: str, cgroup: str, **limits):
    """The limits of one setting (``limits``: the file's fast limits); skipped where no cgroup can be written."""
    if cgroup == "cgroup" and host.cgroups().kind is None:
        pytest.skip(f"no writable cgroup here ({host.cgroups().note})")
    return sandbox_limits_for(backend, **limits, use_cgroups=cgroup == "cgroup")


def probed_once(key: tuple, run: Callable[[], object]) -> object:
    """``run()`` once per ``key`` (a file's probe and its setting) for the whole session: the tests of one setting
    share one sandboxed run."""
    if key not in _probed:
        _probed[key] = run()
    return _probed[key]


def rule_tables(monkeypatch) -> Iterator[Callable[..., None]]:
    """The body of a ``without_rules`` fixture: yields ``weaken(NAME=value, ...)``, which replaces rule tables of
    the filter and rebuilds it; the real tables and program are back after the test."""

    def weaken(**tables) -> None:
        for k, v in tables.items():
            monkeypatch.setattr(host, k, v)
        host.seccomp_program.cache_clear()

    yield weaken
    monkeypatch.undo()
    host.seccomp_program.cache_clear()
