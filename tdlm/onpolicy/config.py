"""The one config schema of an on-policy job (``ray_jobs/onpolicy.py``): fields, their checks, and which of them
decide the records (identity) and which only how fast the job runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from tdlm.data.onpolicy import SwitchDistribution
from tdlm.decoding.config import DecodeSettings
from tdlm.errors import TDLMError


@dataclass
class OnPolicyConfig:
    """Round 0 is the off-policy pipeline (teacher trajectories, then training); each later round rolls in with the
    current adapter, rolls out with the frozen backbone from s*, trains on a mix and syncs the adapter."""

    train_config: str  # training recipe YAML of round 0 (configs/tiny_multi.yaml); later rounds continue it
    # training prompts: a local .jsonl/.json/.parquet or a Hugging Face dataset; round r takes the next
    # prompts_per_round whose text no earlier round used
    prompts: str
    output_dir: str  # rounds/NN/{prompts.jsonl,records,mix,train,adapter} + onpolicy.json
    prompt_field: str = "question"  # field / column holding the prompt text
    prompt_config: str | None = None  # Hugging Face dataset config (a dataset name in `prompts`)
    prompt_split: str = "train"  # Hugging Face dataset split (ignored for local files); never an evaluation split
    chat: bool = True  # wrap prompts in the tokenizer's chat template
    ds: str = "ds_configs/zero3.json"  # DeepSpeed JSON of every round's training
    # the training launcher and its flags (a sweep's `launcher`); launcher/train.py and its arguments follow
    launcher: list[str] = field(default_factory=lambda: ["deepspeed", "--num_gpus", "2"])
    train_overrides: list[str] = field(default_factory=list)  # key=value overrides of train_config for every round
    # round 0 from folders that exist: teacher trajectories (skip its generation) and / or its trained adapter
    round0_trajectories: str | None = None
    round0_adapter: str | None = None
    # rounds and prompts
    rounds: int = 2  # on-policy rounds after round 0 (>= 1); more rounds may be added to a finished job
    prompts_per_round: int = 1024  # fresh prompts of each round (round 0's teacher trajectories included)
    # The decode settings (tdlm.decoding.config.DecodeSettings) of round 0's teacher, every roll-out and, with policy
    # tdlm at the round's rollout_tau, every roll-in: decode.policy is the frozen backbone's commit rule (never tdlm);
    # batch_size: prompts per decode in an actor
    decode: DecodeSettings = field(default_factory=lambda: DecodeSettings(policy="original", batch_size=64))
    # policy tdlm's tau of the roll-in, one value for every round or one per round
    rollout_tau: list[float] = field(default_factory=lambda: [0.95])
    switch: str = "uniform"  # s* distribution: uniform | frac:A:B | start (= more fresh teacher data) | end
    # the mix
    mix_lambda: float = 0.5  # fraction of each round's training mix drawn from its own records, in [0, 1]
    mix_size: int | None = None  # records in each round's mix; None = prompts_per_round
    replay_window: int = 1  # earlier on-policy rounds replayed beside the teacher's records (0 = teacher only)
    staleness: int = 1  # a record rolled in more than this many adapter versions ago is refused (>= replay_window)
    updates_per_round: int = 50  # optimizer updates of each later round (train.max_steps of its launch)
    round_overrides: list[str] = field(default_factory=list)  # key=value overrides of later rounds' launches only
    seed: int = 0  # training seed of every round (train.seed) and the seed of s* and of the mix
    gap_prompts: int = 16  # per roll-out shard: prompts also decoded by the teacher from scratch (exposure gap)
    # W&B: one group per job (default: the output folder's name), the round and adapter version on every point
    wandb_project: str = "tdlm"
    wandb_group: str | None = None
    wandb_mode: str | None = None  # online | offline | disabled; None = WANDB_MODE, else offline without a key
    # run settings (may change on resume)
    shard_size: int = 256  # prompts per records shard (identity: the shards of a finished round keep theirs)
    actors: int | None = None  # None = one per GPU, or one per cpus_per_actor CPUs without GPUs
    cpus_per_actor: int = 1
    address: str | None = None  # Ray cluster address; None = RAY_ADDRESS, else a fresh local cluster

    def tau(self, r: int) -> float:
        """The roll-in tau of round r >= 1."""
        taus = self.rollout_tau
        return float(taus[0] if len(taus) == 1 else taus[r - 1])

    def size(self) -> int:
        return self.mix_size if self.mix_size is not None else self.prompts_per_round

    def validate(self, where: str = "on-policy config") -> OnPolicyConfig:
        """Every one-line refusal that needs no file read (the job checks files, backbones and prompts after)."""

        def bad(name: str, want: str, got) -> TDLMError:
            return TDLMError(f"{where}: {name} must be {want}; got {got!r}")

        lam = self.mix_lambda
        if isinstance(lam, bool) or not isinstance(lam, int | float) or not 0.0 <= lam <= 1.0:
            raise bad("mix_lambda", "in [0, 1]", lam)
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise bad("rounds", ">= 1 (round 0 alone is the off-policy pipeline: ray_jobs/generate_trajectories.py "
                      "then launcher/train.py)", self.rounds)
        SwitchDistribution.parse(self.switch, f"{where}: switch")
        try:
            self.decode.validate()
        except TDLMError as e:
            raise TDLMError(f"{where}: {e}") from None
        if self.decode.policy == "tdlm":
            raise bad("decode.policy", "the frozen backbone's rule (original, threshold, entropy, credit, soft); the "
                      "roll-ins decode with tdlm at rollout_tau", self.decode.policy)
        if not self.rollout_tau or len(self.rollout_tau) not in (1, self.rounds):
            raise bad("rollout_tau", f"one value or {self.rounds} (one per round)", self.rollout_tau)
        for t in self.rollout_tau:
            if not isinstance(t, int | float) or not 0.0 < t <= 1.0:
                raise bad("rollout_tau", "values in (0, 1]", self.rollout_tau)
        for name in ("prompts_per_round", "updates_per_round", "shard_size", "cpus_per_actor"):
            if getattr(self, name) < 1:
                raise bad(name, ">= 1", getattr(self, name))
        if self.mix_size is not None and self.mix_size < 1:
            raise bad("mix_size", ">= 1 (or null: prompts_per_round)", self.mix_size)
        if self.replay_window < 0 or self.staleness < 0 or self.gap_prompts < 0:
            raise bad("replay_window, staleness and gap_prompts", ">= 0",
                      (self.replay_window, self.staleness, self.gap_prompts))
        if self.replay_window > self.staleness:
            raise TDLMError(f"{where}: replay_window={self.replay_window} replays records {self.replay_window} adapter "
                            f"versions old, beyond staleness={self.staleness}; raise staleness or lower the window")
        if self.actors is not None and self.actors < 1:
            raise bad("actors", ">= 1 (or null)", self.actors)
        if self.wandb_mode not in (None, "online", "offline", "disabled"):
            raise bad("wandb_mode", "online, offline, disabled or null", self.wandb_mode)
        if not self.launcher:
            raise bad("launcher", "a command (deepspeed --num_gpus 2)", self.launcher)
        return self

    def identity(self) -> dict:
        """What decides the records and adapters of finished rounds: a resume with any of it changed is refused
        (rounds may grow; the run settings and W&B may change)."""
        keep = ("train_config", "prompts", "prompt_field", "prompt_config", "prompt_split", "chat", "ds",
                "train_overrides", "round0_trajectories", "round0_adapter", "prompts_per_round", "rollout_tau",
                "switch", "mix_lambda", "mix_size", "replay_window", "staleness", "updates_per_round",
                "round_overrides", "seed", "gap_prompts", "shard_size")  # fmt: skip
        out = {k: getattr(self, k) for k in keep}
        d = self.decode
        # the decode section under the keys onpolicy.json always had, so jobs started before it still resume; its
        # other identity fields only where they differ from the defaults those jobs decoded with
        out.update(gen_length=d.gen_length, block_size=d.block_size, teacher_policy=d.policy, dtype=d.dtype)
        base = DecodeSettings(policy=d.policy).to_dict()
        extra = {k: v for k, v in d.to_dict().items() if k not in ("policy", "gen_length", "block_size")
                 and base.get(k) != v}  # fmt: skip
        if d.history is not None:
            extra["history"] = d.history
        if extra:
            out["decode"] = extra
        if len(self.rollout_tau) == 1:  # one tau for every round: adding rounds changes nothing finished
            out["rollout_tau"] = self.rollout_tau[0]
        return out
