"""What one on-policy round costs for LLaDA-8B on one 8-GPU node: a prediction from ``bench/results/true_shape.json``
(no GPU has run tdlm yet), split into where the time goes.

* **Decoding** (roll-in, roll-out, exposure-gap prompts): the true-shape roofline of one uncached evaluation at the
  decode shape (prompt 256 + response 256: compute-bound at batch 1 already, so a batch of b rows costs about b
  times one row's), times the evaluations each phase needs, spread over the GPUs' replicas.
  Roll-in: the student's NFE per prompt (the paper's TDLM: 40.08 on GSM8K, Table 4's main row); roll-out: the teacher
  (``original``, one token per evaluation) finishes the positions still masked at s*, on average the share of the
  response a student leaves masked at the drawn step (``masked_share``: 0.5 for s* uniform over the student's steps,
  whose reveals are spread evenly); gap prompts: a whole teacher decode each.
* **Training**: the frozen backbone's forward FLOPs of one update's tokens per GPU (micro-batch x K states x sequence
  length, from the true-shape decode FLOPs per token), three forwards' worth with activation checkpointing
  (forward, recompute, and a backward that computes activation gradients only: the backbone's weights get none),
  at an assumed model-FLOPs utilisation ``mfu`` of the GPU's bf16 peak. The MFU is an assumption, not a reading.

Model loading (8 replicas, then ZeRO-3's partitioned load) is not predicted: it depends on the node's storage.
"""

from __future__ import annotations


def round_cost(true_shape: dict, *, prompts: int = 1000, gpus: int = 8, updates: int = 150, student_nfe: float = 40.08,
               masked_share: float = 0.5, gap_prompts: int = 64, gpu: str = "h200", mfu: float = 0.4) -> dict:
    """Seconds per phase of one round (see the module docstring); ``true_shape``: bench/results/true_shape.json."""
    rows = true_shape["nfe"]["llada-8b"]["rows"]

    def ms(policy: str) -> float:
        got = [r["eval"]["roofline_ms"][gpu]["fused"] for r in rows if r["policy"] == policy and r["cache"] == "none"
               and r["batch"] == 1 and (policy == "backbone" or r.get("history") == "full")]  # fmt: skip
        return max(got)

    shape = true_shape["decode_shape"]
    gen = shape["gen"]
    backbone_ms, tdlm_ms = ms("backbone"), ms("tdlm")
    roll_in = prompts * student_nfe * tdlm_ms / 1e3 / gpus
    roll_out = prompts * gen * masked_share * backbone_ms / 1e3 / gpus
    gap = gap_prompts * gen * backbone_ms / 1e3 / gpus
    flops_per_token = max(r["eval"]["flops"] for r in rows if r["policy"] == "backbone") / (shape["prompt"] + gen)
    ts = true_shape["train_shape"]
    tokens = ts["micro_batch"] * ts["states"] * ts["seq_len"]
    update_flops = 3 * flops_per_token * tokens
    peak = true_shape["gpus"][gpu]["flops"]
    update_s = update_flops / (peak * mfu)
    train = updates * update_s
    phases = {"roll-in (student)": roll_in, "roll-out (teacher from s*)": roll_out, "exposure-gap prompts": gap,
              "training": train}  # fmt: skip
    total = sum(phases.values())
    return {"assumptions": {"prompts": prompts, "gpus": gpus, "updates": updates, "student_nfe": student_nfe,
                            "masked_share": masked_share, "gap_prompts": gap_prompts, "gpu": gpu, "mfu": mfu,
                            "ms_per_nfe_backbone": backbone_ms, "ms_per_nfe_tdlm": tdlm_ms,
                            "update_tflop_per_gpu": update_flops / 1e12, "update_s": update_s},
            "seconds": phases, "total_s": total,
            "share": {k: v / total for k, v in phases.items()}}  # fmt: skip


def cost_table(cost: dict) -> str:
    a = cost["assumptions"]
    lines = ["| phase | predicted seconds | share |", "|---|---|---|"]
    for k, v in cost["seconds"].items():
        lines.append(f"| {k} | {v:.0f} | {100 * cost['share'][k]:.0f}% |")
    lines.append(f"| one round (without model loading) | {cost['total_s']:.0f} | 100% |")
    lines.append("")
    lines.append(f"{a['prompts']:,} prompts on {a['gpus']} GPUs, {a['updates']} updates; {a['ms_per_nfe_tdlm']:.2f} ms "
                 f"per student evaluation and {a['ms_per_nfe_backbone']:.2f} ms per teacher evaluation "
                 f"({a['gpu'].upper()} roofline); {a['update_tflop_per_gpu']:.0f} TFLOP per GPU per update at an "
                 f"assumed {100 * a['mfu']:.0f}% MFU = {a['update_s']:.2f} s per update.")
    return "\n".join(lines)
