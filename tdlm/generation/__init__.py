"""Teacher trajectory generation across a Ray cluster, resumable and fault-tolerant (paper Section 2.3).

``generate(GenerationConfig(...))`` decodes every prompt of a source once with :func:`tdlm.decode` on
backbone replicas (Ray actors) and writes ``shard-NNNNN.parquet`` files of
:class:`tdlm.data.trajectories.TrajectoryRecord` plus ``manifest.json``. Modules:

* :mod:`~tdlm.generation.config` - the job's dataclass config; identity vs run settings;
* :mod:`~tdlm.data.store`  - the output dir: lock, resume checks, atomic shard/manifest writes;
* :mod:`~tdlm.generation.worker` - one replica (plain class, the body of a Ray actor);
* :mod:`~tdlm.generation.driver` - the job on the Ray actor pool (:mod:`tdlm.data.ray_pool`: scheduling,
  node and head loss, driver-level redo), shard writes, progress.

Entry point: ``ray_jobs/generate_trajectories.py``.
"""

from tdlm.data.store import MANIFEST, ShardStore, shard_name
from tdlm.generation.config import GenerationConfig
from tdlm.generation.driver import GenerationSummary, connect_ray, generate
from tdlm.generation.worker import ShardTask, ShardWorker, WorkerSpec

__all__ = [
    "MANIFEST",
    "GenerationConfig",
    "GenerationSummary",
    "ShardStore",
    "ShardTask",
    "ShardWorker",
    "WorkerSpec",
    "connect_ray",
    "generate",
    "shard_name",
]
