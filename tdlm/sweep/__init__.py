"""Layer-allocation sweeps (the paper's Table 4): one command trains and evaluates a list of allocations on the same
trajectories and seeds, logging training, evaluation and one run per trial to one W&B project and group. With
``seeds: [0, 1, 2]`` each allocation is trained once per training seed (a trial per allocation and seed, the W&B
runs of an allocation's seeds in one group) and Table 4 reports mean ± sd over seeds, each allocation's difference
from the first with a two-level bootstrap interval over seeds and problems.

* :mod:`.config` - ``SweepConfig`` (``configs/sweep_*.yaml``) and the per-allocation plan (indices, parameters)
* :mod:`.trial` - one allocation: the real DeepSpeed launcher, the evaluator, the model card, the trial's W&B run
* :mod:`.runner` - the W&B sweep file (``wandb sweep`` / ``wandb agent``) and the local runner of its grid
* :mod:`.table` - Table 4 from a sweep folder's JSON (``eval/compare.py`` prints it too)

Entry point: ``launcher/sweep.py`` (``run``, ``trial``, ``wandb-file``).
"""

from tdlm.sweep.config import TABLE4, AllocationPlan, SweepConfig, SweepEvalConfig, load_sweep_config, plan, plan_all
from tdlm.sweep.runner import agent_command, grid, run_sweep, wandb_sweep_spec, wandb_sweep_yaml
from tdlm.sweep.table import is_sweep_dir, load_sweep, table4, write_table4
from tdlm.sweep.trial import run_trial

__all__ = [
    "TABLE4",
    "AllocationPlan",
    "SweepConfig",
    "SweepEvalConfig",
    "agent_command",
    "grid",
    "is_sweep_dir",
    "load_sweep",
    "load_sweep_config",
    "plan",
    "plan_all",
    "run_sweep",
    "run_trial",
    "table4",
    "wandb_sweep_spec",
    "wandb_sweep_yaml",
    "write_table4",
]
