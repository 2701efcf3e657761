"""Supervised fine-tuning: ``chatlearn sft CONFIG [overrides]``.

The same config (schema, loading, validation), the same policy trainer (FSDP2 or Megatron, LoRA, packing,
micro-batches, its checkpoints), the same cluster (or, for one FSDP rank, no Ray: the trainer in this
process), metric sinks and console; no rollout engine and no reward during training. A step:

1. the sampler (seeded, a new order every epoch: ``sft.shuffle``) draws ``sft.global_batch_size``
   conversations (:mod:`chatlearn.data.sft`: tokens, ``prompt_lens`` at the first assistant token,
   ``loss_mask`` on every assistant turn);
2. the trainer's ``train_sft`` runs them in micro-batches (``train_micro_batch_size`` samples, or
   ``max_token_in_packing`` tokens with packing) and takes one optimizer step on the token mean of -log p over
   all the step's assistant tokens (:class:`chatlearn.algorithms.sft.SFTLoss`);
3. every ``sft.eval_interval`` steps (and at the start and the end) the loss on ``sft.eval_data_path``; every
   ``sft.save_interval`` steps (and the last) a checkpoint: the trainer's sharded state (weights, optimizer,
   RNG) and the sampler's position, committed after the step's metrics row, so that a run killed at any point
   resumes from the last checkpoint exactly as if it had not stopped.

At the end, ``<output_dir>/result`` holds the Hugging Face folder of the fine-tuned model (LoRA: merged), which
``chatlearn run`` loads as ``models.policy_trainer.load``; with ``sft.eval_reward`` and
``runtime_args.eval_data_path`` the task reward of the model before and after is sampled with the rollout
engine (``chatlearn eval``'s machinery) into ``<output_dir>/eval_before`` and ``<output_dir>/eval``.

Why a command of its own rather than an algorithm of ``chatlearn run``: the episode engine is built around a
rollout (generate, score, passes, advantages, weight push, the scheduler's turns between the rollout engine and
the trainer); SFT has none of these, and what it shares with RL (config, trainer, cluster, checkpoints,
metrics) is reused here as is.
"""
from __future__ import annotations

import os
import time

from omegaconf import DictConfig

from chatlearn.algorithms.sft import sft_nll
from chatlearn.calls import put
from chatlearn.checkpoint.manager import CheckpointManager
from chatlearn.config.algorithm_keys import validate_algorithm
from chatlearn.config.load import load_config
from chatlearn.config.plan import make_sft_plan
from chatlearn.data.dataset import PromptSampler, load_tokenizer
from chatlearn.data.sft import OVERLONG, SFTSet, load_sft
from chatlearn.errors import ConfigError, UserError
from chatlearn.logging.console import info
from chatlearn.logging.progress import RunProgress
from chatlearn.logging.sinks import MetricSinks, config_yaml
from chatlearn.runtime.cluster.cluster import Cluster
from chatlearn.runtime.driver.evaluate import evaluate_model
from chatlearn.runtime.rundir.lock import RunLock
from chatlearn.runtime.rundir.output_dir import move_aside, previous_run, refusal

# RL's required keys, which chatlearn sft does not read: set for it unless the config sets them
# (runtime_args.data_path: RL's prompts, e.g. those of chatlearn run after SFT)
SFT_DEFAULTS = ("runtime_args.data_path=${sft.data_path}", "runtime_args.num_episode=1",
                "runtime_args.sample_per_episode=${sft.global_batch_size}",
                "runtime_args.train_global_batch_size=${sft.global_batch_size}",
                "runtime_args.enable_eval_before_training=false", "runtime_args.eval_episode_interval=0")
RESULT = "result"  # <output_dir>/result: the fine-tuned model, a Hugging Face folder
EVAL_CHUNK = 256  # eval conversations per log-prob call


def load_sft_config(path: str, overrides) -> DictConfig:
    """The config of ``chatlearn sft``: :func:`chatlearn.config.load.load_config` with :data:`SFT_DEFAULTS`; an
    unset ``sft.data_path`` (which RL's ``runtime_args.data_path`` follows by default) is named as such."""
    try:
        return load_config(path, overrides, defaults=SFT_DEFAULTS, sft=True)
    except ConfigError as err:
        if err.key == "runtime_args.data_path" and "${sft.data_path}" in err.message:
            raise ConfigError(NO_DATA, key="sft.data_path") from None
        raise


NO_DATA = ("is not set: chatlearn sft trains on conversations (JSONL/parquet files whose rows hold "
           "messages: [{role, content}, ...], or a Hub dataset id). Set it.")


