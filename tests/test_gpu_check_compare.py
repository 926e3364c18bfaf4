"""What the GPU check's nfe stage records (kernels and host time in the compiled region, CUDA-graph skips and
launches, the planted divergent rows, one-policy settings) and how bench/gpu_check_compare.py holds the rows to
true_shape.json's predictions: ratios within one scope and depth, each GPU to its own rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gpu_check_helpers import (
    gpu_check,
    gpu_check_common,
    gpu_check_compare,
    gpu_check_nfe,
    gpu_check_plan,
    gpu_check_stages,
)


def test_a_ratio_is_taken_within_one_compile_scope_and_depth(tmp_path):
    """The default run's rows: compile=True by block at full depth, compiled-static and reduce-overhead at the model
    scope and 4 layers. reduce-overhead / compiled-static pairs (same scope and depth; ms/NFE extrapolated x8 for the
    printed row, the ratio as measured); compiled-static / compiled does not (another scope and depth): no number,
    a reason."""
    def row(mode: str, ms: float, layers: int | None) -> dict:
        name = f"llada-8b/b1/none/{mode}" + (f"/{layers}L" if layers else "")
        return {"item": name, "model": "llada-8b", "batch": 1, "cache": "none", "mode": mode, "purpose": "speed",
                "scope": gpu_check_plan.compile_scope(mode), "threshold_ms_per_nfe": ms, "tdlm_ms_per_nfe": ms,
                **({"layers": layers, "full_layers": 32, "threshold_ms_per_nfe_full_depth": ms * 32 / layers,
                    "tdlm_ms_per_nfe_full_depth": ms * 32 / layers} if layers else {})}  # fmt: skip

    rows = [row("reduce-overhead", 1.0, 4), row("compiled-static", 1.5, 4), row("compiled", 9.0, None)]
    gpu_check_common.write_json(tmp_path / "gpu_nfe_dryrun.json", {"stage": "nfe", "status": "ok", "rows": rows})
    out = {r["what"]: r for r in gpu_check_compare.beside_predicted(tmp_path, True)["rows"]}
    ro = out["reduce-overhead/compiled-static llada-8b b1 none tdlm"]
    assert ro["measured"] == pytest.approx(1.0 / 1.5) and ro["pairs"][1] == "llada-8b/b1/none/compiled-static/4L"
    static = out["compiled-static/compiled llada-8b b1 none tdlm"]
    assert static["measured"] is None and static["pairs"][1] is None and "model scope" in static["unpaired"], static
    assert out["ms/NFE llada-8b b1 none reduce-overhead tdlm (at 4 of 32 layers, x8)"]["measured"] == 8.0
    doc = {"rows": [dict(r) for r in rows]}
    gpu_check_stages.nfe_summary(doc)  # the child's own ratios follow the same rule
    assert "tdlm_reduce_overhead_over_compiled_static" in doc["rows"][0]
    assert "tdlm_compiled_static_over_compiled" not in doc["rows"][1]


def test_a_reduce_overhead_row_is_compared_with_its_prediction_and_its_compile_true_setting(tmp_path):
    """reduce-overhead is held to compile=True on the same static plan (CUDA graphs alone), never to the dynamic
    compile=True (which would mix in the storage plan); static / dynamic is its own ratio."""
    rows = [{"item": f"llada-8b/b8/dual/{mode}", "model": "llada-8b", "batch": 8, "cache": "dual", "mode": mode,
             "purpose": "speed", "threshold_ms_per_nfe": ms, "tdlm_ms_per_nfe": ms * 1.02}
            for mode, ms in (("compiled", 9.0), ("reduce-overhead", 6.3), ("compiled-static", 8.0))]  # fmt: skip
    gpu_check_common.write_json(tmp_path / "gpu_nfe_dryrun.json", {"stage": "nfe", "status": "ok", "rows": rows})
    from gpu_check_compare import beside_predicted

    out = {r["what"]: r for r in beside_predicted(tmp_path, True)["rows"]}
    real = json.loads(gpu_check_common.PREDICTION.read_text())
    pred = {(r["setting"], r["policy"]): r for r in real["reduce_overhead"]["rows"] if r["gpu"] == "h200"}  # dry run
    for policy in ("threshold", "tdlm"):
        p = pred[("llada-8b/b8/dual/reduce-overhead", policy)]
        ms = out[f"ms/NFE llada-8b b8 dual reduce-overhead {policy}"]
        assert ms["predicted"] == p["reduce_overhead_ms_per_nfe"] and ms["measured"] == rows[1][f"{policy}_ms_per_nfe"]
        ratio = out[f"reduce-overhead/compiled-static llada-8b b8 dual {policy}"]
        assert ratio["measured"] == pytest.approx(6.3 / 8.0) and ratio["predicted"] == pytest.approx(p["ratio_added"])
        assert ratio["predicted_overlapped"] == pytest.approx(p["ratio_overlapped"])
        assert ratio["pairs"] == ["llada-8b/b8/dual/reduce-overhead", "llada-8b/b8/dual/compiled-static"]
        assert out[f"ms/NFE llada-8b b8 dual compiled-static {policy}"]["predicted"] == p["compile_true_ms_per_nfe"]
        static = out[f"compiled-static/compiled llada-8b b8 dual {policy}"]
        assert static["measured"] == pytest.approx(8.0 / 9.0) and static["predicted"] == p["static_over_dynamic"]
        assert static["pairs"] == ["llada-8b/b8/dual/compiled-static", "llada-8b/b8/dual/compiled"]
    assert not any(w.startswith("reduce-overhead/compiled ") for w in out)  # no ratio over the dynamic plan


def test_gpu_names_select_only_their_own_prediction_rows():
    assert gpu_check_common.gpu_kind("NVIDIA H200") == "h200"
    assert gpu_check_common.gpu_kind("NVIDIA GH200 480GB") == "gh200"
    assert gpu_check_common.gpu_kind("NVIDIA GH200 144G HBM3e") == "gh200"
    assert gpu_check_common.gpu_kind("NVIDIA H100 80GB HBM3") == "h100"  # the SXM part, as torch names it
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB", "", None):
        assert gpu_check_common.gpu_kind(other) is None, other
    pred = {
        "gpu_check": {"gpu": "h200", "rows": [
            {"model": "llada-8b", "batch": 1, "cache": "none", "threshold_ms_per_nfe": {"compiled": 7.0}},
            {"model": "llada-8b", "batch": 1, "cache": "dual", "gpu": "gh200",
             "threshold_ms_per_nfe": {"compiled": 9.0}},
            {"model": "llada-8b", "batch": 8, "cache": "dual", "gpu": "h100",
             "threshold_ms_per_nfe": {"compiled": 11.0}},
        ]},
        "nfe": {"llada-8b": {"per_nfe_ms": {"backbone|none": {"h200": {"eager": 17.0}, "gh200": {"eager": 18.0},
                                                              "h100": {"eager": 21.0}}},
                             "compiled_kernels": {"backbone": 418},
                             "launch_us_at_target_by_gpu": {"h200": {"none|launch": 3.7},
                                                            "h100": {"none|launch": 2.9}}}},
        "decode_memory": {"llada-8b": {"rows": [{"policy": "tdlm", "history": "full", "cache": "none", "batch": 8,
                                                 "peak": {"Total": 1}}]}},
        "launch_us": 5.0,
    }  # fmt: skip
    h200 = gpu_check_common.select_predictions(pred, gpu_check_common.gpu_kind("NVIDIA H200"))
    assert set(h200["gpu_check"]) == {("llada-8b", 1, "none")}
    assert h200["per_nfe"][("llada-8b", "backbone", "none")] == {"eager": 17.0}
    gh200 = gpu_check_common.select_predictions(pred, gpu_check_common.gpu_kind("NVIDIA GH200 480GB"))
    assert set(gh200["gpu_check"]) == {("llada-8b", 1, "dual")}  # never the H200 section's rows
    assert gh200["per_nfe"][("llada-8b", "backbone", "none")] == {"eager": 18.0}
    h100 = gpu_check_common.select_predictions(pred, gpu_check_common.gpu_kind("NVIDIA H100 80GB HBM3"))
    assert set(h100["gpu_check"]) == {("llada-8b", 8, "dual")}
    assert h100["per_nfe"][("llada-8b", "backbone", "none")] == {"eager": 21.0}
    assert h100["launch_us_at_target"]["llada-8b"] == {"none|launch": 2.9}
    # a GPU true_shape does not model: no time row, but every GPU-independent one (memory, kernels, launch cost)
    other = gpu_check_common.select_predictions(pred, gpu_check_common.gpu_kind("NVIDIA A100-SXM4-80GB"))
    assert other["gpu_check"] == {} and other["per_nfe"] == {} and other["launch_us_at_target"] == {}
    assert other["decode_memory"] == h200["decode_memory"] == {("llada-8b", "tdlm", "full", "none", 8):
                                                               pred["decode_memory"]["llada-8b"]["rows"][0]}
    assert other["kernels"] == {"llada-8b": {"backbone": 418}} and other["launch_us"] == 5.0
    real = json.loads(gpu_check_common.PREDICTION.read_text())  # today's file: rows of every GPU it models
    assert set(real["gpus"]) == set(gpu_check_common.GPU_KINDS)  # true_shape's GPUS, each a kind gpu_kind names
    n_settings = len({(r["model"], r["batch"], r["cache"]) for r in real["gpu_check"]["rows"]})
    for kind in gpu_check_common.GPU_KINDS:
        assert len(gpu_check_common.select_predictions(real, kind)["gpu_check"]) == n_settings, kind


def _stage_docs(out: Path, gpu_name: str) -> None:
    """The three stage JSONs a real run on ``gpu_name`` would leave (made-up measurements, real setting names)."""
    machine = {"name": gpu_name}
    write = gpu_check_common.write_json
    write(out / "gpu_train.json", {"stage": "train", "status": "ok", "machine": machine,
                                   "rows": [{"item": "all", "layers": "all", "measured": 40 * 2**30,
                                             "predicted": 41 * 2**30}]})  # fmt: skip
    write(out / "gpu_deepspeed.json", {"stage": "deepspeed", "status": "ok", "machine": machine,
                                       "rows": [{"item": "zero3", "layers": "dispersed:16",
                                                 "max_allocated": 30 * 2**30, "planner": {"total": 31 * 2**30}}]})
    speed = {"item": "llada-8b/b1/none/compiled", "model": "llada-8b", "batch": 1, "cache": "none",
             "mode": "compiled", "purpose": "speed", "threshold_ms_per_nfe": 8.0, "tdlm_ms_per_nfe": 8.3,
             "tdlm_launches": {"kernels_per_nfe_compiled": 480.0, "host_us_per_launch": 4.0}}  # fmt: skip
    memory = {"item": "llada-8b/b8/none/eager/gen256", "model": "llada-8b", "batch": 8, "cache": "none",
              "mode": "eager", "purpose": "memory", "gen_length": 256,
              "threshold_memory": {"decode_peak": 20 * 2**30}, "tdlm_memory": {"decode_peak": 22 * 2**30}}
    write(out / "gpu_nfe.json", {"stage": "nfe", "status": "ok", "machine": machine, "block_size": 32,
                                 "rows": [speed, memory]})  # fmt: skip


GPU_INDEPENDENT = ("train peak, llada-8b all, one process", "DeepSpeed peak, dispersed:16, ZeRO-3 one rank",
                   "decode peak llada-8b b8 none gen256 threshold", "decode peak llada-8b b8 none gen256 tdlm",
                   "kernels/NFE in compiled region llada-8b b1 none tdlm", "host µs/launch llada-8b b1 none tdlm")


def test_an_h100_is_held_to_the_h100_rows_and_any_gpu_to_the_gpu_independent_ones(tmp_path):
    """A run on an H100 prints the H100 time predictions (not the H200's), and every run, an unknown GPU's too,
    prints the memory, planner and kernel-count predictions, which do not depend on the GPU."""
    from gpu_check_compare import beside_predicted

    real = json.loads(gpu_check_common.PREDICTION.read_text())
    by_gpu = {r["gpu"]: r for r in real["gpu_check"]["rows"] if (r["model"], r["batch"], r["cache"]) ==
              ("llada-8b", 1, "none")}  # fmt: skip
    seen = {}
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"):
        out = tmp_path / name.split()[1]
        out.mkdir()
        _stage_docs(out, name)
        result = beside_predicted(out, False)
        seen[name] = rows = {r["what"]: r for r in result["rows"]}
        for what in GPU_INDEPENDENT:
            assert rows[what]["predicted"] and rows[what]["predicted"] > 0, (name, rows[what])
        assert rows["train peak, llada-8b all, one process"]["planner"] == 41.0
        assert rows["DeepSpeed peak, dispersed:16, ZeRO-3 one rank"]["predicted"] == 31.0
    h100, other = seen["NVIDIA H100 80GB HBM3"], seen["NVIDIA A100-SXM4-80GB"]
    ms = h100["ms/NFE llada-8b b1 none compiled tdlm"]
    h100_ms, h200_ms = (by_gpu[g]["tdlm_ms_per_nfe"]["compiled"] for g in ("h100", "h200"))
    assert ms["predicted"] == h100_ms > h200_ms  # less bandwidth than an H200
    assert ms["predicted_cuda_graphs"] == by_gpu["h100"]["tdlm_ms_per_nfe"]["cuda_graphs"]
    assert h100["host µs/launch llada-8b b1 none tdlm"]["holds_up_to_added"] is not None
    assert other["ms/NFE llada-8b b1 none compiled tdlm"]["predicted"] is None  # time rows need a modelled GPU
    assert other["host µs/launch llada-8b b1 none tdlm"]["holds_up_to_added"] is None
    for what in GPU_INDEPENDENT:  # the same predictions whichever GPU ran them
        assert other[what]["predicted"] == h100[what]["predicted"], what
    pvm = json.loads((tmp_path / "A100-SXM4-80GB" / "predicted_vs_measured.json").read_text())
    assert pvm["gpu_kind"] is None and "GPU-independent" in pvm["gpu_rows"]


def test_kernels_and_host_time_are_counted_inside_the_compiled_region_only():
    us = 1000  # ns
    ev = [  # (name, start_ns, duration_ns, on_device, correlation_id)
        ("Torch-Compiled Region: 0/0", 0, 100 * us, False, 1),
        ("cudaLaunchKernel", 10 * us, 2 * us, False, 11),
        ("cuLaunchKernel", 50 * us, 4 * us, False, 12),
        ("cudaMemcpyAsync", 60 * us, 1 * us, False, 13),
        ("cudaLaunchKernel", 150 * us, 2 * us, False, 14),  # the loop's own eager kernel, outside
        ("Torch-Compiled Region: 0/0", 200 * us, 100 * us, False, 2),
        ("cuLaunchKernelEx", 250 * us, 2 * us, False, 15),
        ("triton_poi_fused_0", 20 * us, 5 * us, True, 11),
        ("ampere_bf16_gemm", 60 * us, 9 * us, True, 12),
        ("Memcpy HtoD (Pageable -> Device)", 61 * us, 1 * us, True, 13),
        ("elementwise_kernel", 160 * us, 1 * us, True, 14),
        ("triton_red_fused_1", 260 * us, 3 * us, True, 15),
        ("cudaGraphLaunch", 320 * us, 3 * us, False, 16),  # a CUDA graph replayed: neither a kernel nor a launch
        ("cuGraphLaunch", 330 * us, 3 * us, False, 17),
    ]
    out = gpu_check_stages.region_counts(ev, evals=2)
    assert out["kernels_per_nfe_compiled"] == 1.5 and out["kernels_per_nfe_compiled_device"] == 1.5
    assert out["launches_outside_per_nfe"] == 0.5 and out["kernels_per_nfe_all"] == 2.0
    assert out["copies_in_region_per_nfe"] == 0.5 and out["regions_per_nfe"] == 1.0
    assert out["host_us_per_launch"] == 200 / 3  # the regions' host wall / the kernels launched inside them
    assert out["launch_api_us_mean"] == 8 / 3 and out["region_host_ms_per_nfe"] == 0.1
    assert out["graph_launches"] == 2 and out["graph_launches_per_nfe"] == 1.0


def test_a_decode_setting_records_inductors_cudagraph_skips_and_its_graph_launches(monkeypatch):
    """Every decode of a setting (the untimed one, the timed one, the profiled one) counts toward its
    ``<policy>_cudagraph_skips``; a reduce-overhead setting is profiled for its graph launches. A fake decode stands
    in for tdlm.decode and skips one graph per call, as inductor does when a graph cannot be captured."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters

    import tdlm

    monkeypatch.delenv(gpu_check.HOOKS_ENV, raising=False)
    ctx = gpu_check_stages.build_context("nfe", True)  # the toy backbone on the CPU
    calls = []

    def decode(target, req, **kw):
        calls.append(kw)
        counters["inductor"]["cudagraph_skips"] += 1
        return [SimpleNamespace(nfe=4) for _ in req]

    monkeypatch.setattr(tdlm, "decode", decode)
    monkeypatch.setitem(counters["inductor"], "cudagraph_skips", counters["inductor"]["cudagraph_skips"])
    row = gpu_check_stages.nfe_item(ctx, "llada-8b/b1/none/reduce-overhead/2L", lambda r: None)
    assert len(calls) == 6 and all(kw["storage"] == "static" for kw in calls)  # 2 policies x (warm-up, timed, profile)
    for policy in ("threshold", "tdlm"):
        assert row[f"{policy}_cudagraph_skips"] == 3, row
        assert row[f"{policy}_launches"]["graph_launches"] == 0  # a CPU replays no CUDA graph
        why = gpu_check_compare.cuda_graph_proof(row, policy)
        assert "skipped CUDA graphs 3 times" in why and "no cudaGraphLaunch" in why, why
    monkeypatch.setattr(tdlm, "decode", lambda target, req, **kw: [SimpleNamespace(nfe=4) for _ in req])
    row = gpu_check_stages.nfe_item(ctx, "llada-8b/b1/none/compiled-static/2L", lambda r: None)
    assert row["tdlm_cudagraph_skips"] == 0 and "tdlm_launches" not in row  # recorded for every mode


def test_a_reduce_overhead_number_is_a_cuda_graph_number_only_when_proven(tmp_path):
    """A reduce-overhead row whose decodes skipped a CUDA graph, or whose profile replayed none, is marked in the
    comparison as not a CUDA-graph number, its ratio too; one with no skip and graph launches is not marked."""
    from gpu_check_compare import beside_predicted

    def row(batch: int, mode: str, ms: float, skips: int | None = None, graphs: int | None = None) -> dict:
        r = {"item": f"llada-8b/b{batch}/dual/{mode}", "model": "llada-8b", "batch": batch, "cache": "dual",
             "mode": mode, "purpose": "speed", "threshold_ms_per_nfe": ms, "tdlm_ms_per_nfe": ms}  # fmt: skip
        for policy in ("threshold", "tdlm"):
            if skips is not None:
                r[f"{policy}_cudagraph_skips"] = skips
            if graphs is not None:
                r[f"{policy}_launches"] = {"graph_launches": graphs, "graph_launches_per_nfe": graphs / 64}
        return r

    rows = [row(1, "compiled-static", 5.0), row(1, "reduce-overhead", 4.0, skips=2, graphs=64),
            row(8, "compiled-static", 9.0), row(8, "reduce-overhead", 6.0, skips=0, graphs=64),
            row(8, "compiled", 8.5, skips=0)]  # fmt: skip
    gpu_check_common.write_json(tmp_path / "gpu_nfe_dryrun.json", {"stage": "nfe", "status": "ok", "rows": rows})
    out = {r["what"]: r for r in beside_predicted(tmp_path, True)["rows"]}
    for policy in ("threshold", "tdlm"):
        for what in (f"ms/NFE llada-8b b1 dual reduce-overhead {policy}",
                     f"reduce-overhead/compiled-static llada-8b b1 dual {policy}"):  # fmt: skip
            assert "skipped CUDA graphs 2 times" in out[what]["not_cuda_graphs"], out[what]
        for what in (f"ms/NFE llada-8b b8 dual reduce-overhead {policy}",
                     f"reduce-overhead/compiled-static llada-8b b8 dual {policy}"):  # fmt: skip
            assert out[what]["not_cuda_graphs"] is None, out[what]
        assert "not_cuda_graphs" not in out[f"ms/NFE llada-8b b8 dual compiled {policy}"]
    no_graph = row(8, "reduce-overhead", 6.0, skips=0, graphs=0)
    assert "no cudaGraphLaunch" in gpu_check_compare.cuda_graph_proof(no_graph, "tdlm")
    unrecorded = row(8, "reduce-overhead", 6.0, graphs=64)
    assert "not recorded" in gpu_check_compare.cuda_graph_proof(unrecorded, "tdlm")


def test_the_planted_head_row_makes_the_rows_finish_apart_and_is_put_back(monkeypatch):
    """The divergent-rows setting's plant on the toy backbone, decoded eagerly as the setting does (3 requests: the
    static plan's bucket 4, dual cache): request 0 finishes evaluations before the others, which finish together
    (one token per evaluation); without the plant every row finishes at the same evaluation; the head row is the
    same tensor, with the same values, afterwards."""
    import torch

    import tdlm

    monkeypatch.delenv(gpu_check.HOOKS_ENV, raising=False)
    ctx = gpu_check_stages.build_context("nfe", True)
    bb = ctx.backbone
    gen = torch.Generator().manual_seed(3008)
    rows = torch.randint(3, 500, (3, 8), generator=gen).tolist()
    req = [r[: 8 - (i * 8) // 6] for i, r in enumerate(rows)]  # left-padded, as nfe_item builds them
    kw = dict(policy="threshold", cache="dual", gen_length=16, block_size=8, threshold=0.9, storage="static")
    head = bb.model.transformer.ff_out.weight
    before, ptr = head.detach().clone(), head.data_ptr()
    plain = [r.nfe for r in tdlm.decode(bb, req, **kw)]
    assert len(set(plain)) == 1, plain  # random weights: lockstep
    with gpu_check_nfe.plant_divergence(bb, req, 16, ctx.device) as plant:
        planted = [r.nfe for r in tdlm.decode(bb, req, **kw)]
    assert planted[0] < min(planted[1:]) and planted[1:] == plain[1:], planted
    assert plant["peaked_request"] == 0 and abs(max(plant["other_requests_logit_at_mean"], key=abs)) < 1e-6, plant
    assert head.data_ptr() == ptr and torch.equal(head.detach(), before)  # put back in place: no graph re-recorded


def test_a_one_policy_setting_runs_and_is_compared_for_that_policy_only(tmp_path, monkeypatch):
    """The default set's pair runs tdlm only (its name ends in the policy): the setting decodes that policy alone,
    and the comparison pairs each policy with the row that ran it, even when another setting of the paired mode ran
    the other policy (the opt-in threshold twin)."""
    from types import SimpleNamespace

    import tdlm

    monkeypatch.delenv(gpu_check.HOOKS_ENV, raising=False)
    ctx = gpu_check_stages.build_context("nfe", True)
    one = {m: gpu_check_plan._setting("llada-8b", 1, "none", m, layers=2, policies=("tdlm",))
           for m in ("reduce-overhead", "compiled-static")}  # fmt: skip
    assert one["reduce-overhead"]["name"] == "llada-8b/b1/none/reduce-overhead/2L/tdlm"
    monkeypatch.setattr(gpu_check_nfe, "find_setting", lambda name, dry: next(s for s in one.values()
                                                                              if s["name"] == name))  # fmt: skip
    calls = []
    monkeypatch.setattr(tdlm, "decode", lambda target, req, **kw: calls.append(kw["policy"]) or [
        SimpleNamespace(nfe=4) for _ in req])
    rows = [gpu_check_stages.nfe_item(ctx, s["name"], lambda r: None) | {"item": s["name"]} for s in one.values()]
    assert calls == ["tdlm"] * 5  # reduce-overhead: warm-up, timed, profiled; compiled-static: warm-up, timed
    assert all(not any(k.startswith("threshold_") for k in r) and r["policies"] == ("tdlm",) for r in rows), rows
    twin = dict(rows[1], item="llada-8b/b1/none/compiled-static/2L/threshold", policies=["threshold"])
    twin = {k: v for k, v in twin.items() if not k.startswith("tdlm_")} | {"threshold_ms_per_nfe": 99.0}
    gpu_check_common.write_json(tmp_path / "gpu_nfe_dryrun.json",
                                {"stage": "nfe", "status": "ok", "rows": [rows[0], rows[1], twin]})  # fmt: skip
    out = {r["what"]: r for r in gpu_check_compare.beside_predicted(tmp_path, True)["rows"]}
    ratio = out["reduce-overhead/compiled-static llada-8b b1 none tdlm"]
    assert ratio["pairs"] == [rows[0]["item"], rows[1]["item"]] and ratio["measured"] == pytest.approx(
        rows[0]["tdlm_ms_per_nfe"] / rows[1]["tdlm_ms_per_nfe"]), ratio
    ms = {w for w in out if w.startswith("ms/NFE llada-8b b1 none reduce-overhead")}  # the policy it ran, no other
    assert ms == {"ms/NFE llada-8b b1 none reduce-overhead tdlm (at 2 of 8 layers, x4)"}, ms
