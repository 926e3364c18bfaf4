"""On-policy rounds (``ray_jobs/onpolicy.py``): roll in with the student, roll out with the frozen backbone, train on a
mix, sync the adapter; round by round, resumable in every phase.

Round 0 is the off-policy pipeline: the teacher (the frozen backbone, ``decode.policy``) decodes the first
``prompts_per_round`` prompts on Ray actors (:func:`tdlm.generation.generate`), then ``launcher/train.py`` trains the
adapter (the same command users run, under ``launcher``). Round r >= 1:

1. ``prompts`` - the next ``prompts_per_round`` prompts of the file that no earlier round used (fresh every round;
   checked against the evaluation splits before any work);
2. ``records`` - the generation job in roll-out mode: actors load the backbone and adapter version r-1 (only the
   temporal weights move: the adapter folder), roll in with policy tdlm at the round's tau, draw s*, and the frozen
   backbone rolls out; the shards hold the hybrid records (:mod:`tdlm.data.onpolicy`) and the exposure-gap sums.
   Exactly-once shards and resume as in generation;
3. ``mix`` - ``mix_lambda`` of the mix from this round's records, the rest replayed from the teacher's records and
   the last ``replay_window`` rounds' (a record staler than ``staleness`` versions is refused); written as a
   trajectory folder with a manifest;
4. ``train`` - ``launcher/train.py`` continues adapter r-1 (``model.init_adapter``) for ``updates_per_round``
   updates on the mix (``--resume`` when a killed launch left a checkpoint);
5. ``sync`` - the exported adapter (ZeRO-3's partitions gathered by the export) becomes version r:
   ``rounds/NN/adapter`` with ``version.json`` (version, round, sha256 of its weights).

``onpolicy.json`` holds the job's identity settings and each round's finished phases. A rerun of the same command
skips finished phases and resumes the one it was killed in; a changed identity setting is refused in one line
(``rounds`` may grow). Ray's actors are gone before each training launch (the generation job kills its actors and
stops the local cluster it started), so rollouts and training take turns on the same GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from tdlm.config import load_config, load_yaml, to_dict
from tdlm.data.contamination import check_teacher_prompts, prompt_hashes
from tdlm.data.folder_lock import FolderLock
from tdlm.data.onpolicy import check_staleness, mix_counts, mix_records
from tdlm.data.prompts import PromptSource, load_prompts
from tdlm.data.store import MANIFEST, atomic_write_json, atomic_write_text, sha256_of, shard_name, write_manifest
from tdlm.data.stream import shard_paths, verify_manifest
from tdlm.data.trajectories import TrajectoryRecord, read_parquet, write_parquet
from tdlm.errors import TDLMError
from tdlm.generation.config import GenerationConfig
from tdlm.generation.driver import generate
from tdlm.onpolicy.config import OnPolicyConfig
from tdlm.sweep.trial import REPO, failure_reason, launcher_command, run_teed
from tdlm.temporal.adapter_files import ADAPTER_WEIGHTS, adapter_config_path, read_config
from tdlm.training.config import RunConfig
from tdlm.training.run_dir import free_port, training_resume_args

log = logging.getLogger("tdlm.onpolicy")

STATE = "onpolicy.json"
FORMAT = "tdlm-onpolicy"
PHASES = ("prompts", "records", "mix", "train", "sync")
KILL_ENV = "TDLM_TEST_ONPOLICY_KILL"  # tests: "<round>:<phase>" -> SIGKILL-like exit in the middle of that phase


def round_dir(out: Path, r: int) -> Path:
    return out / "rounds" / f"{r:02d}"


def _maybe_kill(r: int, phase: str) -> None:
    """Test fault injection: die without cleanup in the middle of ``phase`` of round ``r`` (exit 137, as SIGKILL)."""
    if os.environ.get(KILL_ENV) == f"{r}:{phase}":
        log.warning("TEST FAULT INJECTION: killed in round %d phase %s", r, phase)
        sys.stdout.flush()
        os._exit(137)


# -- checks before any work ---------------------------------------------------------------------------
def recipe(cfg: OnPolicyConfig) -> RunConfig:
    """Round 0's training recipe (train_config + train_overrides), checked as a launch would."""
    from tdlm.training.loop import validate_run

    run = load_config(RunConfig, cfg.train_config, list(cfg.train_overrides))
    validate_run(run, cfg.train_config)
    return run


