"""``launcher/train.py`` is thin; its exit statuses and one-line messages come from :func:`tdlm.training.entry.run`.

Each way a rank can end is driven in-process here, at unit speed: the input errors through the real checks
(:mod:`tdlm.training.launch`), the training outcomes through a stand-in for :func:`tdlm.training.loop.train` that
raises what the real one raises (the real ones: tests/test_training.py, test_full_disk.py, test_multinode_training.py,
under DeepSpeed). One subprocess runs the launcher itself, to show what it must do before torch is imported.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tdlm.errors import TDLMError
from tdlm.training import entry
from tdlm.training import run_dir as rd

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "launcher" / "train.py"
Z3 = str(REPO / "ds_configs" / "zero3.json")
TINY = str(REPO / "configs" / "tiny.yaml")


@pytest.fixture(autouse=True)
def clean_stop(monkeypatch):
    """run() takes over the process's stop signals and the one StopRequest: both are put back after each test. The
    launcher watch (a thread that signals this process if its parent dies) and a stop's immediate end (os._exit) are
    recorded instead of done: ``watched`` and ``ended`` (the signal it would have ended on)."""
    handlers = {s: signal.getsignal(s) for s in rd.STOP_SIGNALS}
    saved = dict(vars(rd.STOP))
    rec: dict[str, list] = {"watched": [], "ended": []}
    monkeypatch.setattr(rd, "stop_with_launcher", lambda: rec["watched"].append(True))
    rd.STOP._end_soon = lambda: rec["ended"].append(rd.STOP.signum)  # an instance attribute: gone with `saved`
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("WORLD_SIZE", "1")
    yield rec
    vars(rd.STOP).clear()
    vars(rd.STOP).update(saved)
    for s, h in handlers.items():
        signal.signal(s, h)


def _valid(tmp_path: Path) -> list[str]:
    """A command line that passes every check (its trajectory folder is not the embedded default's, so nothing is
    generated)."""
    return ["--ds", Z3, "--config", TINY, "--output-dir", str(tmp_path / "run"),
            f"data.trajectories={tmp_path / 'traj'}"]


def _train_raises(monkeypatch, exc: BaseException | None, before=None) -> list[dict]:
    """Skip the preflight (covered below) and replace training by one that raises ``exc`` (None: returns)."""
    import tdlm.training.launch
    import tdlm.training.loop

    calls: list[dict] = []

    def train(run, ds_raw, **kw):
        calls.append(kw)
        if before:
            before()
        if exc is not None:
            raise exc

    monkeypatch.setattr(tdlm.training.launch, "preflight_before_work", lambda launch: None)
    monkeypatch.setattr(tdlm.training.loop, "train", train)
    return calls


# -- input errors: status 2, one line, before any work ---------------------------------------------------------
def test_help_is_status_0_and_prints_the_description(capsys, clean_stop):
    assert entry.run(["--help"], "Train TDLM temporal modules (the launcher's docstring).") == 0
    out, err = capsys.readouterr()
    assert "Train TDLM temporal modules (the launcher's docstring)." in out and "--ds DS" in out and err == ""
    assert clean_stop["watched"] == [True]  # the launcher watch started
    assert not rd.STOP.immediate  # input checked: a stop no longer ends the process


def test_usage_error_is_status_2_with_argparse_lines(capsys):
    assert entry.run(["--config", TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: ") and err[-1].endswith("error: the following arguments are required: --ds")


@pytest.mark.parametrize("args, line", [
    (["--config", "nope.yaml"], "error: nope.yaml: config file not found"),
    (["--config", TINY, "model.layerz=all"], "error: override 'model.layerz=all': unknown key 'model.layerz'"),
    (["--config", TINY, "--allow-recipe-change"], "error: --allow-recipe-change applies to --resume only"),
    (["--config", TINY, "model.layers=dispersed:99"],  # found by the preflight (backbone + allocation)
     "error: configs/tiny.yaml: model.layers='dispersed:99'"),
])
def test_bad_input_is_status_2_and_one_error_line(capsys, tmp_path, monkeypatch, args, line):
    monkeypatch.chdir(REPO)  # the config named as the user gave it
    tiny = ["configs/tiny.yaml" if a == TINY else a for a in args]
    assert entry.run(["--ds", Z3, *tiny, "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(line), err
    assert not (tmp_path / "run").exists()


def test_a_rank_above_0_is_quiet_while_rank_0_reports_then_names_itself(capsys, monkeypatch):
    """Rank 0 prints the input error; the launcher then ends rank 1 (SIGTERM = a stop request) and rank 1 prints
    nothing. Only when that never comes does rank 1 print the line itself, naming its rank."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(entry, "PEER_REPORT_WAIT_S", 5.0)
    timer = threading.Timer(0.3, rd.STOP.handler, (signal.SIGTERM,))  # the launcher ending this rank
    timer.start()
    assert entry.run(["--ds", Z3, "--config", "nope.yaml"]) == 2
    timer.join()
    assert capsys.readouterr().err == ""
    vars(rd.STOP).update(signum=None, _ending=False)
    monkeypatch.setattr(entry, "PEER_REPORT_WAIT_S", 0.2)
    assert entry.run(["--ds", Z3, "--config", "nope.yaml"]) == 2
    assert capsys.readouterr().err == "rank 1: error: nope.yaml: config file not found\n"
    assert entry.run(["--config", "nope.yaml"]) == 2  # argparse's usage error: its last line only
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rank 1: {Path(sys.argv[0]).name}: error: the following arguments are required: --ds"]


