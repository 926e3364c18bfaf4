"""Checkpoints every rank writes together: DeepSpeed's files, then checksums, ``latest`` and rotation by rank 0; a
failed write on any rank fails the checkpoint on every rank (exit 74), and a stop at the update boundary saves first.
"""

from __future__ import annotations

import time
from pathlib import Path

from tdlm.config import to_dict
from tdlm.errors import TDLMError
from tdlm.training.distributed import first_line
from tdlm.training.run_dir import (
    CHECKPOINT_DIR,
    EXIT_NO_SPACE,
    RunAborted,
    Stopped,
    newest_verified_tag,
    rotate_checkpoints,
    signal_name,
    stop_verb,
    tree_bytes,
    verify_checksums,
    write_checksums,
    write_latest,
)
from tdlm.training.session import Session


class _WriteGuard:
    """Catches this rank's file-write failures inside ``engine.save_checkpoint`` (torch.save, the recovery-script
    copy) so that DeepSpeed's own collectives in it still run in step on every rank; after the first failure nothing
    more is written. The ranks then agree on the outcome (:func:`save_checkpoint`)."""

    def __init__(self, engine) -> None:
        self.targets = [(engine.checkpoint_engine, "save", 1), (engine, "_copy_recovery_script", 0)]
        self.error: BaseException | None = None
        self.path: str | None = None
        self._saved: list = []

    def _wrap(self, fn, path_arg: int):
        def guarded(*args, **kwargs):
            if self.error is not None:
                return None
            try:
                return fn(*args, **kwargs)
            except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError (no errno)
                self.error = e
                self.path = str(kwargs.get("path", kwargs.get("save_path",
                                args[path_arg] if len(args) > path_arg else "?")))
                return None
        return guarded

    def __enter__(self) -> _WriteGuard:
        for obj, name, path_arg in self.targets:
            self._saved.append((obj, name, name in vars(obj), getattr(obj, name)))
            setattr(obj, name, self._wrap(getattr(obj, name), path_arg))
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, own, fn in self._saved:
            if own:
                setattr(obj, name, fn)
            else:
                delattr(obj, name)


def _disk_full(errors: list, ckpt: Path, needed: int) -> bool:
    """ENOSPC / EDQUOT, or (torch.save gives no errno) less room left than a checkpoint needs."""
    import errno
    import shutil

    if any(e and e.get("errno") in (errno.ENOSPC, errno.EDQUOT) for e in errors):
        return True
    try:
        return shutil.disk_usage(ckpt).free < max(needed, 1)
    except OSError:
        return False


