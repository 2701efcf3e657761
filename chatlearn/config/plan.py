"""Derived sizes and device layout, computed and validated once from the config.

Batch sizes are named for what they count: *prompts* or *samples* (a prompt times
``num_inference_per_prompt``), *global* (all ranks of a model) or *per rank*.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from chatlearn.errors import ConfigError

GPU_MODELS = ("policy", "policy_trainer", "ref_policy")


@dataclass
class ModelPlacement:
    name: str
    num_actors: int  # Ray actors (ranks, or rollout replicas)
    device_group: int  # index into Plan.device_groups; -1 for CPU-only models
    devices: list[int]  # devices of its group that it uses (one per actor)
    cpus_per_actor: float = 0.0


@dataclass
class Plan:
    group_size: int  # samples per prompt (num_inference_per_prompt)
    prompts_per_episode: int
    samples_per_episode: int
    trainer_dp: int  # data-parallel ranks of policy_trainer
    samples_per_step: int  # train_global_batch_size
    samples_per_rank_per_step: int
    micro_batches_per_step: int  # per rank, gradient accumulation
    steps_per_episode: int  # optimizer steps
    rollout_replicas: int
    device_groups: list[list[str]]  # models sharing each group's devices, taking turns
    devices_per_group: list[int]
    placements: dict[str, ModelPlacement] = field(default_factory=dict)
    # ref_policy exists only for a KL term (models.policy_trainer.kl_coef > 0), as in verl
    uses_ref: bool = True

    @property
    def total_devices(self) -> int:
        return sum(self.devices_per_group)

    def colocated_with(self, name: str) -> list[str]:
        """Models that share devices with ``name`` (itself excluded; unused models left out)."""
        g = self.placements[name].device_group
        return [] if g < 0 else [m for m in self.device_groups[g] if m != name and m in self.placements]

    def describe(self) -> list[str]:
        lines = []
        offset = 0
        for g, (models, n) in enumerate(zip(self.device_groups, self.devices_per_group)):
            devs = f"devices {offset}..{offset + n - 1}" if n > 1 else f"device {offset}"
            lines.append(f"device group {g} ({devs}): {', '.join(models)}"
                         + ("  [colocated: take turns]" if len(models) > 1 else ""))
            offset += n
        for name, pl in self.placements.items():
            where = (f"{pl.num_actors} actor(s) on device group {pl.device_group}" if pl.device_group >= 0
                     else f"{pl.num_actors} CPU actor(s), {pl.cpus_per_actor:g} CPU each")
            lines.append(f"  {name}: {where}")
        if not self.uses_ref:
            lines.append("  ref_policy: not started (models.policy_trainer.kl_coef is 0: no KL term needs it)")
        lines += [
            f"prompts per episode: {self.prompts_per_episode} x {self.group_size} samples each "
            f"= {self.samples_per_episode} samples",
            f"rollout replicas: {self.rollout_replicas}",
            f"policy_trainer data-parallel size: {self.trainer_dp}",
            f"optimizer steps per episode: {self.steps_per_episode} "
            f"(global batch {self.samples_per_step} samples = {self.trainer_dp} rank(s) x "
            f"{self.micro_batches_per_step} micro-batch(es) x "
            f"{self.samples_per_rank_per_step // self.micro_batches_per_step} samples)",
        ]
        return lines


def make_plan(cfg: DictConfig) -> Plan:
    rt, m = cfg.runtime_args, cfg.models
    n = m.policy.num_inference_per_prompt
    spe = rt.sample_per_episode
    gbs = rt.train_global_batch_size
    t = m.policy_trainer
    if spe % n:
        raise ConfigError(f"sample_per_episode ({spe}) must be divisible by models.policy.num_inference_per_prompt "
                          f"({n}): each prompt gets that many samples. Use a multiple, e.g. {max(n, spe // n * n)}.",
                          key="runtime_args.sample_per_episode")
    if spe % gbs:
        raise ConfigError(f"sample_per_episode ({spe}) must be divisible by train_global_batch_size ({gbs}): "
                          "an episode's samples are split into whole optimizer steps.",
                          key="runtime_args.sample_per_episode")
    for name in ("policy_trainer", "ref_policy"):  # both run on the training backend
        mc = m[name]
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if mc[key] < 1:
                raise ConfigError(f"must be a positive integer, got {mc[key]}.", key=f"models.{name}.{key}")
        model_parallel = mc.tensor_model_parallel_size * mc.pipeline_model_parallel_size
        if mc.num_gpu < model_parallel or mc.num_gpu % model_parallel:
            raise ConfigError(f"num_gpu ({mc.num_gpu}) must be divisible by tensor_model_parallel_size x "
                              f"pipeline_model_parallel_size ({mc.tensor_model_parallel_size} x "
                              f"{mc.pipeline_model_parallel_size}).", key=f"models.{name}.num_gpu")
        if rt.train_backend == "fsdp" and model_parallel != 1:
            raise ConfigError("the FSDP backend shards data-parallel only: set tensor_model_parallel_size and "
                              "pipeline_model_parallel_size to 1, or use train_backend: megatron.",
                              key=f"models.{name}.tensor_model_parallel_size")
    dp = t.num_gpu // (t.tensor_model_parallel_size * t.pipeline_model_parallel_size)
    if gbs % dp:
        raise ConfigError(f"train_global_batch_size ({gbs}) must be divisible by the trainer's data-parallel size "
                          f"({dp}).", key="runtime_args.train_global_batch_size")
    per_rank = gbs // dp
    micro = t.train_micro_batch_size
    if micro < 1 or per_rank % micro:
        raise ConfigError(f"the per-rank batch (train_global_batch_size {gbs} / {dp} rank(s) = {per_rank} samples) "
                          f"must be divisible by train_micro_batch_size ({micro}).",
                          key="models.policy_trainer.train_micro_batch_size")
    ref = m.ref_policy
    if spe % ref.num_gpu:
        raise ConfigError(f"sample_per_episode ({spe}) must be divisible by models.ref_policy.num_gpu "
                          f"({ref.num_gpu}): each rank computes an equal share of the log-probs.",
                          key="models.ref_policy.num_gpu")
    pol = m.policy
    tp = pol.tensor_model_parallel_size
    if tp != 1 or pol.pipeline_model_parallel_size != 1:
        raise ConfigError("rollout tensor/pipeline parallelism inside one engine is not available yet; set it to "
                          "1 and use num_gpu for data-parallel replicas.", key="models.policy.tensor_model_parallel_size")
    replicas = pol.num_gpu // tp
    for name in GPU_MODELS:
        mc = m[name]
        if mc.num_replica is not None and name == "policy" and mc.num_replica != replicas:
            raise ConfigError(f"is derived ({replicas} = num_gpu / tensor_model_parallel_size); remove it or "
                              "set it to that value.", key="models.policy.num_replica")

    uses_ref = t.kl_coef > 0
    groups, sizes = _device_groups(cfg, uses_ref)
    placements: dict[str, ModelPlacement] = {}
    for g, models in enumerate(groups):
        for name in models:
            if name == "reward" and m.reward.num_gpu == 0:
                continue
            num = m[name].num_gpu
            placements[name] = ModelPlacement(name, num, g, list(range(num)))
    if "reward" not in placements:
        r = m.reward
        per = r.cpu_per_process or 1
        placements["reward"] = ModelPlacement("reward", r.num_cpu // per, -1, [], float(per))
    return Plan(group_size=n, prompts_per_episode=spe // n, samples_per_episode=spe, trainer_dp=dp,
                samples_per_step=gbs, samples_per_rank_per_step=per_rank, micro_batches_per_step=per_rank // micro,
                steps_per_episode=spe // gbs * rt.num_training_epoch, rollout_replicas=replicas,
                device_groups=groups, devices_per_group=sizes, placements=placements, uses_ref=uses_ref)


def _device_groups(cfg: DictConfig, uses_ref: bool) -> tuple[list[list[str]], list[int]]:
    """Colocated models form one group; every other device model gets its own group (an unused
    ref_policy gets none)."""
    m = cfg.models
    coloc = list(cfg.runtime_args.colocation)
    key = "runtime_args.colocation"
    for name in coloc:
        if name not in m:
            raise ConfigError(f"{name!r} is not a model name; use some of {', '.join(m.keys())}.", key=key)
    if len(set(coloc)) != len(coloc):
        raise ConfigError("names a model twice.", key=key)
    groups, sizes = [], []
    if not uses_ref:
        coloc = [x for x in coloc if x != "ref_policy"]
    members = [x for x in coloc if not (x == "reward" and m.reward.num_gpu == 0)]
    if members:
        groups.append(coloc)
        sizes.append(max(m[x].num_gpu for x in members))
    for name in GPU_MODELS:
        if name == "ref_policy" and not uses_ref:
            continue
        if name not in coloc:
            groups.append([name])
            sizes.append(m[name].num_gpu)
    if m.reward.num_gpu > 0 and "reward" not in coloc:
        groups.append(["reward"])
        sizes.append(m.reward.num_gpu)
    return groups, sizes