# -- training outcomes -------------------------------------------------------------------------------------------
def test_a_finished_run_is_status_0_and_gets_the_launch(capsys, tmp_path, monkeypatch):
    calls = _train_raises(monkeypatch, None)
    assert entry.run([*_valid(tmp_path), "--max-steps", "3"]) == 0
    assert calls == [{"resume": False, "source": TINY, "ds_source": Z3, "allow_recipe_change": False}]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("rank", ["0", "1"])
def test_stopped_is_status_75_printed_by_rank_0(capsys, tmp_path, monkeypatch, rank):
    monkeypatch.setenv("RANK", rank)
    _train_raises(monkeypatch, rd.Stopped("preempted at step 4 (SIGTERM); resume with --resume", 4))
    assert entry.run(_valid(tmp_path)) == rd.EXIT_PREEMPTED == 75
    assert capsys.readouterr().err == ("preempted at step 4 (SIGTERM); resume with --resume\n" if rank == "0" else "")


@pytest.mark.parametrize("code, printer", [(rd.EXIT_NO_SPACE, 0), (rd.EXIT_PEER_LOST, 1)])
@pytest.mark.parametrize("rank", ["0", "1"])
def test_run_aborted_is_its_own_status_printed_by_its_printer(capsys, tmp_path, monkeypatch, code, printer, rank):
    monkeypatch.setenv("RANK", rank)
    _train_raises(monkeypatch, rd.RunAborted("no space left writing step-4; step-2 is intact", code, printer))
    assert entry.run(_valid(tmp_path)) == code
    want = "error: no space left writing step-4; step-2 is intact\n" if int(rank) == printer else ""
    assert capsys.readouterr().err == want
    assert (rd.EXIT_NO_SPACE, rd.EXIT_PEER_LOST) == (74, 76)


def test_an_input_error_found_by_training_is_status_2(capsys, tmp_path, monkeypatch):
    _train_raises(monkeypatch, TDLMError("runs/x: holds a run; pass --resume or another --output-dir"))
    assert entry.run(_valid(tmp_path)) == 2
    assert capsys.readouterr().err == "error: runs/x: holds a run; pass --resume or another --output-dir\n"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(entry, "PEER_REPORT_WAIT_S", 0.2)
    assert entry.run(_valid(tmp_path)) == 2
    assert capsys.readouterr().err == "rank 1: error: runs/x: holds a run; pass --resume or another --output-dir\n"


