"""First contact: each plausible mistake is one line that names the file / flag / key (with the nearest valid one),
found before expensive work; no silent JIT build or endless wait on a stale build lock; one schema for eval/run.py's
flags; plots people can read."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from tdlm.config import Flag
from tdlm.errors import TDLMError
from tdlm.training.config import RunConfig
from tdlm.training.ds_config import load_ds_json, resolve_ds_config

REPO = Path(__file__).resolve().parents[1]
Z3 = REPO / "ds_configs" / "zero3.json"


# -- 1. DeepSpeed's own config model checks the DS JSON ---------------------------------------------------------
@pytest.mark.parametrize("mutate,pattern", [
    (lambda d: d.update(zero_optimisation=d.pop("zero_optimization")),
     r"unknown DeepSpeed key 'zero_optimisation'; did you mean 'zero_optimization'\?"),
    (lambda d: d["zero_optimization"].update(stgae=3),
     r"unknown DeepSpeed key 'zero_optimization.stgae'; did you mean 'stage'\?"),
    (lambda d: d["zero_optimization"].update(offload_optimizer={"devcie": "cpu"}),
     r"unknown DeepSpeed key 'zero_optimization.offload_optimizer.devcie'; did you mean 'device'\?"),
    (lambda d: d["zero_optimization"].update(offload_optimizer={"device": "gpu"}),
     r"zero_optimization.offload_optimizer.device: Input should be 'none', 'cpu' or 'nvme'; got 'gpu'"),
    (lambda d: d["bf16"].update(enabeld=True), r"unknown DeepSpeed key 'bf16.enabeld'; did you mean 'enabled'\?"),
    (lambda d: d["activation_checkpointing"].update(partition_activation=True),
     r"unknown DeepSpeed key 'activation_checkpointing.partition_activation'; did you mean 'partition_activations'\?"),
    (lambda d: d.update(gradient_clippin=1.0),
     r"unknown DeepSpeed key 'gradient_clippin'; did you mean 'gradient_clipping'\?"),
    (lambda d: d.update(train_micro_batch_size_per_gpu="atuo"),
     r"train_micro_batch_size_per_gpu must be a value or \"auto\"; got 'atuo' \(did you mean \"auto\"\?\)"),
    (lambda d: d["optimizer"]["params"].update(lr="atuo"), r"optimizer.params.lr must be a value or \"auto\""),
    (lambda d: d["bf16"].update(enabled="atuo"), r"bf16.enabled must be .*got 'atuo' \(did you mean \"auto\"\?\)"),
    (lambda d: d["zero_optimization"].update(overlap_comm="maybe"),
     r"zero_optimization.overlap_comm: Input should be a valid boolean"),
])
def test_ds_json_mistakes_are_one_line_naming_file_and_key(mutate, pattern):
    raw = load_ds_json(Z3)
    mutate(raw)
    with pytest.raises(TDLMError, match=r"^my_ds\.json: " + pattern) as e:
        resolve_ds_config(raw, RunConfig(), 2, False, where="my_ds.json")
    assert "\n" not in str(e.value)


def test_ds_values_are_still_cross_checked_and_the_shipped_files_pass():
    for name in ("zero2.json", "zero3.json", "zero3_offload.json"):
        resolve_ds_config(load_ds_json(REPO / "ds_configs" / name), RunConfig(), 2, False, where=name)
    raw = load_ds_json(Z3)
    raw["gradient_accumulation_steps"] = 7
    with pytest.raises(TDLMError, match=r"gradient_accumulation_steps=7 contradicts the run config"):
        resolve_ds_config(raw, RunConfig(), 2, False)


def test_the_ds_key_list_comes_from_deepspeed_itself():
    from tdlm.training.ds_config import deepspeed_top_level_keys

    keys = deepspeed_top_level_keys()
    assert {"zero_optimization", "bf16", "optimizer", "gradient_clipping", "wandb", "compile"} <= keys
    assert "zero_optimisation" not in keys


def test_launcher_refuses_a_ds_typo_in_one_line_before_any_process_group(tmp_path):
    raw = load_ds_json(Z3)
    raw["zero_optimisation"] = raw.pop("zero_optimization")
    bad = tmp_path / "typo.json"
    bad.write_text(json.dumps(raw))
    env = os.environ | {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, str(REPO / "launcher" / "train.py"), "--ds", str(bad),
                           "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {bad}: unknown DeepSpeed key 'zero_optimisation'; did you mean 'zero_optimization'?"]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


# -- 2. JIT ops: never a silent build, never a silent wait on a stale lock ----------------------------------------
@pytest.fixture()
def ext_dir(tmp_path, monkeypatch):
    d = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(d))
    return d


def test_cpu_default_needs_no_jit_op(ext_dir, monkeypatch):
    import deepspeed.ops

    from tdlm.training.ds_config import SHM_OP, prepare_jit_ops

    monkeypatch.delenv("TDLM_CPU_SHM_COMM", raising=False)
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, SHM_OP, True)  # restored after the test
    cfg = resolve_ds_config(load_ds_json(Z3), RunConfig(), 2, False)
    assert prepare_jit_ops(cfg, on_gpu=False) == []
    # DeepSpeed's TorchBackend builds the op only when its probe says compatible (deepspeed/comm/torch.py)
    assert deepspeed.ops.__compatible_ops__[SHM_OP] is False
    assert not ext_dir.exists()


def test_an_opted_in_build_is_announced_before_it_starts(ext_dir, monkeypatch, capsys):
    from tdlm.training.ds_config import SHM_OP, prepare_jit_ops

    monkeypatch.setenv("TDLM_CPU_SHM_COMM", "1")
    cfg = resolve_ds_config(load_ds_json(Z3), RunConfig(), 2, False)
    assert prepare_jit_ops(cfg, on_gpu=False) == [SHM_OP]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"note: DeepSpeed will now JIT-compile its {SHM_OP} op")
    assert "TDLM_CPU_SHM_COMM=1" in err[0] and "min" in err[0] and str(ext_dir / SHM_OP) in err[0]


def test_offload_announces_cpu_adam(ext_dir, capsys):
    from tdlm.training.ds_config import prepare_jit_ops

    cfg = resolve_ds_config(load_ds_json(REPO / "ds_configs" / "zero3_offload.json"), RunConfig(), 2, False)
    assert prepare_jit_ops(cfg, on_gpu=False) == ["cpu_adam"]
    assert "JIT-compile its cpu_adam op (zero_optimization.offload_optimizer" in capsys.readouterr().err


def test_a_planted_stale_lock_is_named(ext_dir, monkeypatch):
    from tdlm.training.ds_config import SHM_OP, check_jit_op

    lock = ext_dir / SHM_OP / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()  # what an interrupted build leaves behind: torch's loader would wait on it forever
    with pytest.raises(TDLMError, match=rf"^{lock}: a stale lock left by an interrupted build .* remove it "
                                        rf"\(rm {lock}\) and launch again$"):
        check_jit_op(SHM_OP)


def test_a_lock_with_a_live_build_is_waited_for_with_a_word(ext_dir, capsys):
    from tdlm.training.ds_config import SHM_OP, check_jit_op

    folder = ext_dir / SHM_OP
    folder.mkdir(parents=True)
    (folder / "lock").touch()
    builder = subprocess.Popen(["sleep", "30"], cwd=folder)  # stands for ninja, which runs in the build folder
    try:
        for _ in range(50):  # the child's cwd is visible in /proc once it has started
            if Path(f"/proc/{builder.pid}/cwd").exists():
                break
            time.sleep(0.05)
        check_jit_op(SHM_OP)
    finally:
        builder.kill()
        builder.wait()
    assert f"note: waiting for process {builder.pid}, which is building" in capsys.readouterr().err


# -- 4. overrides name the override; unknown keys get "did you mean" ----------------------------------------------
def test_launch_override_mistakes_name_the_override_not_the_file():
    from tdlm.training.launch import parse_launch

    base = ["--ds", str(Z3), "--config", str(REPO / "configs" / "tiny.yaml")]
    with pytest.raises(TDLMError, match=r"^override 'train.max_stpes=3': unknown key 'train.max_stpes'; "
                                        r"did you mean 'train.max_steps'\?$"):
        parse_launch([*base, "train.max_stpes=3"])
    with pytest.raises(TDLMError, match=r"^override 'train.max_steps=many': expected an integer; got 'many'$"):
        parse_launch([*base, "train.max_steps=many"])
    with pytest.raises(TDLMError, match=r"^override 'trian.seed=1': unknown key 'trian'; did you mean 'train'\?$"):
        parse_launch([*base, "trian.seed=1"])


def test_yaml_mistakes_read_as_file_colon_section_key(tmp_path):
    """Issue 30: ``run.yaml.train: unknown key(s)`` read like a file name; now ``run.yaml: train.key``."""
    from tdlm.config import apply_overrides, from_dict, load_config, load_yaml

    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_stesp: 3\n")
    with pytest.raises(TDLMError, match=rf"^{path}: unknown key\(s\) \['train.max_stesp'\]; allowed in train: "
                                        r".*; did you mean 'train.max_steps'\?$"):
        load_config(RunConfig, path)
    path.write_text("optim:\n  lr: fast\nmodel:\n  layers: [1, x]\n")
    with pytest.raises(TDLMError, match=rf"^{path}: optim.lr: expected a number; got 'fast'$"):
        load_config(RunConfig, path)
    path.write_text("train:\n  max_steps: 3\n")
    raw = apply_overrides(load_yaml(path), ["train.max_steps=many"])
    with pytest.raises(TDLMError, match=r"^override 'train.max_steps=many': expected an integer; got 'many'$"):
        from_dict(RunConfig, raw, str(path))  # the file is fine: the override is blamed
    raw = apply_overrides(load_yaml(path), ["optim={lr: fast}"])
    with pytest.raises(TDLMError, match=r"^override 'optim=\{lr: fast\}': optim.lr: expected a number; got 'fast'$"):
        from_dict(RunConfig, raw, str(path))
    path.write_text("train:\n  max_steps: lots\n")
    with pytest.raises(TDLMError, match=rf"^{path}: train.max_steps: expected an integer; got 'lots'$"):
        from_dict(RunConfig, apply_overrides(load_yaml(path), ["train.seed=1"]), str(path))  # the file's own


# -- 7. one schema: eval/run.py's flags are generated from EvalConfig ---------------------------------------------
def _eval_run():
    sys.path.insert(0, str(REPO / "eval"))
    import importlib

    return importlib.import_module("run")


def _assert_flags_match_fields(cls, parser, flags):
    """Every field of ``cls`` has exactly one flag whose help starts with the field's comment, and vice versa; a
    section's fields (``decode``: a dataclass) each have one as ``section.field``, unless its flag is skipped."""
    from tdlm.config import field_docs

    dests = {a.dest for a in parser._actions if a.dest not in ("help", "config")}
    fields, docs = set(), {}
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            every = {f"{f.name}.{g.name}" for g in dataclasses.fields(tp)}
            assert {k for k in flags if k.startswith(f"{f.name}.")} <= every
            fields |= {k for k in every if not flags.get(k, Flag()).skip}
            docs |= {f"{f.name}.{k}": v for k, v in field_docs(tp).items()}
        else:
            fields.add(f.name)
            docs[f.name] = field_docs(cls).get(f.name)
    assert dests == fields
    assert set(flags) - fields <= {k for k, v in flags.items() if v.skip}  # no flag for a field that is gone
    for a in parser._actions:
        if a.dest in fields:
            assert docs.get(a.dest), f"{cls.__name__}.{a.dest} has no comment: its flag would have no help"
            assert a.help.startswith(docs[a.dest][:30]) or a.help.startswith("turn off: "), a.dest


