"""The embedded default of a training launch without flags: tiny-arith teacher trajectories, generated on first use.

``deepspeed launcher/train.py --ds ds_configs/zero3.json`` with no other flags trains ``tiny-arith`` on trajectories
in ``runs/tiny/trajectories`` (the ``TrainConfig`` defaults); :func:`ensure_toy_trajectories` writes them once,
in-process
(no Ray: it runs inside a DeepSpeed launch). Sweeps and benchmarks build on the same folder.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tdlm.errors import TDLMError

BACKBONE = "tiny-arith"  # the embedded default of a training launch without flags
GEN_LENGTH = 40  # tiny-arith's response length (solution + <|eot|> + EOS padding)
# The shipped weights are stored in bf16 (half the bytes) but compute in fp32 everywhere, as training
# does on CPU and as the model card's accuracy was measured: bf16 matmuls on a CPU without bf16 units are
# several times slower, and teacher, student and evaluation then see the same numerics.
DTYPE = "float32"


def ensure_toy_trajectories(trajectories: str | Path, backbone: str, n: int = 512) -> None:
    """Teacher trajectories for the embedded default, generated once if the folder does not exist.

    Lets ``deepspeed launcher/train.py --ds ds_configs/zero3.json`` (no other flags) train out of the box.
    Rank 0 decodes in-process (no Ray: this runs inside a DeepSpeed launch) and publishes the folder with
    one atomic rename; the other ranks wait for it.
    """
    folder = Path(trajectories)
    if folder.exists() or backbone != BACKBONE:
        return
    if int(os.environ.get("RANK", "0")) != 0:
        deadline = time.time() + 1800
        while not folder.exists():
            if time.time() > deadline:
                raise TDLMError(f"data.trajectories: rank 0 did not produce {folder} within 30 minutes")
            time.sleep(1.0)
        return
    from tdlm.data.store import write_manifest
    from tdlm.data.tokenizer import encode_prompts, load_tokenizer, stop_token_ids
    from tdlm.data.trajectories import TrajectoryRecord, write_parquet
    from tdlm.decoding import decode
    from tdlm.models.loading import load_backbone
    from tdlm.tasks.toydata import split

    print(f"{folder} does not exist: generating {n} teacher trajectories with {backbone} (original decoding)",
          flush=True)
    bb = load_backbone(backbone, dtype=DTYPE)
    tok = load_tokenizer(backbone)
    problems = split("prompts", n)
    ids = encode_prompts(tok, [p.question for p in problems])
    settings = {"policy": "original", "gen_length": GEN_LENGTH, "block_size": GEN_LENGTH}
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    per = 128
    for s in range(0, n, per):
        res = decode(bb, ids[s : s + per], policy="original", gen_length=GEN_LENGTH, block_size=GEN_LENGTH,
                     tokenizer=tok, stop_ids=stop_token_ids(tok, bb.eos_token_id), progress=True)
        recs = [TrajectoryRecord.from_decode(r, p.id, p.question, bb.backbone_id, settings)
                for r, p in zip(res, problems[s : s + per], strict=True)]
        write_parquet(recs, tmp / f"shard-{s // per:05d}.parquet")
    write_manifest(tmp, bb.backbone_id, {"decode": settings, "prompts": f"toydata:prompts[:{n}]",
                                         "dtype": "float32", "backbone": backbone})
    os.replace(tmp, folder)
