"""Command line of the memory planner: ``python -m tdlm.training.planner --help``.

The arguments are parsed before torch and the planner's model are imported, so a mistyped flag is one line ("did
you mean --gpu-mem?", no usage block) at once. The flag tables below are plain literals for that reason; a test
checks them against the modules they mirror (``PRESETS``, ``DTYPE_BYTES``, ``DSKnobs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tdlm.config import SuggestingParser
from tdlm.errors import TDLMError

if TYPE_CHECKING:
    from tdlm.training.planner.model import DSKnobs

# Mirrors of tdlm.models.loading.PRESETS, tdlm.training.planner.model.DTYPE_BYTES and DSKnobs' defaults (tested).
PRESET_NAMES = ("tiny-llada", "tiny-dream")
DTYPES = ("bf16", "fp32")
DS_DEFAULTS = {"reduce_bucket_size": 500_000_000, "prefetch_bucket_size": 50_000_000,
               "max_live_parameters": 1_000_000_000, "param_persistence_threshold": 100_000}


# -- command line ---------------------------------------------------------------------------------
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except None/False ones and where the help text already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False) or "default" in text:
            return text
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    ap = SuggestingParser(
        prog="python -m tdlm.training.planner",
        description="Predict the peak GPU memory per rank of TDLM training (frozen backbone + temporal adapters, "
        "DeepSpeed ZeRO), broken down by component; formulas in the tdlm.training.planner.model docstring. "
        "Sizes in GiB.",
        formatter_class=_HelpFormatter,
    )
    ap.add_argument(
        "--backbone",
        default="llada-8b",
        help="'llada-8b' or 'dream-7b' (release configs), a preset (" + ", ".join(PRESET_NAMES) + "), or a "
        "checkpoint folder / its config.json (only the config is read)",
    )
    ap.add_argument(
        "--layers",
        default=None,
        help="temporal layers: 'all', 'dispersed:N', 'middle:N' or 'i,j,...' (default: the backbone's "
        "paper allocation, LLaDA dispersed:16, Dream middle:14)",
    )
    ap.add_argument("--heads", type=int, default=None, help="temporal heads M (default: backbone's, 4)")
    ap.add_argument("--head-dim", type=int, default=None, help="temporal head width d_h (LLaDA 64, Dream 84)")
    ap.add_argument("--states", type=int, default=8, help="K sampled states per trajectory (forward_states)")
    ap.add_argument("--seq-len", type=int, default=512, help="L = prompt + response tokens per state")
    ap.add_argument("--response-len", type=int, default=None, help="N response tokens (default L // 2)")
    ap.add_argument("--supervised", type=int, default=None, help="S supervised tokens per micro-batch (default B*N)")
    ap.add_argument("--micro-batch", type=int, default=1, help="B trajectories per GPU per micro-step")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16", help="model / compute dtype")
    ap.add_argument(
        "--grad-dtype",
        choices=DTYPES,
        default=None,
        help="DeepSpeed grad_accum_dtype (default: the model dtype, as DeepSpeed does)",
    )
    ap.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2, 3),
        default=None,
        help="ZeRO stage; 0 = no ZeRO (plain PyTorch AdamW, states in the parameter dtype) (default: the --ds "
        "file's stage, else 3)",
    )
    ap.add_argument("--world-size", type=int, default=1, help="W data-parallel ranks (ZeRO partitions over W)")
    ap.add_argument(
        "--checkpointing",
        choices=("on", "off"),
        default=None,
        help="activation checkpointing of each block from the lowest temporal layer up (default: on iff the "
        "--ds file has an activation_checkpointing section, else off)",
    )
    ap.add_argument(
        "--offload",
        choices=("none", "optimizer"),
        default=None,
        help="DeepSpeed offload_optimizer to CPU (fp32 master, moments and ZeRO-3 grad partition) (default: the "
        "--ds file's zero_optimization.offload_optimizer, else none)",
    )
    ap.add_argument(
        "--ds",
        default=None,
        help="a DeepSpeed JSON (ds_configs/zero3.json): its ZeRO stage, optimizer offload, activation "
        "checkpointing and bucket / prefetch / live / persistence sizes replace DeepSpeed's defaults; flags given "
        "explicitly win",
    )
    ap.add_argument(
        "--head",
        choices=("supervised", "full"),
        default="supervised",
        help="LM head on the supervised positions only (the training recipe) or on all positions (the former "
        "recipe, for comparison)",
    )
    ap.add_argument("--gpu-mem", type=float, default=96.0, help="GPU memory in GiB to check against")
    ap.add_argument("--reserve", type=float, default=2.0, help="GiB kept for CUDA context, NCCL, fragmentation")
    ap.add_argument(
        "--reduce-bucket-size",
        type=int,
        default=None,
        help=f"DeepSpeed reduce_bucket_size (elements); default: the --ds file's value, "
        f"else DeepSpeed's ({DS_DEFAULTS['reduce_bucket_size']:,})",
    )
    ap.add_argument(
        "--prefetch-bucket-size",
        type=int,
        default=None,
        help=f"stage3_prefetch_bucket_size (elements); default: the --ds file's value, "
        f"else DeepSpeed's ({DS_DEFAULTS['prefetch_bucket_size']:,})",
    )
    ap.add_argument(
        "--max-live-parameters",
        type=int,
        default=None,
        help=f"stage3_max_live_parameters (elements); default: the --ds file's value, "
        f"else DeepSpeed's ({DS_DEFAULTS['max_live_parameters']:,})",
    )
    ap.add_argument(
        "--param-persistence-threshold",
        type=int,
        default=None,
        help=f"stage3_param_persistence_threshold (elements); default: the --ds file's value, "
        f"else DeepSpeed's ({DS_DEFAULTS['param_persistence_threshold']:,})",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument(
        "--table",
        action="store_true",
        help="print the docs/training.md table: dispersed:8 / dispersed:16 / all x checkpointing off/on on 1 and "
        "8 GPUs of --gpu-mem (other flags set the shapes and engine)",
    )
    ap.add_argument(
        "--measure",
        action="store_true",
        help="run real training steps on the CPU (single process, no ZeRO: use --zero 0) and print "
        "the measured peak next to the prediction",
    )
    ap.add_argument("--steps", type=int, default=2, help="--measure: measured steps (after one warm-up step)")
    ap.add_argument("--seed", type=int, default=0, help="--measure: seed of weights and trajectories")
    ap.add_argument("--threads", type=int, default=1, help="--measure: torch intra-op threads")
    return ap


def _engine_from_ds(args: argparse.Namespace, hidden_size: int) -> DSKnobs:
    """Fill the engine flags left unset from --ds (or DeepSpeed's defaults); returns the knobs."""
    from tdlm.training.planner.model import DSKnobs

    ds: dict = {}
    if args.ds:
        from tdlm.training.ds_config import load_ds_json

        ds = load_ds_json(args.ds)
    where = f"--ds {args.ds}" if args.ds else "defaults"
    zero = ds.get("zero_optimization", {}) if isinstance(ds.get("zero_optimization", {}), dict) else {}
    if args.zero is None:
        stage = zero.get("stage", 3 if not args.ds else 0)
        if stage not in (0, 1, 2, 3):
            raise TDLMError(f"{where}: zero_optimization.stage must be 0, 1, 2 or 3; got {stage!r}")
        args.zero = int(stage)
    if args.offload is None:
        dev = (zero.get("offload_optimizer") or {}).get("device", "none")
        args.offload = "optimizer" if dev not in ("none", None) else "none"
    if args.checkpointing is None:
        args.checkpointing = "on" if "activation_checkpointing" in ds else "off"
    base = DSKnobs.from_ds_config(ds, where, hidden_size)
    explicit = {
        "reduce_bucket_size": args.reduce_bucket_size,
        "prefetch_bucket_size": args.prefetch_bucket_size,
        "max_live_parameters": args.max_live_parameters,
        "param_persistence_threshold": args.param_persistence_threshold,
    }
    return dataclasses.replace(base, **{k: v for k, v in explicit.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # before the heavy imports: a mistyped flag costs no torch import
    import torch

    from tdlm.training.planner.measure import _measure_here
    from tdlm.training.planner.model import inventory, plan, readme_table, resolve_backbone

    try:
        spec = resolve_backbone(args.backbone)
        knobs = _engine_from_ds(args, inventory(spec).backbone.hidden)
        layers = args.layers
        common = dict(
            states=args.states,
            seq_len=args.seq_len,
            response_len=args.response_len,
            micro_batch=args.micro_batch,
            dtype=args.dtype,
            checkpointing=args.checkpointing == "on",
        )
        if args.measure:
            if args.zero != 0 or args.world_size != 1 or args.head != "supervised":
                raise TDLMError("--measure runs the training recipe in one process without ZeRO: pass --zero 0 "
                                "--world-size 1 (and no --head full)")
            torch.set_num_threads(args.threads)
            m = _measure_here(spec, layers, args.heads, args.head_dim, steps=args.steps, seed=args.seed, **common)
            if args.json:
                print(json.dumps(dataclasses.asdict(m)))
            else:
                print(
                    f"measured peak {m.peak / 2**20:.1f} MiB, predicted {m.predicted['total'] / 2**20:.1f} MiB "
                    f"(ratio {m.ratio:.3f}; predicted peak at {m.predicted['peak_phase']}); "
                    f"baseline {m.baseline / 2**20:.1f} MiB, RSS growth {m.rss_delta / 2**20:.1f} MiB, "
                    f"{m.step_seconds:.2f} s/step"
                )
            return 0
        engine = dict(
            supervised=args.supervised,
            grad_dtype=args.grad_dtype,
            zero=args.zero,
            offload=args.offload,
            gpu_mem_gb=args.gpu_mem,
            reserve_gb=args.reserve,
            knobs=knobs,
            head=args.head,
        )
        if args.table:
            kw = {**common, **engine}
            kw.pop("checkpointing")
            print(readme_table(spec, **kw))
            return 0
        p = plan(spec, layers, args.heads, args.head_dim, world_size=args.world_size, **common, **engine)
    except TDLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p.to_dict()) if args.json else p.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