def test_every_eval_config_field_has_a_flag_with_its_doc_and_vice_versa():
    from tdlm.evaluation import EvalConfig

    run = _eval_run()
    _assert_flags_match_fields(EvalConfig, run.build_parser(), run.FLAGS)


def _generation_cli():
    import importlib

    return importlib.import_module("tdlm.generation.cli")  # ray_jobs/generate_trajectories.py and tdlm-generate


def test_every_generation_config_field_has_a_flag_with_its_doc_and_vice_versa():
    from tdlm.generation import GenerationConfig

    cli = _generation_cli()
    _assert_flags_match_fields(GenerationConfig, cli.build_parser(), cli.FLAGS)


def test_generation_flags_people_use_keep_working(tmp_path, capsys):
    cli = _generation_cli()
    cfg = cli.parse_args(["--backbone", "tiny-llada", "--prompts", "p.jsonl", "--output-dir", "o", "--tau", "0.8",
                          "--no-chat", "--allow-eval-prompts", "--num-prompts", "64", "--gen-length", "32",
                          "--block-size", "8", "--shard-size", "16", "--cache", "dual", "--compile", "true"])
    d = cfg.decode
    assert d.threshold == 0.8 and cfg.chat is False and cfg.allow_eval_prompts is True and d.cache == "dual"
    assert cfg.num_prompts == 64 and cfg.shard_size == 16 and d.compile is True
    yaml_file = tmp_path / "gen.yaml"
    yaml_file.write_text("backbone: tiny-llada\nprompts: p.jsonl\noutput_dir: o\ndecode: {batch_size: 4}\n")
    cfg = cli.parse_args(["--config", str(yaml_file), "--batch-size", "2"])
    assert cfg.decode.batch_size == 2 and cfg.decode.gen_length == 256  # flags override the file
    with pytest.raises(SystemExit):
        cli.parse_args(["--backbone", "b", "--prompts", "p", "--output-dir", "o", "--polcy", "tdlm"])
    assert "(did you mean --policy?)" in capsys.readouterr().err