def test_an_unexpected_error_is_raised_unless_stopping(capsys, tmp_path, monkeypatch):
    """A bug is a traceback (status 1 from the interpreter); the same error while a stop is under way is a peer's
    broken collective: status 1 and one line naming the signal, not a gloo traceback."""
    _train_raises(monkeypatch, RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        entry.run(_valid(tmp_path))

    def signalled():  # as training sees it: set-up has cleared `immediate`, then the launcher's SIGTERM
        rd.STOP.immediate = False
        rd.STOP.handler(signal.SIGTERM)

    _train_raises(monkeypatch, RuntimeError("[gloo] Connection closed by peer\n  at 127.0.0.1"), before=signalled)
    assert entry.run(_valid(tmp_path)) == rd.EXIT_FAILED == 1
    assert capsys.readouterr().err == (
        "rank 0: stopped by SIGTERM before the ranks could agree on a checkpoint (RuntimeError: [gloo] Connection "
        "closed by peer); resume with --resume (from the newest verified checkpoint)\n")


def test_a_signal_caught_during_the_launchers_imports_is_a_stop(tmp_path, monkeypatch, clean_stop):
    """The launcher hands over the signals it caught before run() could install the stop handlers: the first one is
    the stop's signal, and (nothing written yet) the process is set to end at once; --resume changes the hint."""
    calls = _train_raises(monkeypatch, None)
    assert entry.run([*_valid(tmp_path), "--resume"], None, [signal.SIGUSR1, signal.SIGTERM]) == 0
    deadline = time.monotonic() + 5
    while not clean_stop["ended"] and time.monotonic() < deadline:  # the end runs on its own thread
        time.sleep(0.01)
    assert clean_stop["ended"] == [signal.SIGUSR1] and len(calls) == 1
    assert rd.STOP.signum == signal.SIGUSR1 and rd.STOP.hint == "resume with --resume"
    assert all(signal.getsignal(s) == rd.STOP.handler for s in rd.STOP_SIGNALS)


# -- the launcher itself -------------------------------------------------------------------------------------------
# Runs the launcher as `python launcher/train.py` does, with a finder that reports, at torch's first import, whether
# the launcher had already set MKL_CBWR and taken the stop signals.
_AT_TORCH = r"""
import os, runpy, signal, sys

class AtTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            taken = [signal.getsignal(s) not in (signal.SIG_DFL, signal.default_int_handler)
                     for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)]
            print(f"at torch: MKL_CBWR={os.environ.get('MKL_CBWR')} signals={taken}", file=sys.stderr, flush=True)
        return None

sys.meta_path.insert(0, AtTorch())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_launcher_sets_its_environment_and_signals_before_torch(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "RANK")}
    env |= {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-c", _AT_TORCH, str(LAUNCHER), "--ds", Z3, "--config", "configs/tiny.yaml",
                           "model.layers=dispersed:99", "--output-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines[0] == "at torch: MKL_CBWR=AUTO,STRICT signals=[True, True, True]", proc.stderr[-2000:]
    assert len(lines) == 2 and lines[1].startswith("error: configs/tiny.yaml: model.layers='dispersed:99'"), lines


def test_the_launchers_help_is_its_docstring():
    proc = subprocess.run([sys.executable, str(LAUNCHER), "--help"], capture_output=True, text=True, timeout=300)
    doc = ast.get_docstring(ast.parse(LAUNCHER.read_text()), clean=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: train.py [-h] --ds DS") and doc.strip() in proc.stdout


def test_the_launcher_stays_thin():
    """The issue's measure: the launcher holds the set-up that must precede torch and a call of run(); a `try`, a
    function or a class there means exit-code handling has grown back outside the tested library function."""
    text = LAUNCHER.read_text()
    tree = ast.parse(text)
    grown = [type(n).__name__ for n in ast.walk(tree) if isinstance(n, (ast.Try, ast.FunctionDef, ast.ClassDef))]
    assert grown == [] and len(text.splitlines()) <= 80, (grown, len(text.splitlines()))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "run"]
    assert len(calls) == 1 and any(isinstance(n, ast.ImportFrom) and n.module == "tdlm.training.entry"
                                   for n in tree.body)