def check_adapter_backbone(directory: str, backbone: str, where: str) -> None:
    """An adapter trained on another backbone is refused (its recorded weight fingerprint or family / vocabulary)."""
    from tdlm.models.loading import load_backbone_meta, weight_fingerprint_of

    if not (Path(directory) / ADAPTER_WEIGHTS).is_file():
        raise TDLMError(f"{where}: {directory} holds no {ADAPTER_WEIGHTS} (an adapter folder)")
    raw = read_config(adapter_config_path(directory)).get("backbone") or {}
    meta = load_backbone_meta(backbone)
    have = {"family": meta.family, "vocab_size": meta.vocab_size, "hidden_size": meta.hidden_size,
            "num_layers": meta.num_layers}  # fmt: skip
    if raw.get("fingerprint") is not None:
        have["fingerprint"] = weight_fingerprint_of(backbone)
    differ = [f"{k}={raw[k]!r} (the job's backbone: {v!r})" for k, v in have.items()
              if raw.get(k) is not None and raw[k] != v]  # fmt: skip
    if differ:
        raise TDLMError(f"{where}: {directory} was trained on backbone {raw.get('id')!r}, not the job's "
                        f"{backbone!r}: {'; '.join(differ)}")  # fmt: skip


def _validation_hashes() -> dict[str, str]:
    """hash -> id of the toy task's validation problems (the split recipes are chosen on; the contamination check
    covers the test splits)."""
    from tdlm.tasks.toydata import MULTI_TEST_SIZE, held_out_pool, multi_split

    n = len(held_out_pool(0)) - MULTI_TEST_SIZE
    problems = multi_split("validation", n)
    return dict(zip(prompt_hashes([p.question for p in problems]), [p.id for p in problems], strict=True))


def plan_prompts(cfg: OnPolicyConfig, used: set[str]) -> list[list[dict]]:
    """Each round's prompts: the next ``prompts_per_round`` of the file whose text no earlier round used (round 0's
    teacher trajectories count as used when given). Refuses, before any work, a file too short for the rounds and
    prompts that are evaluation problems (test splits) or validation problems."""
    src = PromptSource(cfg.prompts, cfg.prompt_field, cfg.prompt_config, cfg.prompt_split)
    prompts = load_prompts(src)
    seen = set(used)
    rounds: list[list[dict]] = []
    it = iter(prompts)
    first = 1 if cfg.round0_trajectories else 0
    for r in range(first, cfg.rounds + 1):
        take: list[dict] = []
        for p in it:
            if p.text in seen:
                continue
            seen.add(p.text)
            take.append({cfg.prompt_field: p.text, "source": p.source_id})
            if len(take) == cfg.prompts_per_round:
                break
        if len(take) < cfg.prompts_per_round:
            raise TDLMError(f"prompts: {cfg.prompts} holds {len(prompts)} prompts, too few for {cfg.rounds} round(s) "
                            f"of prompts_per_round={cfg.prompts_per_round} fresh prompts (round {r} got "
                            f"{len(take)})")  # fmt: skip
        rounds.append(take)
    texts = [row[cfg.prompt_field] for rows in rounds for row in rows]
    try:
        check_teacher_prompts(src, texts, False)  # the test splits, by name and by content
    except TDLMError as e:
        raise TDLMError(f"{str(e).split('; generate teacher prompts')[0]}; the on-policy job never trains on "
                        f"evaluation problems") from None  # fmt: skip
    val = _validation_hashes()
    hits = [val[h] for h in prompt_hashes(texts) if h in val]
    if hits:
        raise TDLMError(f"prompts: {len(hits)} of the job's {len(texts)} prompts are validation problems (e.g. "
                        f"{', '.join(sorted(hits)[:3])}); recipes are chosen on that split, so it never trains")
    if first:
        rounds.insert(0, [])
    return rounds


def _read_records(folder: Path) -> tuple[list[TrajectoryRecord], list[str]]:
    verify_manifest(folder)
    recs: list[TrajectoryRecord] = []
    where: list[str] = []
    for path in shard_paths(folder):
        got = read_parquet(path)
        recs.extend(got)
        where.extend(f"{path} row {i}" for i in range(len(got)))
    return recs, where