def test_the_flag_names_people_use_keep_working():
    run = _eval_run()
    cfg = run.parse_args([
        "--backbone", "tiny-llada", "--output-dir", "o", "--tasks", "gsm8k", "mbpp", "--limit", "6",
        "--gen-length", "32", "--block-size", "8", "--data-dir", "d", "--adapter", "a=x", "--adapter", "y",
        "--policies", "original", "threshold", "tdlm", "--thresholds", "0.5", "0.9", "--tdlm-thresholds", "0.95",
        "--entropy-thresholds", "0.4", "--history", "full", "last:1", "--cache", "none", "dual",
        "--cache-policies", "threshold", "--no-chat", "--dtype", "float32", "--batch-size", "4", "--warmup", "0",
        "--workers", "2", "--threads", "1", "--group", "g", "--project", "p", "--tags", "t1", "--wandb-mode",
        "offline", "--stop-at-eos", "--allow-other-backbone", "--reference-tau", "0.8", "--score-workers", "1",
        "--code-timeout-s", "5", "--code-cpu-s", "3", "--max-restarts", "0", "--max-task-retries", "0",
        "--max-shard-attempts", "1", "--allow-weak-sandbox", "--device", "cpu"])
    assert cfg.adapters == ["a=x", "y"] and cfg.chat is False and cfg.decode.stop_at_eos is True
    assert cfg.thresholds == [0.5, 0.9] and cfg.histories == ["full", "last:1"] and cfg.caches == ["none", "dual"]
    assert cfg.limit == 6 and cfg.code_timeout_s == 5.0 and cfg.allow_weak_sandbox is True


