"""Evaluation-only runs: ``chatlearn eval CONFIG [overrides] [--checkpoint PATH]``.

Only the rollout engine and the reward workers are built. Every eval prompt is sampled
``eval_num_inference_per_prompt`` times with the ``eval_*`` sampling parameters; each sample is
written to ``<output_dir>/eval/samples.jsonl`` and the aggregate metrics, per data source and
overall, to ``<output_dir>/eval/metrics.json``.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from collections import defaultdict

import numpy as np
from omegaconf import DictConfig, OmegaConf

from chatlearn.config.load import check_data_paths, check_model_folder
from chatlearn.config.plan import make_eval_plan
from chatlearn.data.dataset import load_prompts, load_tokenizer
from chatlearn.errors import UserError
from chatlearn.logging.console import info
from chatlearn.logging.jsonl import write_text_atomic
from chatlearn.runtime.cluster.cluster import Cluster
from chatlearn.runtime.driver.multiturn import MultiTurnLoop, env_metrics, trajectory_fields
from chatlearn.runtime.driver.sampling import Prompts, Sampling


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with n samples of which c are correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def aggregate(rewards: np.ndarray, correct: np.ndarray, resp_lens: np.ndarray, truncated: np.ndarray,
              sources: list[str], k: int) -> dict:
    """Metrics over samples laid out prompt by prompt (k samples each), per data source and overall."""
    groups = defaultdict(list)
    for i in range(0, len(sources), k):
        groups[sources[i]].append(i)
    out = {}
    for name, starts in [("all", [i for v in groups.values() for i in v])] + sorted(groups.items()):
        idx = np.concatenate([np.arange(i, i + k) for i in starts])
        m = {"num_prompts": len(starts), "num_samples": int(len(idx)),
             "reward_mean": float(rewards[idx].mean()),
             "pass@1": float(np.mean([pass_at_k(k, int(correct[i:i + k].sum()), 1) for i in starts])),
             "response_len_mean": float(resp_lens[idx].mean()),
             "truncated_frac": float(truncated[idx].mean())}
        if k > 1:
            m[f"pass@{k}"] = float(np.mean([pass_at_k(k, int(correct[i:i + k].sum()), k) for i in starts]))
        out[name] = m
    return out


def resolve_model(path: str) -> str:
    """A Hugging Face folder to evaluate: a model folder, a run's checkpoint (its ``hf/``), the
    trainer's sharded checkpoint (merged into a temporary folder), or a Hugging Face Hub model id
    (resolved into the Hugging Face cache)."""
    from chatlearn.hub import looks_like_hub_id, snapshot

    if looks_like_hub_id(path):
        return snapshot(path, key="--checkpoint", local_hint="a local model folder or a run's checkpoint").path
    from chatlearn.checkpoint.manager import check_against_manifest

    if os.path.isfile(os.path.join(path, "config.json")):
        check_against_manifest(path, "--checkpoint")  # a run's checkpoints/episode_N/hf
        return path
    if os.path.isfile(os.path.join(path, "hf", "config.json")):
        check_against_manifest(os.path.join(path, "hf"), "--checkpoint")
        return os.path.join(path, "hf")
    if os.path.isdir(os.path.join(path, "trainer")) or os.path.isfile(os.path.join(path, ".metadata")):
        from chatlearn.checkpoint.merge import merge_checkpoint

        out = os.path.join(tempfile.mkdtemp(prefix="chatlearn_eval_"), "model")
        info(f"merging the sharded checkpoint {path} into {out}")
        merge_checkpoint(path, out)
        return out
    raise UserError(f"--checkpoint {path!r} is neither a Hugging Face model folder (config.json), a run's "
                    "checkpoint folder (checkpoints/episode_N with hf/ or trainer/), nor a sharded trainer "
                    "checkpoint. Point it at one of those.")


class Evaluator:
    """Samples and scores an evaluation set with the rollout engine and the reward workers alone."""

    def __init__(self, cfg: DictConfig, cluster: Cluster, tokenizer, multi_turn: MultiTurnLoop | None = None):
        self.cfg, self.tokenizer = cfg, tokenizer
        cluster.prestart(["policy", "reward"])
        policy = cluster.create("policy")
        self.sampling = Sampling(cfg, tokenizer, policy, cluster.create("reward"), cluster.specs["reward"], multi_turn)

    def correct(self, rewards: np.ndarray, parts: dict[str, np.ndarray]) -> np.ndarray:
        """Which samples count as solved for pass@k: the math reward's score equals
        ``correct_score`` when a math reward is configured (alone or among others); otherwise
        the combined reward is positive."""
        r = self.cfg.models.reward
        names = [f.name for f in r.functions if f.path == "builtin:math"] if r.functions else ["math"]
        if names and f"{names[0]}/score" in parts:
            return parts[f"{names[0]}/score"] >= r.correct_score
        return rewards > 0

    def run(self, prompt_set, k: int) -> tuple[list[dict], dict]:
        p = self.cfg.models.policy
        prompts = Prompts.of(prompt_set, range(len(prompt_set)), k)
        truths, sources = prompts.truths, prompts.sources
        batch = self.sampling.sample(prompts, self.sampling.params(eval_mode=True, seed=p.seed), "the evaluation set")
        texts = self.sampling.responses_text(batch)
        rewards, reward_parts = self.sampling.score(batch, truths, sources, prompts.extra, texts=texts,
                                           what="the evaluation set")
        correct = self.correct(rewards, reward_parts)
        resp_lens = (batch["offsets"][1:] - batch["offsets"][:-1]) - batch["prompt_lens"]
        truncated = batch["finish_reasons"] == 0
        prompt_texts = self.tokenizer.batch_decode(prompt_set.prompt_ids, skip_special_tokens=False)
        samples = [{"prompt": prompt_texts[i // k], "response": texts[i], "reward": float(rewards[i]),
                    "ground_truth": truths[i], "data_source": sources[i], "sample_index": i % k,
                    "response_tokens": int(resp_lens[i]), "truncated": bool(truncated[i]),
                    "reward_parts": {key: float(v[i]) for key, v in reward_parts.items()},
                    **trajectory_fields(self.tokenizer, batch, i)}
                   for i in range(len(texts))]
        metrics = aggregate(rewards, correct, resp_lens, truncated, sources, k)
        metrics["all"].update({f"reward/{key}": float(v.mean()) for key, v in reward_parts.items()})
        metrics["all"].update({k.split("/", 1)[1]: v for k, v in env_metrics(batch, prefix="eval").items()})
        return samples, metrics


def evaluate_only(cfg: DictConfig, checkpoint: str | None = None) -> dict:
    rt, p = cfg.runtime_args, cfg.models.policy
    if not rt.eval_data_path:
        raise UserError("runtime_args.eval_data_path: is not set; chatlearn eval needs the data to evaluate. Set it.")
    eval_data = check_data_paths(rt.eval_data_path, "runtime_args.eval_data_path", subset=rt.eval_data_subset,
                                 split=rt.eval_data_split)
    if checkpoint:
        cfg = OmegaConf.merge(cfg, {"models": {"policy": {"load": resolve_model(checkpoint)}}})
        p = cfg.models.policy
    check_model_folder(p.load, "models.policy.load")
    tokenizer = load_tokenizer(p.load, trust_remote_code=p.trust_remote_code, key="models.policy.load")
    multi_turn = MultiTurnLoop(cfg, tokenizer) if p.multi_turn.environment is not None else None
    prompt_set = load_prompts(eval_data.split(","), tokenizer, max_prompt_tokens=p.max_prompt_tokens_length,
                              enable_thinking=p.enable_thinking, prompt_key=rt.prompt_key,
                              ground_truth_key=rt.ground_truth_key, what="runtime_args.eval_data_path",
                              name=rt.eval_data_subset, split=rt.eval_data_split,
                              ground_truth_pattern=rt.ground_truth_pattern, prompt_instruction=rt.prompt_instruction,
                              tools=multi_turn.tool_schemas if multi_turn is not None else None)
    k = p.eval_num_inference_per_prompt
    info(f"evaluating {p.load} on {len(prompt_set)} prompts x {k} samples")
    if cfg.models.reward.load is not None:
        info(f"the reward model (models.reward.load: {cfg.models.reward.load}) is not run by chatlearn eval: the "
             "rewards are the reward functions' (models.reward.functions)")
    # only the rollout engine (on its own devices) and the reward workers
    plan = make_eval_plan(cfg, len(prompt_set), k)
    with Cluster(cfg, plan) as cluster:
        samples, metrics = Evaluator(cfg, cluster, tokenizer, multi_turn).run(prompt_set, k)
    out_dir = os.path.join(rt.output_dir, "eval")
    os.makedirs(out_dir, exist_ok=True)
    # written whole or not at all: an interrupted eval leaves the previous files as they were
    write_text_atomic(os.path.join(out_dir, "samples.jsonl"), "".join(json.dumps(s) + "\n" for s in samples))
    write_text_atomic(os.path.join(out_dir, "metrics.json"),
                  json.dumps({"model": p.load, "samples_per_prompt": k, "metrics": metrics}, indent=1))
    for name, m in metrics.items():
        extra = f" | pass@{k} {m[f'pass@{k}']:.3f}" if k > 1 else ""
        info(f"eval {name}: reward {m['reward_mean']:.3f} | pass@1 {m['pass@1']:.3f}{extra} | "
             f"len {m['response_len_mean']:.1f} | truncated {m['truncated_frac']:.3f} | {m['num_prompts']} prompts",
             bare=True)
    info(f"samples in {out_dir}/samples.jsonl, metrics in {out_dir}/metrics.json")
    return metrics