def save_checkpoint(sess: Session, step: int) -> None:
    """DeepSpeed checkpoint of the temporal modules + optimizer, with the data position (= step), then
    SHA256SUMS.json over all its files once every rank has written its part (collective); rank 0 then verifies it,
    points ``latest`` at it, and only then deletes the checkpoints beyond ``train.keep_last``.

    A write that fails on any rank (a full disk) fails the checkpoint on every rank together: rank 0 removes the
    partial folder (it never had checksums, so no resume would have taken it), ``latest`` and every older checkpoint
    stay as they were, and every rank raises :class:`RunAborted` with one line naming the folder."""
    import shutil

    import torch.distributed as dist

    ckpt = Path(sess.run.output_dir) / CHECKPOINT_DIR
    tag = f"step-{step}"
    with _WriteGuard(sess.engine) as guard:
        # save_latest=False: DeepSpeed would name the tag in `latest` before anyone verified it
        sess.engine.save_checkpoint(str(ckpt), tag=tag, exclude_frozen_parameters=True, save_latest=False,
                                    client_state={"step": step, "config": to_dict(sess.run)})
    mine = None
    if guard.error is not None:
        mine = {"rank": sess.rank, "path": guard.path, "errno": getattr(guard.error, "errno", None),
                "error": first_line(guard.error)}
    errors: list = [None] * sess.world
    dist.all_gather_object(errors, mine)  # also the barrier: every rank's files are written (or failed) now
    outcome: list = [None]
    if sess.rank == 0:
        failed = [e for e in errors if e]
        if not failed:
            try:
                write_checksums(ckpt / tag)
                verify_checksums(ckpt / tag)
                write_latest(ckpt, tag)
            except (OSError, TDLMError) as e:
                failed = [{"rank": 0, "path": str(ckpt / tag), "errno": getattr(e, "errno", None),
                           "error": first_line(e)}]
        if failed:
            previous = ckpt / f"step-{sess.saved_step}" if sess.saved_step is not None else None
            needed = tree_bytes(previous) if previous is not None else tree_bytes(ckpt / tag)
            full = _disk_full(failed, ckpt, needed)
            shutil.rmtree(ckpt / tag, ignore_errors=True)  # frees the space; it was never verified nor `latest`
            first = failed[0]
            why = "the disk is full" if full else "a write failed"
            kept = (f"the previous checkpoint {previous.name} is intact (verified)" if previous is not None
                    else "there is no earlier checkpoint (rerun from the start)")
            outcome[0] = (f"{ckpt}: {why} while saving checkpoint {tag} (rank {first['rank']}: {first['error']}; "
                          f"{first['path']}); removed the partial {tag}; {kept}; free space or move the run folder "
                          f"to a bigger disk, then " + ("resume with --resume" if previous is not None else
                                                        "run the same command again"))
        else:
            rotate_checkpoints(ckpt, tag, sess.run.train.keep_last)
    # no rank goes on (or exits) before rank 0 settled the folder
    dist.broadcast_object_list(outcome, src=0, device=sess.device)
    if outcome[0]:
        raise RunAborted(outcome[0], EXIT_NO_SPACE)
    sess.saved_step, sess.saved_at = step, time.monotonic()


def load_checkpoint(sess: Session) -> int:
    """Load the newest checkpoint whose files match their checksums; rank 0 picks the tag and every rank
    loads that one (broadcast), so ranks never resume from different steps."""
    import torch.distributed as dist

    ckpt = Path(sess.run.output_dir) / CHECKPOINT_DIR
    choice: list = [None, None]  # tag, error
    if sess.rank == 0:
        try:
            choice[0] = newest_verified_tag(ckpt)
        except TDLMError as e:
            choice[1] = str(e)
    dist.broadcast_object_list(choice, src=0, device=sess.device)
    if choice[1]:
        raise TDLMError(choice[1])
    path, client = sess.engine.load_checkpoint(str(ckpt), tag=choice[0], load_module_strict=False)
    if path is None:
        raise TDLMError(f"--resume: DeepSpeed could not load checkpoint {choice[0]} in {ckpt}")
    saved = client.get("config", {})
    if not sess.allow_recipe_change:
        for section in ("model", "data"):
            if saved.get(section) != to_dict(sess.run)[section]:
                raise TDLMError(f"--resume: run config section '{section}' differs from the checkpoint's "
                                f"({ckpt / choice[0]}); resume with the same model and data settings")
    return int(client["step"])


def stop_at_boundary(sess: Session, step: int, signum: int, bar=None) -> None:
    """Every rank: checkpoint ``step`` (unless it is the one on disk), record the exit in W&B (rank 0), then raise
    :class:`Stopped` with the one line rank 0 prints (launcher/train.py exits with EXIT_PREEMPTED)."""
    import torch.distributed as dist

    if sess.saved_step != step:
        save_checkpoint(sess, step)
    if bar is not None:
        bar.close()
    verb, name = stop_verb(signum), signal_name(signum)
    tag_dir = Path(sess.run.output_dir) / CHECKPOINT_DIR / f"step-{step}"
    if sess.rank == 0:
        sess.tracker.stop(step, verb, name)
    dist.barrier()  # no rank exits (and has its launcher terminate rank 0) while rank 0 still closes the W&B run
    raise Stopped(f"{verb} at step {step} ({name}; checkpoint {tag_dir}); resume with --resume", step)