def test_eval_flag_mistakes_get_did_you_mean(capsys):
    run = _eval_run()
    with pytest.raises(SystemExit):
        run.parse_args(["--backbone", "b", "--output-dir", "o", "--tasks", "gsm8"])
    assert "invalid choice 'gsm8' (choose from gsm8k" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run.parse_args(["--backbone", "b", "--output-dir", "o", "--tresholds", "0.9"])
    assert "--tresholds (did you mean --thresholds?)" in capsys.readouterr().err


def test_an_eval_yaml_typo_names_the_file_and_the_field(tmp_path):
    run = _eval_run()
    path = tmp_path / "eval.yaml"
    path.write_text("backbone: tiny-llada\noutput_dir: o\ntresholds: [0.9]\n")
    with pytest.raises(TDLMError, match=rf"^{path}: unknown key\(s\) \['tresholds'\].*; did you mean 'thresholds'\?$"):
        run.parse_args(["--config", str(path)])


# -- 6. plots -----------------------------------------------------------------------------------------------------
def _runs(close: bool = True) -> list[dict]:
    runs = [dict(policy="original", threshold=None, accuracy=0.64, n=500, nfe_mean=56.0, seconds_mean=0.9)]
    for tau, acc, nfe in ((0.95, 0.66, 33.1), (0.9, 0.655, 32.6), (0.8, 0.55, 20.2), (0.7, 0.47, 14.8)):
        runs.append(dict(policy="threshold", threshold=tau, accuracy=acc, n=500, nfe_mean=nfe, seconds_mean=nfe / 60))
    for tau, acc, nfe in ((0.99, 0.61, 25.6), (0.95, 0.594, 21.2), (0.9, 0.558, 17.4), (0.8, 0.504, 11.5)):
        runs.append(dict(policy="tdlm", threshold=tau, accuracy=acc, n=500, nfe_mean=nfe, seconds_mean=nfe / 55,
                         adapter_label="demo", history="full"))
    return runs


def _label_boxes(fig) -> list:
    renderer = fig.canvas.get_renderer()
    out = []
    for ax in fig.axes:
        out.append([t.get_window_extent(renderer) for t in ax.texts])
    return out