def check_sft(cfg: DictConfig) -> None:
    """The ``sft`` keys: what ``chatlearn sft`` needs set, and their ranges."""
    s = cfg.sft
    if not s.data_path:
        raise ConfigError(NO_DATA, key="sft.data_path")
    if s.overlong not in OVERLONG:
        raise ConfigError(f"is {s.overlong!r}; one of {', '.join(OVERLONG)}.", key="sft.overlong")
    for key in ("max_seq_len", "num_epochs", "global_batch_size"):
        if s[key] < 1:
            raise ConfigError(f"is {s[key]}; it must be at least 1.", key=f"sft.{key}")
    if s.max_steps is not None and s.max_steps < 1:
        raise ConfigError(f"is {s.max_steps}; set a positive number of steps, or null (num_epochs decides).",
                          key="sft.max_steps")
    for key in ("eval_interval", "save_interval"):
        if s[key] < 0:
            raise ConfigError(f"is {s[key]}; set N > 0 (every N steps) or 0 (the last step only).", key=f"sft.{key}")


def load_data(cfg: DictConfig, tokenizer) -> tuple[SFTSet, SFTSet | None]:
    s = cfg.sft
    common = dict(messages_key=s.messages_key, max_seq_len=s.max_seq_len, overlong=s.overlong)
    train = load_sft(s.data_path, tokenizer, what="sft.data_path", split=s.data_split, **common)
    ev = (load_sft(s.eval_data_path, tokenizer, what="sft.eval_data_path", split=s.eval_data_split, **common)
          if s.eval_data_path else None)
    for name, data in (("train", train), ("eval", ev)):
        if data is not None:
            info(f"sft {name} data: {len(data)} conversations, {data.loss_tokens} assistant tokens"
                 + (f" ({data.truncated} truncated to sft.max_seq_len)" if data.truncated else "")
                 + (f" ({data.dropped} dropped)" if data.dropped else ""))
    if len(train) < s.global_batch_size:
        raise ConfigError(f"is {s.global_batch_size}, more than the {len(train)} conversations of sft.data_path: a "
                          "step would repeat them. Lower it, or add data.", key="sft.global_batch_size")
    return train, ev


