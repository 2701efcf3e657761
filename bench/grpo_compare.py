"""Pure parts of ``bench/grpo_vs_trl.py``: workloads, the chatlearn <-> TRL config mapping,
the run order, steady-state throughput, chatlearn's episode breakdown, medians and the table.

Nothing here starts a run; everything is a function of configs, metric rows and timestamps.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
from dataclasses import asdict, dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def portable_paths(value, roots: dict[str, str]):
    """``value`` (nested dicts/lists) with every absolute path made machine-independent: relative to
    the repository when inside it, else ``<name>/rest`` for the first of ``roots`` (name -> folder)
    that holds it, else ``<abs>/basename``. Result files carry no path of the machine they ran on."""
    if isinstance(value, dict):
        return {k: portable_paths(v, roots) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable_paths(v, roots) for v in value]
    if not isinstance(value, str) or not os.path.isabs(value):
        return value
    path = os.path.normpath(value)
    for name, root in {"": REPO, **roots}.items():
        root = os.path.normpath(root)
        if path == root or path.startswith(root + os.sep):
            rel = os.path.relpath(path, root)
            return rel if not name else f"<{name}>" + ("" if rel == "." else "/" + rel)
    return f"<abs>/{os.path.basename(path)}"
TEMPLATE = os.path.join(REPO, "template", "grpo_fsdp.yaml")
TINY_MODEL = os.path.join(REPO, "assets", "tiny_qwen2")
ARITH_TRAIN = os.path.join(REPO, "assets", "arith", "train.jsonl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")

# the systems a benchmark can run; chatlearn's names carry its rollout backend.
# Step counts are sized for a full benchmark (five workloads, 3 systems, 2 repetitions) of about 35
# minutes on 2 idle cores: chatlearn starts in 10-30 s (Ray, vLLM), TRL in about 10 s; a medium step
# takes either about 3 s, a long step 15-25 s.
SYSTEMS = ("chatlearn-vllm", "chatlearn-hf", "trl")


@dataclass(frozen=True)
class ModelSpec:
    """A Qwen2 built from a config with the embedded 320-token tokenizer (random weights, seeded)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int = 256
    vocab: int = 320
    seed: int = 0

    def params(self) -> int:
        """Parameter count of Qwen2ForCausalLM with tied embeddings:
        V*h + L*(q,k,v with biases + o + 3*h*I MLP + 2 norms) + final norm."""
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        attn = h * h + h + 2 * (h * kv + kv) + h * h
        layer = attn + 3 * h * self.intermediate + 2 * h
        return self.vocab * h + self.layers * layer + h

    def key(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Workload:
    """One GRPO job, described once and mapped onto both systems."""

    name: str
    model: str | ModelSpec  # a model folder, or a spec built into the cache
    data_path: str
    group_size: int  # num_inference_per_prompt = TRL num_generations
    max_response: int  # max_response_tokens_length = TRL max_completion_length
    sample_per_episode: int  # samples per generated batch (TRL generation_batch_size)
    global_batch: int  # samples per optimizer step
    micro_batch: int  # samples per forward/backward (TRL per_device_train_batch_size)
    episodes: int  # generated batches (TRL: episodes x optimizer steps per batch = max_steps)
    warmup: int  # leading episodes left out of the throughput
    quick_episodes: int
    quick_warmup: int
    lr: float = 1e-4
    temperature: float = 1.0
    kl_coef: float = 0.0  # chatlearn kl_coef = TRL beta
    clip_ratio: float = 0.2
    clip_grad: float = 1.0
    weight_decay: float = 0.0
    max_prompt_tokens: int = 64
    seed: int = 1234
    extra: dict = field(default_factory=dict)

    @property
    def steps_per_episode(self) -> int:
        return self.sample_per_episode // self.global_batch


MEDIUM_SPEC = ModelSpec(hidden=512, layers=10, heads=8, kv_heads=2, intermediate=2048)
# the same model with room for 64 + 256 tokens
LONG_SPEC = ModelSpec(hidden=512, layers=10, heads=8, kv_heads=2, intermediate=2048, max_positions=512)

WORKLOADS = {
    # a short on-policy job as a user tries first: start-up weighs as much as the steps
    "short": Workload("short", TINY_MODEL, ARITH_TRAIN, group_size=8, max_response=32,
                      sample_per_episode=128, global_batch=128, micro_batch=32,
                      episodes=15, warmup=2, quick_episodes=4, quick_warmup=1),
    # the embedded default run (template/grpo_fsdp.yaml), data in file order
    "tiny": Workload("tiny", TINY_MODEL, ARITH_TRAIN, group_size=8, max_response=16,
                     sample_per_episode=256, global_batch=128, micro_batch=64,
                     episodes=12, warmup=2, quick_episodes=4, quick_warmup=1),
    # 38.2M parameters (random weights): model compute dominates every stage
    "medium": Workload("medium", MEDIUM_SPEC, ARITH_TRAIN, group_size=8, max_response=24,
                       sample_per_episode=32, global_batch=16, micro_batch=16,
                       episodes=5, warmup=1, quick_episodes=3, quick_warmup=1, lr=1e-5),
    # the medium model with responses of up to 256 tokens that vary in length as in RL for reasoning:
    # its random weights put about 1/320 on the end token at every step, so about half of the
    # responses end before the limit, anywhere from the first token on (a median near 200), and the
    # rest run to it; one optimizer step per generated batch
    "long": Workload("long", LONG_SPEC, ARITH_TRAIN, group_size=8, max_response=256,
                     sample_per_episode=32, global_batch=32, micro_batch=8,
                     episodes=4, warmup=1, quick_episodes=2, quick_warmup=1, lr=1e-5),
    # the same with the whole batch in one micro-batch (the memory goal's other end)
    "long_mb": Workload("long_mb", LONG_SPEC, ARITH_TRAIN, group_size=8, max_response=256,
                        sample_per_episode=32, global_batch=32, micro_batch=32,
                        episodes=4, warmup=1, quick_episodes=2, quick_warmup=1, lr=1e-5),
}


def with_episodes(w: Workload, quick: bool) -> tuple[int, int]:
    """(episodes, warm-up episodes) of a full or a ``--quick`` run."""
    return (w.quick_episodes, w.quick_warmup) if quick else (w.episodes, w.warmup)


# ---------------------------------------------------------------------------------------
# the same job for both systems
# ---------------------------------------------------------------------------------------

def chatlearn_overrides(w: Workload, model_dir: str, output_dir: str, rollout_backend: str,
                        episodes: int) -> list[str]:
    """``key=value`` overrides of template/grpo_fsdp.yaml that run workload ``w``.

    Evaluation is off; the data sampler walks the prompts in file order (data_shuffle False);
    one generate call per episode (policy.generation_batch_size = sample_per_episode); the
    log-prob passes use the training micro-batch as their batch; fp32 everywhere.
    """
    return [
        f"runtime_args.output_dir={output_dir}",
        f"runtime_args.rollout_backend={rollout_backend}",
        f"runtime_args.data_path={w.data_path}",
        "runtime_args.eval_data_path=null",
        "runtime_args.eval_episode_interval=0",
        "runtime_args.enable_eval_before_training=False",
        f"runtime_args.num_episode={episodes}",
        f"runtime_args.sample_per_episode={w.sample_per_episode}",
        f"runtime_args.train_global_batch_size={w.global_batch}",
        f"runtime_args.train_micro_batch_size={w.micro_batch}",
        "runtime_args.save_episode_interval=0",
        "runtime_args.data_shuffle=False",
        f"runtime_args.seed={w.seed}",
        f"models.policy_trainer.load={model_dir}",
        f"models.policy_trainer.optimizer.lr={w.lr}",
        f"models.policy_trainer.optimizer.clip_grad={w.clip_grad}",
        f"models.policy_trainer.optimizer.weight_decay={w.weight_decay}",
        "models.policy_trainer.optimizer.lr_decay_style=constant",
        "models.policy_trainer.optimizer.lr_warmup_iters=0",
        "models.policy_trainer.optimizer.lr_warmup_fraction=0.0",
        "models.policy_trainer.loss_agg_mode=token-mean",
        "models.policy_trainer.kl_estimator=k3",
        "models.policy_trainer.kl_in_reward=False",
        "models.policy_trainer.advantage_estimator=grpo",
        "models.policy_trainer.filter_equal_groups=False",
        "models.policy_trainer.use_group_sequence_policy=False",
        "models.policy_trainer.clip_ratio_c=null",
        f"models.policy_trainer.kl_coef={w.kl_coef}",
        f"models.policy_trainer.pos_clip_ratio={w.clip_ratio}",
        f"models.policy_trainer.neg_clip_ratio={w.clip_ratio}",
        "models.policy_trainer.entropy_coef=0.0",
        "models.policy_trainer.gradient_checkpointing=False",
        "models.policy_trainer.bf16=False",
        "models.policy_trainer.save_hf=False",
        f"models.policy_trainer.generation_batch_size={w.micro_batch}",
        f"models.ref_policy.generation_batch_size={w.micro_batch}",
        f"models.policy.generation_batch_size={w.sample_per_episode}",
        f"models.policy.num_inference_per_prompt={w.group_size}",
        f"models.policy.max_prompt_tokens_length={w.max_prompt_tokens}",
        f"models.policy.max_response_tokens_length={w.max_response}",
        f"models.policy.temperature={w.temperature}",
        "models.policy.top_p=1.0",
        "models.policy.top_k=-1",
        "models.policy.dtype=float32",
        "models.policy.enable_thinking=False",
    ]


# chatlearn loss_agg_mode -> TRL loss_type; advantage_estimator -> TRL scale_rewards
LOSS_AGG = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
ADVANTAGES = {"grpo": "group", "dr_grpo": "none"}


def trl_config_kwargs(cfg, output_dir: str, episodes: int) -> dict:
    """GRPOConfig keyword arguments for the job a resolved chatlearn config (``cfg``) describes.

    Optimizer steps per generated batch: chatlearn takes sample_per_episode / train_global_batch_size;
    TRL takes steps_per_generation / gradient_accumulation_steps, where a "step" of
    steps_per_generation is one micro-batch of per_device_train_batch_size samples. So:
    per_device_train_batch_size = train_micro_batch_size, gradient_accumulation_steps =
    train_global_batch_size / train_micro_batch_size, generation_batch_size = sample_per_episode
    (steps_per_generation follows), num_iterations = 1.

    Loss: chatlearn's ``loss_agg_mode`` token-mean divides the summed per-token loss of an optimizer
    step by the response tokens of that step ("token mean over the global batch"); TRL's ``dapo``
    divides by the response tokens of the whole generated batch over the optimizer steps it spans
    (the same when an episode is one optimizer step, otherwise a per-step factor near 1); ``bnpo``
    would normalise per micro-batch.
    """
    rt, m = cfg.runtime_args, cfg.models
    p, t = m.policy, m.policy_trainer
    opt = t.optimizer
    return dict(
        output_dir=output_dir, seed=int(rt.seed), data_seed=int(rt.seed),
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=int(rt.train_micro_batch_size),
        gradient_accumulation_steps=int(rt.train_global_batch_size // rt.train_micro_batch_size),
        generation_batch_size=int(rt.sample_per_episode),
        num_iterations=1, num_train_epochs=1,
        max_steps=int(episodes * rt.sample_per_episode // rt.train_global_batch_size),
        num_generations=int(p.num_inference_per_prompt),
        max_completion_length=int(p.max_response_tokens_length),
        temperature=float(p.temperature), top_p=float(p.top_p), top_k=0 if p.top_k <= 0 else int(p.top_k),
        repetition_penalty=1.0,
        chat_template_kwargs={"enable_thinking": bool(p.enable_thinking)},
        shuffle_dataset=bool(rt.data_shuffle),
        learning_rate=float(opt.lr), lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", adam_beta1=float(opt.adam_beta1), adam_beta2=float(opt.adam_beta2),
        adam_epsilon=float(opt.adam_eps), weight_decay=float(opt.weight_decay),
        max_grad_norm=float(opt.clip_grad),
        beta=float(t.kl_coef), epsilon=float(t.neg_clip_ratio), epsilon_high=float(t.pos_clip_ratio),
        loss_type=LOSS_AGG[t.loss_agg_mode], scale_rewards=ADVANTAGES[t.advantage_estimator],
        mask_truncated_completions=False, delta=None,
        importance_sampling_level="sequence" if t.use_group_sequence_policy else "token", use_vllm=False,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, remove_unused_columns=False, log_completions=False,
    )


def shared_settings(cfg, trl: dict) -> dict[str, tuple]:
    """Each quantity both systems must agree on: ``name -> (chatlearn value, TRL value)``.

    The TRL side is read from ``trl`` (GRPOConfig keyword arguments, or the attributes of a built
    GRPOConfig as a dict, where steps_per_generation is filled in)."""
    rt, m = cfg.runtime_args, cfg.models
    p, t = m.policy, m.policy_trainer
    opt = t.optimizer
    micro = trl["per_device_train_batch_size"]
    spg = trl.get("steps_per_generation") or trl["generation_batch_size"] // micro
    return {
        "model": (t.load, trl.get("model")),
        "group size": (p.num_inference_per_prompt, trl["num_generations"]),
        "samples per generated batch": (rt.sample_per_episode, trl["generation_batch_size"]),
        "optimizer steps per generated batch": (rt.sample_per_episode // rt.train_global_batch_size
                                                * rt.num_training_epoch,
                                                spg * trl["num_iterations"] // trl["gradient_accumulation_steps"]),
        "samples per optimizer step": (rt.train_global_batch_size, micro * trl["gradient_accumulation_steps"]),
        "micro-batch": (t.train_micro_batch_size, micro),
        "max response tokens": (p.max_response_tokens_length, trl["max_completion_length"]),
        "temperature": (p.temperature, trl["temperature"]),
        "top_p": (p.top_p, trl["top_p"]),
        "top_k off": (p.top_k <= 0, trl["top_k"] in (0, None)),
        "prompts in file order": (not rt.data_shuffle, not trl["shuffle_dataset"]),
        "seed": (rt.seed, trl["seed"]),
        "learning rate": (opt.lr, trl["learning_rate"]),
        "adam betas/eps": ((opt.adam_beta1, opt.adam_beta2, opt.adam_eps),
                           (trl["adam_beta1"], trl["adam_beta2"], trl["adam_epsilon"])),
        "weight decay": (opt.weight_decay, trl["weight_decay"]),
        "grad clip": (opt.clip_grad, trl["max_grad_norm"]),
        "lr schedule": ((opt.lr_decay_style, opt.lr_warmup_iters, opt.lr_warmup_fraction),
                        (trl["lr_scheduler_type"], trl["warmup_steps"], 0.0)),
        "loss aggregation": (t.loss_agg_mode, {v: k for k, v in LOSS_AGG.items()}.get(trl["loss_type"])),
        "advantages": (t.advantage_estimator, {v: k for k, v in ADVANTAGES.items()}.get(trl["scale_rewards"])),
        "kl coefficient": (t.kl_coef, trl["beta"]),
        "kl estimator, as a loss term": ((t.kl_estimator, t.kl_in_reward), ("k3", False)),
        "sequence-level ratio": (t.use_group_sequence_policy, trl["importance_sampling_level"] == "sequence"),
        "dual clip / two-sided clip": (t.clip_ratio_c, trl["delta"]),
        "clip ratio (low, high)": ((t.neg_clip_ratio, t.pos_clip_ratio), (trl["epsilon"], trl["epsilon_high"])),
        "fp32": (not t.bf16 and p.dtype == "float32", not trl["bf16"] and not trl["fp16"]),
        "gradient checkpointing": (t.gradient_checkpointing, trl["gradient_checkpointing"]),
        "entropy bonus": (t.entropy_coef, 0.0),
    }


def mismatches(settings: dict[str, tuple]) -> list[str]:
    """Names of the shared settings whose two values differ (floats compared exactly)."""
    return [name for name, (a, b) in settings.items() if a != b]


# ---------------------------------------------------------------------------------------
# run order and medians
# ---------------------------------------------------------------------------------------

def run_order(systems: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repetition, system) pairs interleaved A B A B ...: every repetition runs each system once,
    in the given order, before the next repetition starts (drift of the machine hits all alike)."""
    return [(r, s) for r in range(repeats) for s in systems]


def median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def medians(runs: list[dict], keys: list[str]) -> dict:
    """Per key, the median over ``runs`` (missing values skipped)."""
    return {k: median([r.get(k) for r in runs]) for k in keys}


# ---------------------------------------------------------------------------------------
# steady-state throughput
# ---------------------------------------------------------------------------------------

def steady_rate(samples: list[float], tokens: list[float], seconds: list[float]) -> dict:
    """Throughput over steady-state steps: sum(samples) / sum(seconds), sum(tokens) / sum(seconds)."""
    total = sum(seconds)
    if not seconds or total <= 0:
        return {"samples_per_s": None, "tokens_per_s": None, "steady_steps": 0, "step_s": None}
    return {"samples_per_s": sum(samples) / total, "tokens_per_s": sum(tokens) / total,
            "steady_steps": len(seconds), "step_s": total / len(seconds)}


def chatlearn_steps(rows: list[dict], arrivals: dict[int, float], samples: int, warmup: int) -> dict:
    """chatlearn's steady state from its metrics rows.

    A step is an episode; warm-up episodes (1..warmup) and episodes that saved a checkpoint (the
    last, always) are left out. ``episode_*``: seconds from ``time/episode`` (the episode's own
    stages); ``wall_*``: seconds between the arrival of the previous row and this one in
    metrics.jsonl (``arrivals``: episode -> time the harness saw the row), which adds the
    per-episode logging, memory queries and anything else between episodes. Generated tokens =
    ``train/response_len_mean`` x samples.
    """
    steady = [r for r in rows if r.get("episode", 0) > warmup and "time/episode" in r
              and not r.get("time/checkpoint")]
    toks = [r["train/response_len_mean"] * samples for r in steady]
    out = {f"episode_{k}": v for k, v in
           steady_rate([samples] * len(steady), toks, [r["time/episode"] for r in steady]).items()}
    wall = [(r, arrivals[r["episode"]] - arrivals[r["episode"] - 1]) for r in steady
            if r["episode"] in arrivals and r["episode"] - 1 in arrivals]
    out.update({f"wall_{k}": v for k, v in steady_rate(
        [samples] * len(wall), [r["train/response_len_mean"] * samples for r, _ in wall],
        [s for _, s in wall]).items()})
    out["reward_last"] = _tail_mean([r["train/reward_mean"] for r in rows if "train/reward_mean" in r])
    out["response_len_mean"] = _tail_mean([r["train/response_len_mean"] for r in steady])
    return out


def trl_steps(step_ends: list[float], train_start: float, gens: list[dict], steps_per_gen: int,
              warmup: int) -> dict:
    """TRL's steady state: a step is one generated batch and its ``steps_per_gen`` optimizer steps.

    ``step_ends``: time of each optimizer step's end (a TrainerCallback's on_step_end);
    generated batch g spans from the end of batch g-1's last optimizer step (``train_start`` for
    g = 0) to the end of its own. ``gens``: per generated batch, ``samples``, ``tokens`` and
    ``reward_mean`` (recorded by the reward function, which TRL calls once per generated batch).
    Batches 0..warmup-1 and the last are left out: the same steps as chatlearn's (see
    ``chatlearn_steps``; batch g is episode g + 1).
    """
    n = min(len(gens), len(step_ends) // steps_per_gen)
    bounds = [train_start] + [step_ends[(g + 1) * steps_per_gen - 1] for g in range(n)]
    idx = list(range(warmup, n - 1))
    out = {f"wall_{k}": v for k, v in steady_rate(
        [gens[g]["samples"] for g in idx], [gens[g]["tokens"] for g in idx],
        [bounds[g + 1] - bounds[g] for g in idx]).items()}
    out["reward_last"] = _tail_mean([g["reward_mean"] for g in gens[:n]])
    out["response_len_mean"] = _tail_mean([gens[g]["tokens"] / gens[g]["samples"] for g in idx])
    return out


def chatlearn_startup(rows: list[dict]) -> dict[str, float]:
    """The start-up phases of a chatlearn run (its ``perf/startup/*`` metrics, seconds from the
    driver process's start; a model's own processes as ``<model>/process`` and ``<model>/build``)."""
    first = next((r for r in rows if "perf/startup/total_s" in r), {})
    prefix = "perf/startup/"
    return {k[len(prefix):-2]: v for k, v in first.items() if k.startswith(prefix) and k.endswith("_s")}


# the consecutive phases of both systems, in the order they run (chatlearn.logging.startup.PHASES; TRL's)
STARTUP_PHASES = ("imports", "config", "data", "ray", "models", "resume", "eval_before", "setup", "to_train",
                  "first_episode", "total")


def startup_order(keys) -> list[str]:
    """Start-up keys in running order: the phases, then each model's own (``<model>/...``) by name."""
    keys = set(keys)
    return [k for k in STARTUP_PHASES if k in keys] + sorted(k for k in keys if k not in STARTUP_PHASES)


def trl_startup(raw: dict, start: float) -> dict[str, float]:
    """TRL's start-up on the harness's clock (``start``: the process launched): ``imports`` (torch,
    transformers, TRL), ``setup`` (tokenizer, data, ``GRPOTrainer`` with the model), ``to_train``
    (``trainer.train`` up to its first callback), ``first_episode`` (the first generated batch and its
    optimizer steps)."""
    out = {"imports": raw["imports_done"] - start, "setup": raw["setup_done"] - raw["imports_done"],
           "to_train": raw["train_start"] - raw["setup_done"]}
    steps = raw["config"]["steps_per_generation"] // raw["config"]["gradient_accumulation_steps"]
    if len(raw["step_ends"]) >= steps:
        out["first_episode"] = raw["step_ends"][steps - 1] - raw["train_start"]
        out["total"] = raw["step_ends"][steps - 1] - start
    return out


def _tail_mean(values: list[float], last: int = 3) -> float | None:
    """Mean of the last ``last`` values (the "mean reward over the last steps")."""
    tail = values[-last:]
    return sum(tail) / len(tail) if tail else None


# ---------------------------------------------------------------------------------------
# chatlearn's episode breakdown
# ---------------------------------------------------------------------------------------

STAGES = ("generate", "ref_logprobs", "old_logprobs", "reward", "train", "checkpoint", "weight_push")
# parts of an episode that add up to time/episode (reward only where it outlasts the log-prob passes)
BREAKDOWN = ("generation", "logprobs", "reward_exposed", "training", "checkpoint", "weight_push", "transitions",
             "other")
SHOWN = ("generation", "logprobs", "reward", "reward_exposed", "training", "checkpoint", "weight_push",
         "transitions", "other", "episode", "overhead_share")


def transitions_by_stage(events: list[dict]) -> dict[tuple[int, str], float]:
    """Seconds of onload/offload transitions inside each (episode, stage) of a timeline.

    A stage's transitions run at its start (``Scheduler.ensure``) and are written before the
    stage's own event, so a transition belongs to the next stage event of its episode; the
    reward stage (CPU workers, no transitions) runs next to the log-prob passes and may be
    written in between, so it is skipped. Transitions after an episode's last stage event (the
    KV cache's onload after the weight push) belong to no stage."""
    out: dict[tuple[int, str], float] = {}
    pending: tuple[int, float] | None = None
    for e in events:
        ep = int(e["episode"])
        if pending is not None and pending[0] != ep:
            pending = None  # transitions after the episode's last stage
        if e.get("kind") == "transition":
            pending = (ep, (pending[1] if pending else 0.0) + float(e["seconds"]))
        elif e.get("kind") == "stage" and e["stage"] != "reward":
            key = (ep, e["stage"])
            out[key] = out.get(key, 0.0) + (pending[1] if pending else 0.0)
            pending = None
    return out


def episode_breakdown(row: dict, trans: dict[tuple[int, str], float]) -> dict:
    """One episode's ``time/episode`` split into parts that add up to it (seconds).

    A stage's part is its time (``time/<stage>``) minus the transitions inside it (log-probs =
    ref + old). The reward workers score while the log-prob passes run: ``reward`` is their time,
    ``reward_exposed`` = max(0, reward - log-prob passes) the part that adds to the episode.
    ``transitions`` = ``time/transitions``; ``other`` = the rest (advantages, batch slicing, Ray
    dispatch, metric collection). ``overhead_share`` = 1 - ``time/model_compute`` / time/episode:
    the run's own share of the episode when no model computed (``perf/overhead_share``).
    """
    ep, total = int(row["episode"]), float(row["time/episode"])
    t = {s: float(row.get(f"time/{s}") or 0.0) for s in STAGES}
    net = {s: t[s] - trans.get((ep, s), 0.0) for s in STAGES}
    parts = {"generation": net["generate"], "logprobs": net["ref_logprobs"] + net["old_logprobs"],
             "reward": t["reward"],
             "reward_exposed": max(0.0, t["reward"] - t["ref_logprobs"] - t["old_logprobs"]),
             "training": net["train"], "checkpoint": net["checkpoint"], "weight_push": net["weight_push"],
             "transitions": float(row.get("time/transitions") or 0.0)}
    parts["other"] = total - sum(parts[p] for p in BREAKDOWN if p != "other")
    parts["episode"] = total
    compute = row.get("time/model_compute")
    parts["overhead_share"] = None if compute is None or total <= 0 else 1.0 - float(compute) / total
    return parts


def mean_breakdown(rows: list[dict], events: list[dict], warmup: int) -> dict:
    """Mean breakdown over the steady-state episodes (same selection as ``chatlearn_steps``);
    the overhead share is of the summed times."""
    trans = transitions_by_stage(events)
    sel = [r for r in rows if r.get("episode", 0) > warmup and "time/episode" in r and not r.get("time/checkpoint")]
    if not sel:
        return {}
    steady = [episode_breakdown(r, trans) for r in sel]
    out = {k: sum(b[k] for b in steady) / len(steady) for k in SHOWN if k != "overhead_share"}
    compute = [r.get("time/model_compute") for r in sel]
    out["overhead_share"] = (None if None in compute
                             else 1.0 - sum(compute) / sum(float(r["time/episode"]) for r in sel))
    return out


# ---------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------

def _fmt(v, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def startup_lines(wl: dict) -> list[str]:
    """A workload's start-up table: per system its phases (medians, seconds), the first step done and
    what follows the last step (chatlearn: plots, Ray stopping; TRL: its teardown)."""
    startup = wl.get("startup") or {}
    if not any(startup.values()):
        return []
    lines = ["", "Start-up (medians, seconds; chatlearn's phases are its `perf/startup/*` metrics, docs/metrics.md, "
             "consecutive from its process's start; the model processes' own times overlap the `models` phase):", "",
             "| system | phases, in order | model processes (start / of which Ray's worker / build) "
             "| first step done | after the last step | run |", "| --- | --- | --- | --- | --- | --- |"]
    for system, phases in startup.items():
        med = wl.get("median", {}).get(system, {})
        text = ", ".join(f"{k.replace('_', ' ')} {_fmt(v, '.1f')}" for k, v in phases.items()
                         if "/" not in k and k != "total" and v is not None)
        models = {}
        for k, v in phases.items():
            if "/" in k and v is not None:
                name, part = k.split("/", 1)
                models.setdefault(name, {})[part] = v
        procs = "; ".join(f"{n} {_fmt(t.get('process'), '.1f')} / {_fmt(t.get('ray_worker'), '.1f')} / "
                          f"{_fmt(t.get('build'), '.1f')}" for n, t in models.items())
        lines.append(f"| {system} | {text} | {procs or 'n/a'} | {_fmt(med.get('first_step_done_s'), '.1f')} "
                     f"| {_fmt(med.get('after_last_step_s'), '.1f')} | {_fmt(med.get('wall_s'), '.1f')} |")
    return lines


def markdown(report: dict) -> str:
    """The results as markdown: per workload a system table and chatlearn's breakdown."""
    lines = [f"# chatlearn vs TRL GRPOTrainer ({report['machine']})", ""]
    lines.append(f"{report['repeats']} repetition(s) per system, run interleaved; medians shown. "
                 f"torch threads: {report['threads']}. A step is one generated batch and its optimizer steps; "
                 "throughput is over the steady steps (warm-up and last step left out), from wall-clock step "
                 "ends (TRL: a callback; chatlearn: each metrics.jsonl row's arrival). Memory: peak of the summed "
                 "RSS (and PSS) of every process of a run, Ray's included (bench/proc_memory.py). "
                 "Ratios: chatlearn / TRL.")
    for name, wl in report["workloads"].items():
        lines += ["", f"## {name}: {wl['description']}", ""]
        if wl.get("commit"):
            lines += [f"Measured at commit {wl['commit']}.", ""]
        lines.append("| system | samples/s | gen tokens/s | s per step | peak RSS sum (MB) | peak PSS sum (MB) "
                     "| reward (last 3) | first step done (s) | run (s) | samples/s vs TRL | PSS vs TRL "
                     "| first step vs TRL | whole command speed vs TRL |")
        lines.append("|" + " --- |" * 13)
        for system, med in wl.get("median", {}).items():
            r = wl["ratio_vs_trl"].get(system, {})
            lines.append(f"| {system} | {_fmt(med.get('samples_per_s'))} | {_fmt(med.get('tokens_per_s'), '.1f')} "
                         f"| {_fmt(med.get('step_s'))} | {_fmt(med.get('peak_rss_mb'), '.0f')} "
                         f"| {_fmt(med.get('peak_pss_mb'), '.0f')} | {_fmt(med.get('reward_last'), '.3f')} "
                         f"| {_fmt(med.get('first_step_done_s'), '.1f')} | {_fmt(med.get('wall_s'), '.1f')} "
                         f"| {_fmt(r.get('samples_per_s'))} | {_fmt(r.get('peak_pss_mb'))} "
                         f"| {_fmt(r.get('first_step_done_s'))} | {_fmt(r.get('whole_command_speed'))} |")
        lines += startup_lines(wl)
        if "trl_prompts_match_chatlearn" in wl:
            lines += ["", "TRL's prompts, episode by episode, tokenized with the chat template, equal chatlearn's: "
                      + ("yes" if wl["trl_prompts_match_chatlearn"] else "NO")]
        extra = [s for s, med in wl.get("median", {}).items() if med.get("episode_samples_per_s") is not None]
        if extra:
            lines.append("")
            lines.append("chatlearn samples/s from `time/episode` alone (stages only, no per-episode logging): "
                         + ", ".join(f"{s} {_fmt(wl['median'][s]['episode_samples_per_s'])}" for s in extra))
        for system, bd in wl.get("breakdown", {}).items():
            if not bd:
                continue
            lines += ["", f"{system} episode breakdown (median of per-run means over steady episodes, seconds):", ""]
            lines.append("| " + " | ".join(SHOWN).replace("_", " ") + " |")
            lines.append("|" + " --- |" * len(SHOWN))
            share = bd.get("overhead_share")
            lines.append("| " + " | ".join(_fmt(bd.get(k), ".3f") for k in SHOWN[:-1])
                         + f" | {_fmt(None if share is None else 100 * share, '.0f')}% |")
            lines.append("")
            lines.append("(reward runs during the log-prob passes; only `reward exposed` adds to the episode. "
                         "Overhead share: 1 - `time/model_compute` / `time/episode`.)")
    return "\n".join(lines) + "\n"


README_START = "<!-- bench/grpo_vs_trl.py --readme writes this table -->"
README_END = "<!-- end of the bench/grpo_vs_trl.py table -->"
SYSTEM_NAMES = {"chatlearn-vllm": "chatlearn, vLLM-CPU", "chatlearn-hf": "chatlearn, hf", "trl": "TRL"}


def readme_table(report: dict) -> str:
    """The README's table of ``report`` (bench/results/grpo_vs_trl.json): per workload and system the
    medians and the ratios to TRL (samples/s, peak PSS of the whole run, time to the first finished
    step: chatlearn / TRL; the whole command, start-up included, as a speed: TRL's seconds / chatlearn's)."""
    lines = ["| workload | system | samples/s | gen tokens/s | peak PSS (MB) | first step done (s) | whole command (s) "
             "| samples/s vs TRL | PSS vs TRL | first step vs TRL | whole command speed vs TRL |",
             "|" + " --- |" * 11]
    for name, wl in report["workloads"].items():
        for i, (system, med) in enumerate(wl.get("median", {}).items()):
            r = wl.get("ratio_vs_trl", {}).get(system, {})
            lines.append(
                f"| {name if i == 0 else ''} | {SYSTEM_NAMES.get(system, system)} | {_fmt(med.get('samples_per_s'))} "
                f"| {_fmt(med.get('tokens_per_s'), '.0f')} | {_fmt(med.get('peak_pss_mb'), '.0f')} "
                f"| {_fmt(med.get('first_step_done_s'), '.1f')} | {_fmt(med.get('wall_s'), '.1f')} "
                + ("| | | | |" if system == "trl" else
                   f"| {_fmt(r.get('samples_per_s'))} | {_fmt(r.get('peak_pss_mb'))} "
                   f"| {_fmt(r.get('first_step_done_s'))} | {_fmt(r.get('whole_command_speed'))} |"))
    return "\n".join(lines) + "\n"


def replace_readme_table(readme: str, table: str) -> str:
    """``readme`` with the text between the two table markers replaced by ``table``."""
    start, end = readme.index(README_START) + len(README_START), readme.index(README_END)
    return readme[:start] + "\n" + table + readme[end:]
