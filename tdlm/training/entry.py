"""The body of ``launcher/train.py``: one launch, from its command line to an exit status and at most one line.

The launcher keeps only what must happen before torch is imported (``MKL_CBWR``, the early stop-signal handlers)
and calls :func:`run`, so that everything a launch decides can be tested in-process. :func:`run` checks the input
first (:mod:`.launch`: the command line, every field, the DS JSON, the backbone and the allocation), then trains
(:func:`tdlm.training.loop.train`), and maps each way a rank can end to its status (``EXIT_*`` of :mod:`.run_dir`)
and the one line that says why, printed once for all ranks:

=================================================  ======  ====================================================
how the rank ends                                  status  who prints
=================================================  ======  ====================================================
done (or ``--help``)                               0       -
argparse usage error                               2       rank 0 (argparse's usage and error lines)
bad input (:class:`~tdlm.errors.TDLMError`)        2       rank 0: ``error: ...``; a rank > 0 only if rank 0
                                                           never does (``rank R: error: ...``)
stopped by a signal (:class:`.Stopped`)            75      rank 0: the message
disk full / a lost peer (:class:`.RunAborted`)     74, 76  rank ``printer``: ``error: ...``
an error while stopping (a peer ended first)       1       each rank: ``rank R: stopped by SIG...``
anything else                                      1       the traceback (raised from here)
=================================================  ======  ====================================================
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from collections.abc import Sequence

PEER_REPORT_WAIT_S = 20.0  # how long a rank > 0 leaves rank 0 to report an input error (its launcher ends us)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))  # set by deepspeed / torchrun before the rank's process starts


def _quiet_unless_rank0() -> contextlib.AbstractContextManager[io.StringIO | None]:
    """Ranks > 0 keep their messages (argparse usage, errors) to themselves while the input is checked: every rank
    checks the same input, rank 0 reports it, once."""
    return contextlib.nullcontext(None) if _rank() == 0 else contextlib.redirect_stderr(io.StringIO())


def _peer_exit(stop, message: str) -> int:
    """A rank > 0 with an input error: rank 0 prints the same one line, and the launcher then ends this rank
    (SIGTERM, a stop request). Only if that never comes is the message printed here, naming the rank."""
    from tdlm.training.run_dir import EXIT_BAD_INPUT

    stop.immediate = False  # this exit is an input error's (2), not a stop's
    deadline = time.monotonic() + PEER_REPORT_WAIT_S
    while time.monotonic() < deadline and not stop.requested:
        time.sleep(0.1)
    if not stop.requested and message:
        print(f"rank {_rank()}: {message}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def run(argv: list[str] | None = None, description: str | None = None, early_signals: Sequence[int] = ()) -> int:
    """One launch of this rank; returns its exit status (the table above). ``argv`` None reads ``sys.argv``;
    ``description`` heads ``--help`` (the launcher's docstring); ``early_signals`` are the stop signals the launcher
    caught during its imports: read after the stop handlers are installed here, so one arriving until then counts."""
    from tdlm.training.run_dir import (
        EXIT_BAD_INPUT,
        EXIT_FAILED,
        EXIT_OK,
        EXIT_PREEMPTED,
        STOP,
        RunAborted,
        Stopped,
        stop_with_launcher,
    )

    rank = _rank()
    stop = STOP.install()
    stop.immediate = True  # nothing written yet: a stop ends the process (tdlm.training.run_dir.StopRequest)
    if early_signals:
        stop.handler(early_signals[0])
    from tdlm.errors import TDLMError

    stop_with_launcher()  # if the deepspeed / torchrun process above this rank dies, this rank stops (checkpoint)
    buffered = _quiet_unless_rank0()
    try:
        # Validation first, before trajectories, weights or a process group: the command line, every field, the DS
        # JSON through DeepSpeed's own config model, the backbone and the allocation (tdlm.training.launch).
        with buffered as err:
            from tdlm.training.launch import parse_launch, preflight_before_work

            launch = parse_launch(argv, description)
            if launch.resume:
                stop.hint = "resume with --resume"
            preflight_before_work(launch)
    except SystemExit as e:  # argparse: usage or --help, printed by rank 0 only
        stop.immediate = False
        code = e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
        if rank != 0 and code:
            lines = (err.getvalue() if err is not None else "").strip().splitlines()
            return _peer_exit(stop, lines[-1] if lines else "")
        return code
    except TDLMError as e:
        if rank != 0:
            return _peer_exit(stop, f"error: {e}")
        stop.immediate = False
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    try:
        from tdlm.data.toy_trajectories import ensure_toy_trajectories
        from tdlm.training.config import DataConfig
        from tdlm.training.loop import train

        if launch.run.data.trajectories == DataConfig.trajectories:  # only the embedded default's own folder:
            ensure_toy_trajectories(launch.run.data.trajectories, launch.run.model.backbone)  # a typo is an error
        train(launch.run, launch.ds_raw, resume=launch.resume, source=launch.source, ds_source=launch.ds_path,
              allow_recipe_change=launch.allow_recipe_change)
    except Stopped as e:
        stop.immediate = False
        if rank == 0:
            print(e.message, file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    except RunAborted as e:  # a full disk at a checkpoint, a lost peer: every rank knows; one prints
        stop.immediate = False
        if rank == e.printer:
            print(f"error: {e.message}", file=sys.stderr, flush=True)
        return e.exit_code
    except TDLMError as e:
        stop.immediate = False
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        return _peer_exit(stop, f"error: {e}")
    except Exception as e:
        stop.immediate = False
        if not stop.requested:
            raise
        # Stopping, a peer rank ended first (its collective broke): one line, not a gloo traceback.
        from tdlm.training.run_dir import signal_name

        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        print(f"rank {rank}: stopped by {signal_name(stop.signum)} before the ranks could agree on a checkpoint "
              f"({type(e).__name__}: {first}); resume with --resume (from the newest verified checkpoint)",
              file=sys.stderr, flush=True)
        return EXIT_FAILED
    return EXIT_OK