def total_steps(cfg: DictConfig, train: SFTSet) -> int:
    s = cfg.sft
    return s.max_steps or max(1, len(train) * s.num_epochs // s.global_batch_size)


class SFTRun:
    """The training loop of ``chatlearn sft`` over a created policy trainer ``group``."""

    def __init__(self, cfg: DictConfig, group, train: SFTSet, ev: SFTSet | None, steps: int, dp: int):
        self.cfg, self.group, self.train, self.ev, self.steps, self.dp = cfg, group, train, ev, steps, dp
        rt = cfg.runtime_args
        self.out = rt.output_dir
        self.sampler = PromptSampler(len(train), shuffle=cfg.sft.shuffle, seed=rt.seed)
        self.ckpt = CheckpointManager(os.path.join(self.out, "checkpoints"), rt.keep_last_checkpoints)
        self.metrics = MetricSinks(cfg)
        self.progress = RunProgress(steps)
        self.config_text = config_yaml(cfg)

    def resume(self) -> int:
        """The step of the newest complete checkpoint, its state loaded (0: none, a fresh start)."""
        if not self.cfg.runtime_args.enable_resume_training:
            return 0
        found = self.ckpt.latest_usable(warn=info)
        if found is None:
            return 0
        step, path = found
        state = self.ckpt.read_state(path)
        self.ckpt.adopt(state)
        info(f"resuming from {path} (step {step})")
        self.group.call("load_checkpoint", os.path.abspath(os.path.join(path, "trainer")))
        self.sampler.load_state_dict(state["sampler"])
        self.metrics.truncate_after(step)
        return step

    def eval_loss(self) -> dict:
        """``sft/eval_loss``: the token mean of -log p over the eval conversations' assistant tokens (the first
        multiple of the data-parallel size of them: each rank takes an equal share)."""
        if self.ev is None:
            return {}
        n = len(self.ev) // self.dp * self.dp
        chunk = max(self.dp, EVAL_CHUNK // self.dp * self.dp)
        total, count = 0.0, 0
        for lo in range(0, n, chunk):
            batch = self.ev.batch(range(lo, min(n, lo + chunk)))
            outs, _ = self.group.call("compute_logprobs", put(batch), 1.0)
            nll, k = sft_nll(outs[0], batch)
            total, count = total + nll, count + k
        return {"sft/eval_loss": total / max(count, 1)}

    def step(self, step: int) -> dict:
        start = time.perf_counter()
        batch = self.train.batch(self.sampler.next(self.cfg.sft.global_batch_size))
        self.progress.stage("train", f"step {step}/{self.steps}")
        outs, _ = self.group.call("train_sft", put(batch))
        seconds = time.perf_counter() - start
        out = {f"sft/{k}": float(v) for k, v in outs[0].items()}
        out.update({"sft/epoch": self.sampler.epoch + self.sampler.pos / len(self.train), "time/step": seconds,
                    "sft/tokens_per_s": float(len(batch["tokens"])) / seconds})
        return out

    def due(self, step: int, interval: int) -> bool:
        return step == self.steps or (interval > 0 and step % interval == 0)

    def save(self, step: int) -> None:
        def write(tmp: str) -> None:
            self.group.call("save_checkpoint", os.path.abspath(os.path.join(tmp, "trainer")))

        self.ckpt.save(step, write, {"sampler": self.sampler.state_dict()}, config_text=self.config_text)

    def loop(self) -> dict:
        s = self.cfg.sft
        start = self.resume()
        last: dict = {}
        if start == 0 and self.ev is not None:
            last = self.eval_loss()
            self.metrics.write(0, last)
            info(f"step 0: eval loss {last['sft/eval_loss']:.4f}")
        for step in range(start + 1, self.steps + 1):
            self.progress.begin(step)
            metrics = self.step(step)
            if self.due(step, s.eval_interval):
                metrics.update(self.eval_loss())
            self.metrics.write(step, metrics)
            if self.due(step, s.save_interval):
                self.save(step)
            ev = f" | eval loss {metrics['sft/eval_loss']:.4f}" if "sft/eval_loss" in metrics else ""
            self.progress.finish(step, f"step {step}/{self.steps}: loss {metrics['sft/loss']:.4f} | grad norm "
                                       f"{metrics['sft/grad_norm']:.3f} | lr {metrics['sft/lr']:.2e}{ev}")
            last = metrics
        self.progress.close()
        self.metrics.close()
        return last


def prepare_output(cfg: DictConfig, lock: RunLock, overwrite: bool) -> None:
    """A fresh start refuses a folder that holds a run (unless ``overwrite``: it is moved aside)."""
    out = cfg.runtime_args.output_dir
    if cfg.runtime_args.enable_resume_training:
        return
    found = previous_run(out)
    if found and not overwrite:
        raise refusal(out, found)
    if found:
        info(f"--overwrite: moved the previous run in {out} to {move_aside(cfg, lock)}")


def run_sft(cfg: DictConfig, *, overwrite: bool = False) -> dict:
    """``chatlearn sft``: see the module docstring. Returns the last step's metrics and the reward evaluations."""
    check_sft(cfg)
    rt, t = cfg.runtime_args, cfg.models.policy_trainer
    tokenizer = load_tokenizer(t.load, trust_remote_code=t.trust_remote_code, key="models.policy_trainer.load")
    train, ev = load_data(cfg, tokenizer)
    steps = total_steps(cfg, train)
    plan = make_sft_plan(cfg, steps)
    validate_algorithm(cfg, steps)  # the learning-rate schedule over SFT's steps
    reward = cfg.sft.eval_reward and bool(rt.eval_data_path)
    if cfg.sft.eval_reward and not reward:
        info("sft.eval_reward: runtime_args.eval_data_path is not set, so the task reward is not sampled")
    result = os.path.abspath(os.path.join(rt.output_dir, RESULT))
    with RunLock(rt.output_dir) as lock:
        prepare_output(cfg, lock, overwrite)
        info(f"sft: {steps} steps of {cfg.sft.global_batch_size} conversations, {plan.trainer_dp} data-parallel "
             f"rank(s) of {rt.train_backend}")
        before = (evaluate_model(cfg, t.load, os.path.join(rt.output_dir, "eval_before"))
                  if reward and not os.path.isfile(os.path.join(rt.output_dir, "eval_before", "metrics.json"))
                  else {"all": {}})
        with Cluster(cfg, plan) as cluster:
            group = cluster.create("policy_trainer")
            last = SFTRun(cfg, group, train, ev, steps, plan.trainer_dp).loop()
            group.call("save_hf", result)
        info(f"the fine-tuned model: {result} (chatlearn run ... models.policy_trainer.load={result})")
        after = evaluate_model(cfg, result, os.path.join(rt.output_dir, "eval")) if reward else {"all": {}}
    if not last and not after["all"]:
        raise UserError("chatlearn sft took no step.")
    return {**last, **{f"eval_before/{k}": v for k, v in before["all"].items()},
            **{f"eval/{k}": v for k, v in after["all"].items()}}