def test_pareto_plot_log_nfe_axis_error_bars_and_labels_that_do_not_overlap(tmp_path):
    import math

    import matplotlib.pyplot as plt

    from tdlm.evaluation.plot import _overlaps, accuracy_se, pareto_figure, plot_pareto

    runs = _runs()
    fig = pareto_figure(runs, "check")
    try:
        nfe_ax = fig.axes[1]
        assert nfe_ax.get_xscale() == "log" and fig.axes[0].get_xscale() == "log"
        bars = [c for c in nfe_ax.containers if c.__class__.__name__ == "ErrorbarContainer"]
        assert len(bars) == 3  # original, Fast-dLLM, TDLM
        seg = bars[1].lines[2][0].get_segments()  # the threshold family's vertical bars, by NFE
        half = sorted(abs(s[1][1] - s[0][1]) / 2 for s in seg)
        want = sorted(100 * math.sqrt(r["accuracy"] * (1 - r["accuracy"]) / r["n"]) for r in runs
                      if r["policy"] == "threshold")
        assert half == pytest.approx(want)
        assert accuracy_se({"accuracy": 0.5, "n": 100, "accuracy_se": 0.01}) == 0.01
        for boxes in _label_boxes(fig):
            assert len(boxes) == 8  # every tau labelled (tau 0.9 and 0.95 of threshold sit 0.5 NFE apart)
            for i, a in enumerate(boxes):
                for b in boxes[i + 1:]:
                    assert not _overlaps(a, b, pad=0.0), "two tau labels overlap"
    finally:
        plt.close(fig)
    assert plot_pareto(runs, tmp_path / "p.png").stat().st_size > 10_000


# -- 5. tracking: group = the experiment; grid points carry task / policy / tau / cache / history tags ------------
def test_experiment_group_is_explicit_or_config_stem_and_hash():
    from tdlm.tracking import experiment_group

    a = experiment_group(None, "configs/tiny_multi.yaml", {"lr": 1e-3})
    assert a.startswith("tiny_multi-") and len(a) == len("tiny_multi-") + 8
    assert experiment_group(None, "configs/tiny_multi.yaml", {"lr": 1e-3}) == a  # stable
    assert experiment_group(None, "configs/tiny_multi.yaml", {"lr": 2e-3}) != a  # another experiment
    assert experiment_group(None, "run config", {}).startswith("defaults-")
    assert experiment_group("table4", "configs/tiny_multi.yaml", {}) == "table4"


def test_an_evaluation_run_is_tagged_with_its_grid_point(tmp_path, monkeypatch):
    from tdlm.evaluation import EvalConfig
    from tdlm.evaluation.driver import log_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    run_dir = tmp_path / "runs" / "multi" / "threshold-tau0.9-dual"
    summary = {"run_dir": str(run_dir), "task": "multi", "name": "threshold-tau0.9-dual", "backbone": "tiny-multi",
               "backbone_id": "tiny-multi", "policy": "threshold", "threshold": 0.9, "entropy_threshold": None,
               "history": None, "cache": "dual", "allocation": None, "accuracy": 0.5, "n": 2, "nfe_mean": 9.0}
    log_run(EvalConfig(backbone="tiny-multi", output_dir=str(tmp_path)), "demo", summary, [])
    record = json.loads((run_dir / "wandb_run.json").read_text())
    assert record["group"] == "demo" and record["job_type"] == "eval"
    assert {"task:multi", "policy:threshold", "tau:0.9", "cache:dual", "backbone:tiny-multi"} <= set(record["tags"])


# -- 4. an adapter of another backbone is refused before any baseline is decoded ---------------------------------
def test_a_foreign_adapter_is_refused_before_the_first_decode(tmp_path):
    import tdlm
    from tdlm.decoding.config import DecodeSettings
    from tdlm.evaluation import EvalConfig, evaluate
    from tdlm.evaluation.driver import check_adapters_fit

    model = tdlm.TDLM(tdlm.load_backbone("tiny-llada"), tdlm.TemporalConfig(layers="dispersed:2", heads=2,
                                                                            head_dim=16))
    adapter = tmp_path / "llada-adapter"
    model.save_adapter(adapter)
    cfg = EvalConfig(backbone="tiny-dream", output_dir=str(tmp_path / "out"), tasks=["arith"], limit=2,
                     policies=["original", "threshold", "tdlm"], adapters=[str(adapter)],
                     decode=DecodeSettings(gen_length=16, block_size=8), workers=1, wandb_mode="disabled")
    with pytest.raises(TDLMError, match=r"adapter 'llada-adapter' was trained on backbone 'tiny-llada', not "
                                        r"--backbone tiny-dream: family='llada' \(this backbone: 'dream'\).*nothing "
                                        r"was decoded; pass --allow-other-backbone"):
        evaluate(cfg)
    assert not list((tmp_path / "out").rglob("*.jsonl"))  # no baseline sample was decoded
    check_adapters_fit(dataclasses.replace(cfg, allow_other_backbone=True))  # the explicit override passes
    check_adapters_fit(dataclasses.replace(cfg, backbone="tiny-llada"))  # its own backbone passes