# -- the job ------------------------------------------------------------------------------------------
class Job:
    """One on-policy job folder: its state file, its rounds and their phases."""

    def __init__(self, cfg: OnPolicyConfig, config_path: str | None = None) -> None:
        self.cfg = cfg.validate(config_path or "on-policy config")
        self.out = Path(cfg.output_dir)
        self.run = recipe(cfg)
        self.backbone = self.run.model.backbone
        if cfg.round0_adapter:
            check_adapter_backbone(cfg.round0_adapter, self.backbone, "round0_adapter")
        used: set[str] = set()
        if cfg.round0_trajectories:
            recs, _ = _read_records(Path(cfg.round0_trajectories))
            used = {r.prompt_text for r in recs}
            if recs and any(r.backbone_id and r.backbone_id != recs[0].backbone_id for r in recs):
                raise TDLMError(f"round0_trajectories: {cfg.round0_trajectories} mixes backbones")
        self.prompts = plan_prompts(cfg, used)
        self.state = self._load_state()
        self.group = cfg.wandb_group or self.out.resolve().name
        self.tracker = None

    # state ------------------------------------------------------------------------------------------
    def _load_state(self) -> dict:
        path = self.out / STATE
        ident = self.cfg.identity()
        if not path.exists():
            return {"format": FORMAT, "identity": ident, "rounds": {}}
        try:
            state = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise TDLMError(f"{path}: invalid JSON ({e})") from None
        if state.get("format") != FORMAT:
            raise TDLMError(f"{path}: not an on-policy job state (format={state.get('format')!r})")
        from tdlm.config import diff_settings

        changed = diff_settings(state["identity"], ident)
        if changed:
            raise TDLMError(f"{self.out}: this job's finished rounds were made with other settings "
                            f"({'; '.join(changed)}); rerun with the same settings (rounds may grow) or use a new "
                            f"output_dir")  # fmt: skip
        return state

    def _save(self) -> None:
        atomic_write_json(self.out / STATE, self.state)

    def done(self, r: int, phase: str) -> bool:
        return phase in self.state["rounds"].get(str(r), {}).get("phases", [])

    def _mark(self, r: int, phase: str, **info) -> None:
        entry = self.state["rounds"].setdefault(str(r), {"phases": []})
        entry["phases"].append(phase)
        entry.update(info)
        self._save()

    # phases -----------------------------------------------------------------------------------------
    def adapter_of(self, r: int) -> Path:
        if r == 0 and self.cfg.round0_adapter:
            return Path(self.cfg.round0_adapter)
        return round_dir(self.out, r) / "adapter"

    def records_of(self, r: int) -> Path:
        if r == 0 and self.cfg.round0_trajectories:
            return Path(self.cfg.round0_trajectories)
        return round_dir(self.out, r) / "records"

    def phase_prompts(self, r: int) -> None:
        path = round_dir(self.out, r) / f"round-{r:02d}.jsonl"
        text = "".join(json.dumps(row) + "\n" for row in self.prompts[r])
        if path.exists() and path.read_text() != text:
            raise TDLMError(f"{path}: differs from the prompts this job draws for round {r} (was the prompt file "
                            f"changed?); restore it or use a new output_dir")  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
        self._mark(r, "prompts", prompts=len(self.prompts[r]))

    def generation_config(self, r: int) -> GenerationConfig:
        c = self.cfg
        common = dict(backbone=self.backbone, prompts=str(round_dir(self.out, r) / f"round-{r:02d}.jsonl"),
                      output_dir=str(self.records_of(r)), prompt_field=c.prompt_field, chat=c.chat,
                      shard_size=c.shard_size, actors=c.actors, cpus_per_actor=c.cpus_per_actor, address=c.address,
                      log_interval=10.0)  # fmt: skip
        if r == 0:  # the teacher: the job's decode section as it is
            return GenerationConfig(**common, decode=c.decode)
        # the roll-in: the same section with the student's rule and the round's tau; the roll-out's teacher keeps
        # the section's policy
        student = dataclasses.replace(c.decode, policy="tdlm", threshold=c.tau(r))
        return GenerationConfig(**common, decode=student, adapter=str(self.adapter_of(r - 1)), switch=c.switch,
                                teacher_policy=c.decode.policy, switch_seed=c.seed * 1000 + r, round=r,
                                adapter_version=r - 1, gap_prompts=c.gap_prompts)  # fmt: skip

    def phase_records(self, r: int) -> dict:
        if os.environ.get(KILL_ENV) == f"{r}:records":
            os.environ["TDLM_TEST_KILL_AFTER_SHARDS"] = "1"  # the generation driver dies after its first shard
        generate(self.generation_config(r))
        manifest = json.loads((self.records_of(r) / MANIFEST).read_text())
        info = {"records_nfe_mean": manifest["nfe"]["mean"]}
        if r >= 1:
            shards = list(manifest["shards"].values())
            rows = sum(e["rows"] for e in shards)
            extra = [e.get("extra") or {} for e in shards]
            info["student_nfe_mean"] = sum(x.get("student_nfe_sum", 0) for x in extra) / rows
            info["switch_step_mean"] = sum(x.get("switch_step_sum", 0) for x in extra) / rows
            gaps = [x["gap"] for x in extra if "gap" in x]
            if gaps:
                s = [sum(g["student"][i] for g in gaps) for i in (0, 1)]
                t = [sum(g["teacher"][i] for g in gaps) for i in (0, 1)]
                info["loss_student_states"] = s[0] / max(s[1], 1)
                info["loss_teacher_states"] = t[0] / max(t[1], 1)
                # of adapter version r - 1 (the one that rolled in): Eq. 5 on its own states minus on the teacher's
                info["exposure_gap"] = info["loss_student_states"] - info["loss_teacher_states"]
                info["gap_adapter_version"] = r - 1
                info["gap_prompts"] = sum(g["prompts"] for g in gaps)
        self._mark(r, "records", **info)
        return info

    def replay_pool(self, r: int) -> tuple[list[TrajectoryRecord], list[str]]:
        """The teacher's records and those of rounds max(1, r - replay_window) .. r - 1."""
        recs, where = _read_records(self.records_of(0))
        for k in range(max(1, r - self.cfg.replay_window), r):
            more, w = _read_records(self.records_of(k))
            recs += more
            where += w
        return recs, where

    def phase_mix(self, r: int) -> dict:
        c = self.cfg
        current, where_c = _read_records(self.records_of(r))
        replay, where_r = self.replay_pool(r)
        n_cur, n_rep = mix_counts(c.mix_lambda, c.size())
        # adapter r-1 is the one this mix trains (into version r)
        check_staleness(current, where_c, r - 1, c.staleness)
        check_staleness(replay, where_r, r - 1, c.staleness)
        mix = mix_records(current, replay if n_rep else [], c.mix_lambda, c.size(), c.seed * 7919 + r,
                          where=f"round {r} mix")  # fmt: skip
        final = round_dir(self.out, r) / "mix"
        tmp = final.with_name("mix.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        for i in range(0, len(mix), c.shard_size):
            write_parquet(mix[i : i + c.shard_size], tmp / shard_name(i // c.shard_size))
            if i == 0:
                _maybe_kill(r, "mix")
        counts = {"current": n_cur, "replay": n_rep, "lambda": c.mix_lambda, "size": c.size(),
                  "replay_rounds": list(range(max(1, r - c.replay_window), r)), "staleness": c.staleness}  # fmt: skip
        write_manifest(tmp, mix[0].backbone_id, {"onpolicy_mix": counts, "round": r})
        os.replace(tmp, final)
        self._mark(r, "mix", mix=counts)
        return counts

    def train_command(self, r: int) -> list[str]:
        c = self.cfg
        train = round_dir(self.out, r) / "train"
        cmd = launcher_command_with_port(c.launcher)
        cmd += [str(REPO / "launcher" / "train.py"), "--ds", c.ds, "--config", c.train_config, "--output-dir",
                str(train), *training_resume_args(train), *c.train_overrides,
                f"data.trajectories={self.records_of(r) if r == 0 else round_dir(self.out, r) / 'mix'}",
                f"train.seed={c.seed}", f"wandb.project={c.wandb_project}", f"wandb.group={self.group}",
                f"wandb.name=round-{r}", f"wandb.tags=[round:{r},adapter_version:{r}]",
                "wandb.constants=" + json.dumps({"onpolicy/round": r, "onpolicy/adapter_version": r})]  # fmt: skip
        if r >= 1:
            cmd += [f"model.init_adapter={self.adapter_of(r - 1)}", f"train.max_steps={c.updates_per_round}",
                    *c.round_overrides]
        if c.wandb_mode:
            cmd.append(f"wandb.mode={c.wandb_mode}")
        return cmd

    def phase_train(self, r: int) -> dict:
        train = round_dir(self.out, r) / "train"
        cmd = self.train_command(r)
        logf = round_dir(self.out, r) / "train.log"
        if os.environ.get(KILL_ENV) == f"{r}:train":
            _kill_after_checkpoint(cmd, logf, train / "checkpoints")
        rc = run_teed(cmd, logf)
        if rc != 0:
            raise TDLMError(f"round {r} training failed: {failure_reason(round_dir(self.out, r) / 'train.log', rc)}")
        summary = json.loads((train / "summary.json").read_text())
        info = {"train_loss": summary.get("final_loss"), "train_steps": summary.get("steps")}
        self._mark(r, "train", **info)
        return info

    def phase_sync(self, r: int) -> dict:
        """Adapter version r: the export's folder (ZeRO-3 partitions gathered by the training launch) copied under
        the round, with version.json. Actors of the next round load it from there; no backbone tensor moves."""
        dest = round_dir(self.out, r) / "adapter"
        if r == 0 and self.cfg.round0_adapter:
            src = Path(self.cfg.round0_adapter)
            info = {"adapter_version": 0, "adapter_sha256": sha256_of(src / ADAPTER_WEIGHTS), "adapter": str(src)}
            self._mark(r, "sync", **info)
            return info
        src = round_dir(self.out, r) / "train" / "adapter"
        tmp = dest.with_name("adapter.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        _maybe_kill(r, "sync")
        info = {"adapter_version": r, "round": r, "adapter_sha256": sha256_of(tmp / ADAPTER_WEIGHTS)}
        atomic_write_json(tmp / "version.json", info)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        self._mark(r, "sync", **info)
        return info

    # driver -----------------------------------------------------------------------------------------
    def _tracker(self):
        from tdlm.tracking.runs import Tracker

        if self.tracker is None:
            job_dir = self.out / "job"
            from tdlm.tracking.runs import previous_run_id

            self.tracker = Tracker(job_dir, self.cfg.wandb_project, self.group, "onpolicy", to_dict(self.cfg),
                                   self.cfg.wandb_mode, job_type="onpolicy", tags=["onpolicy"],
                                   resume_id=previous_run_id(job_dir))  # fmt: skip
        return self.tracker

    def run_round(self, r: int) -> dict:
        t0 = time.monotonic()
        for phase in PHASES:
            if r == 0 and phase == "mix":
                continue
            if self.done(r, phase):
                continue
            if r == 0 and phase == "prompts" and self.cfg.round0_trajectories:
                self._mark(0, "prompts", prompts=0)
                continue
            if r == 0 and phase == "records" and self.cfg.round0_trajectories:
                verify_manifest(self.records_of(0))
                self._mark(0, "records")
                continue
            if r == 0 and phase == "train" and self.cfg.round0_adapter:
                self._mark(0, "train")
                continue
            log.info("round %d: %s", r, phase)
            getattr(self, f"phase_{phase}")(r)
        entry = self.state["rounds"][str(r)]
        if not entry.get("logged"):
            point = {f"onpolicy/{k}": v for k, v in entry.items() if isinstance(v, int | float) and k != "round"}
            point |= {"onpolicy/round": r, "onpolicy/adapter_version": r}
            mix = entry.get("mix") or {}
            point |= {f"onpolicy/mix_{k}": v for k, v in mix.items() if isinstance(v, int | float)}
            self._tracker().log(point, r)
            entry["logged"] = True
            entry["seconds"] = entry.get("seconds", 0.0) + time.monotonic() - t0
            self._save()
        return entry

    def run_all(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        with FolderLock(self.out, what="on-policy job"):
            self._save()
            for r in range(self.cfg.rounds + 1):
                self.run_round(r)
            if self.tracker is not None:
                self.tracker.finish({"rounds": self.cfg.rounds})
        return self.state


def _kill_after_checkpoint(cmd: list[str], log_path: Path, ckpt: Path) -> None:
    """Test fault injection: run the launch until its first checkpoint is listed, then kill its whole process group
    and this job (exit 137), as a lost node leaves them."""
    import signal
    import subprocess

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None and not (ckpt / "latest").exists():
            time.sleep(0.1)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.warning("TEST FAULT INJECTION: killed in the train phase")
    sys.stdout.flush()
    os._exit(137)


def launcher_command_with_port(launcher: list[str]) -> list[str]:
    """``launcher`` resolved (:func:`tdlm.sweep.trial.launcher_command`), with a free ``--master_port`` for
    ``deepspeed`` (its default 29500 is taken by any other training on the node)."""
    from types import SimpleNamespace

    cmd = launcher_command(SimpleNamespace(launcher=launcher))
    if Path(cmd[0]).name == "deepspeed" and "--master_port" not in cmd:
        cmd += ["--master_port", str(free_port())]
    return cmd


def load_job_config(path: str | None, overrides: dict) -> tuple[OnPolicyConfig, str]:
    from tdlm.config import from_dict, nest_flags

    raw = nest_flags(load_yaml(path) if path else {}, overrides)
    where = (f"{path} with the command line's flags" if overrides else path) if path else "arguments"
    return from_dict(OnPolicyConfig, raw, where), where