# -- issue 30: the planner's flags are parsed first and a mistake is one line with "did you mean" ----------------
def test_planner_flag_mistake_is_one_line_with_did_you_mean_before_any_heavy_import(monkeypatch, capsys):
    """``--gpu-memory 80`` printed 22 lines of usage and no hint, after 43 s of imports. The parse now comes before
    torch and the planner's model are imported: with them made unimportable the mistake is still reported."""
    from tdlm.training.planner import cli

    for name in ("torch", "tdlm.training.planner.model", "tdlm.training.planner.measure"):
        monkeypatch.setitem(sys.modules, name, None)  # `import x` now raises ImportError
    with pytest.raises(SystemExit) as e:
        cli.main(["--gpu-memory", "80"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err == ("error: unrecognized arguments: --gpu-memory (did you mean --gpu-mem?) 80; see python -m "
                   "tdlm.training.planner --help\n")
    with pytest.raises(SystemExit):
        cli.main(["--dtype", "bf61"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice 'bf61' (choose from bf16, fp32); did you mean 'bf16'?" in err


def test_the_package_facades_are_lazy_so_a_cli_mistake_costs_no_torch_import():
    """``python -m tdlm.training.planner`` with a wrong flag, in a fresh interpreter: the one line comes without
    torch or DeepSpeed ever being imported (the facades ``tdlm``, ``tdlm.training``, ``tdlm.training.planner``
    resolve names on first use), and the facade's names still resolve."""
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['planner', '--gpu-memory', '80']\n"
        "try:\n    runpy.run_module('tdlm.training.planner', run_name='__main__')\n"
        "except SystemExit as e:\n    code = e.code\n"
        "heavy = sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules)\n"
        "import tdlm, tdlm.training, tdlm.training.planner as pl\n"
        "ok = callable(tdlm.decode) and tdlm.tokenizer.__name__ == 'tdlm.data.tokenizer' and callable(pl.plan)\n"
        "print('RESULT', code, heavy, ok, 'decode' in dir(tdlm))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "did you mean --gpu-mem?" in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "RESULT 2 [] True True", out.stdout


def test_planner_flag_tables_mirror_the_modules():
    """cli.py lists presets, dtypes and DeepSpeed defaults as literals (no import before parsing); they must equal
    the values in the modules they mirror."""
    from tdlm.models.loading import PRESETS
    from tdlm.training.planner import cli
    from tdlm.training.planner.model import DTYPE_BYTES, DSKnobs

    assert cli.PRESET_NAMES == tuple(PRESETS) and cli.DTYPES == tuple(sorted(DTYPE_BYTES))
    assert cli.DS_DEFAULTS == {k: getattr(DSKnobs, k) for k in cli.DS_DEFAULTS}
    assert cli.main(["--backbone", "tiny-llada", "--json"]) == 0  # and the imports after the parse still work


def test_merge_advice_matches_where_the_duplicate_is(tmp_path):
    """Issue 30: the merge advised removing a stray shard file when the duplicates were inside one file."""
    from tdlm.evaluation.records import Appender, IncompleteResults, merge, shard_path

    run = tmp_path / "run"
    with Appender(shard_path(run, 0, 1)) as a:
        for i in (0, 1, 1):  # a second writer appended t/1 again to the same file
            a.write({"id": f"t/{i}", "index": i})
    with pytest.raises(IncompleteResults) as e:
        merge(run, ["t/0", "t/1"])
    msg = str(e.value)
    assert "1 duplicate: t/1 (twice in shard-000-of-001.jsonl)" in msg and "stray" not in msg, msg
    assert "shard-000-of-001.jsonl repeats a sample: run one evaluation per output dir at a time" in msg
    stray = tmp_path / "run2"
    with Appender(shard_path(stray, 0, 1)) as a:
        a.write({"id": "t/0", "index": 0})
    with Appender(shard_path(stray, 0, 2)) as a:
        a.write({"id": "t/0", "index": 0})
    with pytest.raises(IncompleteResults) as e:
        merge(stray, ["t/0"])
    msg = str(e.value)
    assert "remove the stray shard file shard-000-of-002.jsonl" in msg and "repeats a sample" not in msg, msg
