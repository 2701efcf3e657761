"""Evaluation-only runs: ``chatlearn eval CONFIG [overrides] [--checkpoint PATH]``.

Only the rollout engine and the reward workers are built. Every eval prompt is sampled
``eval_num_inference_per_prompt`` times with the ``eval_*`` sampling parameters; each sample is
written to ``<output_dir>/eval/samples.jsonl`` and the aggregate metrics, per data source and
overall, to ``<output_dir>/eval/metrics.json``, headed by what was evaluated: ``checkpoint`` (the
``--checkpoint`` path as given and its episode, for a run's checkpoint), ``model`` (the folder the
engine loaded) and ``model_deleted``.

Eval writes nothing outside ``<output_dir>/eval/``. A trainer checkpoint without ``hf/`` (a LoRA run's: its
adapters put onto their base model), and an adapter folder (peft's ``adapter_config.json``, onto the base it
names or ``--base``), are merged
into ``<output_dir>/eval/merged_model`` (on the storage the run's workers share, where the rollout
engine can load it), deleted once the evaluation ends, on an error or Ctrl-C too, unless asked to keep
it. A checkpoint whose save did not finish (no ``COMPLETE``) or that no longer matches its manifest is
refused before anything loads, and an earlier result in ``<output_dir>/eval/`` is refused unless
``overwrite`` is asked for, and then moved aside (``metrics.json.old-<time>``), never deleted.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from omegaconf import DictConfig, OmegaConf

from chatlearn.checkpoint.manager import MARKER, check_against_manifest
from chatlearn.config.kinds import JUDGE, REWARD_MODEL, kind_of, models_of, reward_model_settings
from chatlearn.config.load import check_data_paths, check_model_folder
from chatlearn.config.manifest import MANIFEST
from chatlearn.config.plan import make_eval_plan
from chatlearn.data.dataset import VisionData, load_prompts, load_tokenizer
from chatlearn.data.vision import image_names
from chatlearn.errors import UserError
from chatlearn.hub import looks_like_hub_id, snapshot
from chatlearn.logging.console import info, warn
from chatlearn.logging.jsonl import write_text_atomic
from chatlearn.runtime.cluster.cluster import Cluster
from chatlearn.runtime.driver.judges import Judges
from chatlearn.runtime.driver.multiturn import MultiTurnLoop, env_metrics, trajectory_fields
from chatlearn.runtime.driver.sampling import Prompts, Sampling
from chatlearn.runtime.rundir.preflight import check_output_folder


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


MERGED_MODEL = "merged_model"  # OUTPUT_DIR/eval/merged_model: a trainer checkpoint merged for the evaluation
RESULT_FILES = ("metrics.json", "samples.jsonl")
_RUN_CHECKPOINT = re.compile(r"^episode_\d+(\.tmp)?$")


@dataclass
class EvalModel:
    """What ``--checkpoint`` names: ``given`` as the user wrote it, ``folder`` the Hugging Face folder the
    rollout engine loads, ``episode`` the episode of a run's checkpoint (else None), ``merge_from`` the
    trainer checkpoint (or, ``adapter``, peft's adapter folder) to merge into ``folder`` first (None when
    ``folder`` exists already)."""

    given: str
    folder: str
    episode: int | None = None
    merge_from: str | None = None
    adapter: bool = False


def run_checkpoint(path: str) -> str | None:
    """The run's checkpoint folder (``checkpoints/episode_N``, or an unfinished ``episode_N.tmp``)
    that ``path`` is, or holds as its ``hf/`` or ``trainer/``; None for any other folder. One is known
    by its files (COMPLETE, manifest.json, state.json), or by its name with hf/ or trainer/ in it (a
    save cut short before those files)."""
    path = os.path.abspath(path)
    candidates = [path] + ([os.path.dirname(path)] if os.path.basename(path) in ("hf", "trainer") else [])
    for folder in candidates:
        if any(os.path.isfile(os.path.join(folder, name)) for name in (MARKER, MANIFEST, "state.json")):
            return folder
        if _RUN_CHECKPOINT.match(os.path.basename(folder)) and any(
                os.path.isdir(os.path.join(folder, name)) for name in ("hf", "trainer")):
            return folder
    return None


def check_complete(path: str, given: str) -> int | None:
    """A UserError in one paragraph, naming ``given`` (the ``--checkpoint`` as written), when ``path``
    (the part to read) is (in) a run's checkpoint whose save did not finish (no ``COMPLETE``, or still
    named ``.tmp``), or whose files do not match its manifest (only the files under ``path`` count).
    Returns that checkpoint's episode (None for a folder outside a run)."""
    folder = run_checkpoint(path)
    if folder is None:
        return None
    check_against_manifest(path, "--checkpoint")  # damage first: the more specific reason
    if not os.path.isfile(os.path.join(folder, MARKER)) or folder.endswith(".tmp"):
        why = (f"has no {MARKER} file (a checkpoint gets it last, once every file is written)"
               if not os.path.isfile(os.path.join(folder, MARKER)) else "is still named .tmp (never renamed)")
        raise UserError(f"--checkpoint {given!r} is incomplete: {folder!r} {why}, so its save was interrupted "
                        "(a crash, a kill, a full disk) or is still going on. Nothing was loaded. Evaluate a complete "
                        "checkpoint of the run (checkpoints/latest names the newest), or wait for the save to end.")
    return _episode(folder)


def _episode(folder: str) -> int | None:
    """The episode of the run's checkpoint ``folder``: its state.json's, else the one in its name."""
    try:
        with open(os.path.join(folder, "state.json"), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = None
    if isinstance(state, dict) and "episode" in state and isinstance(state["episode"], int):
        return state["episode"]
    digits = re.findall(r"\d+", os.path.basename(folder))
    return int(digits[-1]) if digits else None


def resolve_model(path: str, merged_dir: str = MERGED_MODEL) -> EvalModel:
    """What to evaluate for ``--checkpoint path``: a model folder, peft's adapter folder (``adapter_config.json``:
    merged onto its base into ``merged_dir``), a run's checkpoint (its ``hf/``, or its ``trainer/`` to merge
    into ``merged_dir``), a sharded trainer checkpoint (merged into ``merged_dir``), or a Hugging Face Hub
    model id (resolved into the Hugging Face cache). Checks only, writes nothing: an incomplete or damaged
    checkpoint is refused here, before anything loads."""
    from chatlearn.checkpoint.adapters import ADAPTER_CONFIG

    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):  # before config.json: some adapter folders hold one
        return EvalModel(path, os.path.abspath(merged_dir), check_complete(path, path), merge_from=path, adapter=True)
    if looks_like_hub_id(path):
        found = snapshot(path, key="--checkpoint", local_hint="a local model folder or a run's checkpoint").path
        return EvalModel(path, found)
    for folder in (path, os.path.join(path, "hf")):
        if os.path.isfile(os.path.join(folder, "config.json")):  # a model folder, or a checkpoint's hf/
            episode = check_complete(folder, path)
            check_policy_folder(folder, path)
            return EvalModel(path, folder, episode)
    if os.path.isdir(os.path.join(path, "trainer")) or os.path.isfile(os.path.join(path, ".metadata")) or (
            os.path.isdir(path) and run_checkpoint(path) is not None):
        from chatlearn.checkpoint.merge import find_checkpoint

        ckpt = find_checkpoint(path)
        episode = check_complete(ckpt, path)
        check_policy_checkpoint(ckpt, path)
        return EvalModel(path, os.path.abspath(merged_dir), episode, merge_from=ckpt)
    raise UserError(f"--checkpoint {path!r} is neither a Hugging Face model folder (config.json), a run's "
                    "checkpoint folder (checkpoints/episode_N with hf/ or trainer/), nor a sharded trainer "
                    "checkpoint. Point it at one of those.")


def check_scored_without_models(cfg: DictConfig) -> None:
    """A UserError in one paragraph when the config's reward comes from reward models alone (every reward
    function of weight 0): chatlearn eval runs the reward functions only, so every sample would score 0."""
    names = models_of(cfg, REWARD_MODEL)
    functions = cfg.models.reward.functions or []
    if not names or not functions or any(float(f.weight) != 0 for f in functions) or models_of(cfg, JUDGE):
        return  # (judges do score in chatlearn eval)
    models = ", ".join(f"{n} ({reward_model_settings(cfg, n).load})" for n in names)
    raise UserError(
        f"this config's reward comes from its reward model{'s' if len(names) > 1 else ''} {models}, and chatlearn eval "
        "does not run reward models: it scores with the reward functions alone, and every one of them "
        f"(models.reward.functions: {', '.join(f.name for f in functions)}) has weight 0, so every sample would "
        "score 0. Nothing was loaded. Give a reward function a weight for the evaluation (e.g. "
        "'models.reward.functions=[{name: math, path: \"builtin:math\", weight: 1.0}]'), or evaluate with a "
        "config whose reward functions score the task.")


def check_policy_checkpoint(ckpt: str, given: str) -> None:
    """A UserError in one paragraph when the sharded trainer checkpoint ``ckpt`` is not a policy's: a critic's
    (its metadata's ``role``) is a value model, which a rollout engine cannot sample from."""
    from chatlearn.checkpoint.sharded import META_FILE

    try:
        with open(os.path.join(ckpt, META_FILE), encoding="utf-8") as f:
            role = json.load(f).get("role")
    except (OSError, ValueError, AttributeError):
        return  # not readable here: the merge names what is wrong with it
    if role == "critic":
        raise UserError(f"--checkpoint {given!r} is the critic's checkpoint ({ckpt}: role critic in {META_FILE}), a "
                        "value model that scores tokens, not a policy that generates them, so chatlearn eval cannot "
                        "evaluate it. Nothing was loaded. Point --checkpoint at the policy's: the run's checkpoint "
                        "folder (checkpoints/episode_N) or its trainer/.")


def check_policy_folder(folder: str, given: str) -> None:
    """A UserError in one paragraph when the model folder ``folder`` holds a value or reward model (a
    token- or sequence-classification head in its config.json), which a rollout engine cannot sample from."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return  # loading the folder names what is wrong with it
    heads = [a for a in archs if str(a).endswith(("ForTokenClassification", "ForSequenceClassification"))]
    if heads:
        raise UserError(f"--checkpoint {given!r} holds a {heads[0]} ({folder}/config.json): a value model (a critic) or "
                        "a reward model, with a score head in place of a language-model head, so chatlearn eval "
                        "cannot generate with it. Nothing was loaded. Point --checkpoint at a policy: the run's "
                        "checkpoint folder (checkpoints/episode_N, its hf/ or trainer/) or a causal LM's folder.")


def check_no_result(out_dir: str, overwrite: bool) -> None:
    """A UserError in one paragraph when ``out_dir`` holds the result of an earlier evaluation (unless
    ``overwrite``): it is never replaced silently."""
    for name in RESULT_FILES:
        file = os.path.join(out_dir, name)
        if os.path.exists(file) and not overwrite:
            raise UserError(f"{file} already holds the result of an earlier evaluation, and chatlearn eval does not "
                            "overwrite it. Write this one to another folder (runtime_args.output_dir=NEW_FOLDER), "
                            f"or pass --overwrite to replace it (the earlier files are then kept as "
                            f"{name}.old-<time>, nothing is deleted).")


def keep_previous(out_dir: str) -> None:
    """An earlier result in ``out_dir`` (there only with ``overwrite``) moved aside, not deleted: each file
    to ``<name>.old-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... when taken), just before the new one is written."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in RESULT_FILES:
        file = os.path.join(out_dir, name)
        if not os.path.exists(file):
            continue
        target, n = f"{file}.old-{stamp}", 1
        while os.path.exists(target):
            n += 1
            target = f"{file}.old-{stamp}-{n}"
        os.replace(file, target)
        info(f"the earlier result {file} is moved to {target}")


def merge_for_eval(model: EvalModel, dtype: str, keep: bool, base: str | None = None) -> None:
    """The trainer checkpoint or adapter folder ``model.merge_from`` merged into ``model.folder`` (a leftover
    of an earlier, killed evaluation there is removed first), in the rollout engine's dtype when it names
    one (else float32; LoRA adapters: their base model's dtype). ``base`` (``--base``): LoRA adapters'
    base model folder, in place of the one they record."""
    from chatlearn.checkpoint.adapters import merge_adapter_folder
    from chatlearn.checkpoint.merge import DTYPES, merge_checkpoint

    remove_merged(model.folder)
    after = "kept after the evaluation" if keep else "deleted after the evaluation"
    what = "the adapter folder" if model.adapter else "the trainer checkpoint"
    info(f"merging {what} {model.merge_from} into {model.folder} ({after})")
    merge = merge_adapter_folder if model.adapter else merge_checkpoint
    kwargs = {} if model.adapter else {"merged": True}
    merge(model.merge_from, model.folder, dtype=dtype if dtype in DTYPES else None, base=base, **kwargs)


def remove_merged(folder: str) -> None:
    for path in (folder, folder + ".partial"):
        shutil.rmtree(path, ignore_errors=True)


class Evaluator:
    """Samples and scores an evaluation set with the rollout engine and the reward workers alone."""

    def __init__(self, cfg: DictConfig, cluster: Cluster, tokenizer, multi_turn: MultiTurnLoop | None = None):
        self.cfg, self.tokenizer = cfg, tokenizer
        judges = models_of(cfg, JUDGE)
        placed = [n for n in judges if not kind_of(cfg, n).served]  # a served judge has no workers
        cluster.prestart(["policy", "reward", *placed])
        policy = cluster.create("policy")
        self.sampling = Sampling(cfg, tokenizer, policy, cluster.create("reward"), cluster.specs["reward"], multi_turn)
        # each judge on devices of its own: nothing to move between turns
        self.judges = Judges(cfg, judges, {n: cluster.create(n) for n in placed}, self.sampling,
                             _OwnDevices())

    def judged(self, batch: dict, prompts: Prompts, rewards: np.ndarray, parts: dict) -> tuple[np.ndarray, dict]:
        """The judges' weighted scores added to ``rewards`` (not whitened: an evaluation's), each judge's raw score
        in ``parts`` as ``<name>/score``; and the judges' metrics (``judge/<name>/*``)."""
        scores, metrics = self.judges.score_all(batch, prompts)
        rewards = np.asarray(rewards, np.float64)
        for name, raw in scores.items():
            rewards = rewards + self.judges.settings[name].weight * raw
            parts[f"{name}/score"] = raw
        return rewards.astype(np.float32), metrics

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
        judge_metrics = {}
        if self.judges:
            rewards, judge_metrics = self.judged(batch, prompts, rewards, reward_parts)
        correct = self.correct(rewards, reward_parts)
        resp_lens = (batch["offsets"][1:] - batch["offsets"][:-1]) - batch["prompt_lens"]
        truncated = batch["finish_reasons"] == 0
        prompt_texts = self.tokenizer.batch_decode(prompt_set.prompt_ids, skip_special_tokens=False)
        samples = [{"prompt": prompt_texts[i // k], "response": texts[i], "reward": float(rewards[i]),
                    "ground_truth": truths[i], "data_source": sources[i], "sample_index": i % k,
                    "response_tokens": int(resp_lens[i]), "truncated": bool(truncated[i]),
                    "reward_parts": {key: float(v[i]) for key, v in reward_parts.items()},
                    **trajectory_fields(self.tokenizer, batch, i),
                    **({"images": image_names(prompts.images[i])} if prompts.images is not None else {})}
                   for i in range(len(texts))]
        metrics = aggregate(rewards, correct, resp_lens, truncated, sources, k)
        metrics["all"].update({f"reward/{key}": float(v.mean()) for key, v in reward_parts.items()})
        metrics["all"].update(judge_metrics)
        metrics["all"].update({k.split("/", 1)[1]: v for k, v in env_metrics(batch, prefix="eval").items()})
        return samples, metrics


class _OwnDevices:
    """The scheduler of an evaluation's judges: each on devices of its own, its turn needs no move."""

    def take_turn(self, name: str) -> None:
        return None


def evaluate_only(cfg: DictConfig, checkpoint: str | None = None, *, overwrite: bool = False,
                  keep_merged: bool = False, base: str | None = None) -> dict:
    """Evaluate ``models.policy.load``, or ``checkpoint`` (``--checkpoint``) in its place, into
    ``<output_dir>/eval/``. An earlier result there is refused unless ``overwrite`` (``--overwrite``: it is
    then moved aside). A
    trainer checkpoint is merged into ``<output_dir>/eval/merged_model``, deleted afterwards (also on an
    error or Ctrl-C) unless ``keep_merged`` (``--keep-merged``): eval writes nothing outside its folder. ``base``
    (``--base``): the base model of LoRA adapters that are merged (an adapter folder, a LoRA checkpoint)."""
    rt = cfg.runtime_args
    if not rt.eval_data_path:
        raise UserError("runtime_args.eval_data_path: is not set; chatlearn eval needs the data to evaluate. Set it.")
    eval_data = check_data_paths(rt.eval_data_path, "runtime_args.eval_data_path", subset=rt.eval_data_subset,
                                 split=rt.eval_data_split)
    check_scored_without_models(cfg)
    out_dir = os.path.join(rt.output_dir, "eval")
    check_output_folder("runtime_args.output_dir", rt.output_dir, ("eval", os.path.join("eval", MERGED_MODEL)))
    check_no_result(out_dir, overwrite)
    model = resolve_model(checkpoint, os.path.join(out_dir, MERGED_MODEL)) if checkpoint else None
    merged = model is not None and model.merge_from is not None
    if base is not None and not merged:
        what = f"--checkpoint {checkpoint!r} is a whole model" if model is not None else "no --checkpoint is given"
        raise UserError(f"--base names the base model of LoRA adapters to merge, and {what}: there is nothing to put "
                        "onto it. Leave --base out, or pass --checkpoint with an adapter folder (adapter_config.json) "
                        "or a LoRA run's checkpoint.")
    try:
        if merged:
            merge_for_eval(model, cfg.models.policy.dtype, keep_merged, base)
        if model is not None:
            cfg = OmegaConf.merge(cfg, {"models": {"policy": {"load": model.folder}}})
        source = {"checkpoint": {"path": model.given, "episode": model.episode} if model is not None else None,
                  "model": cfg.models.policy.load, "model_deleted": merged and not keep_merged}
        return _evaluate(cfg, eval_data, out_dir, source)
    finally:
        if merged and not keep_merged:
            remove_merged(model.folder)
        elif merged:
            info(f"the merged model is kept in {model.folder}")


def evaluate_model(cfg: DictConfig, folder: str, out_dir: str) -> dict:
    """The task reward of the Hugging Face model folder ``folder`` on ``runtime_args.eval_data_path``, sampled and
    scored as ``chatlearn eval`` does, into ``out_dir`` (``chatlearn sft``: before and after fine-tuning). An
    earlier result there is moved aside."""
    rt = cfg.runtime_args
    eval_data = check_data_paths(rt.eval_data_path, "runtime_args.eval_data_path", subset=rt.eval_data_subset,
                                 split=rt.eval_data_split)
    check_scored_without_models(cfg)
    cfg = OmegaConf.merge(cfg, {"models": {"policy": {"load": folder}}})
    return _evaluate(cfg, eval_data, out_dir, {"checkpoint": None, "model": folder, "model_deleted": False})


def _evaluate(cfg: DictConfig, eval_data: str, out_dir: str, source: dict) -> dict:
    """Sample and score the evaluation set; ``source`` (what was evaluated) heads ``metrics.json``."""
    rt, p = cfg.runtime_args, cfg.models.policy
    check_model_folder(p.load, "models.policy.load")
    tokenizer = load_tokenizer(p.load, trust_remote_code=p.trust_remote_code, key="models.policy.load")
    multi_turn = MultiTurnLoop(cfg, tokenizer) if p.multi_turn.environment is not None else None
    prompt_set = load_prompts(eval_data.split(","), tokenizer, max_prompt_tokens=p.max_prompt_tokens_length,
                              enable_thinking=p.enable_thinking, prompt_key=rt.prompt_key,
                              ground_truth_key=rt.ground_truth_key, what="runtime_args.eval_data_path",
                              name=rt.eval_data_subset, split=rt.eval_data_split,
                              ground_truth_pattern=rt.ground_truth_pattern, prompt_instruction=rt.prompt_instruction,
                              tools=multi_turn.tool_schemas if multi_turn is not None else None,
                              vision=VisionData(p.load, p.max_images_per_prompt))
    if prompt_set.empty_truth_warning:
        warn(prompt_set.empty_truth_warning)
    k = p.eval_num_inference_per_prompt
    info(f"evaluating {p.load} on {len(prompt_set)} prompts x {k} samples")
    reward_models = models_of(cfg, REWARD_MODEL)
    if reward_models:
        info(f"the reward models ({', '.join(f'{n}: {reward_model_settings(cfg, n).load}' for n in reward_models)}) "
             "are not run by chatlearn eval: the rewards are the reward functions' (models.reward.functions)")
    # only the rollout engine (on its own devices) and the reward workers
    plan = make_eval_plan(cfg, len(prompt_set), k)
    with Cluster(cfg, plan) as cluster:
        samples, metrics = Evaluator(cfg, cluster, tokenizer, multi_turn).run(prompt_set, k)
    os.makedirs(out_dir, exist_ok=True)
    keep_previous(out_dir)
    # written whole or not at all: an interrupted eval leaves the previous files as they were
    write_text_atomic(os.path.join(out_dir, "samples.jsonl"), "".join(json.dumps(s) + "\n" for s in samples))
    write_text_atomic(os.path.join(out_dir, "metrics.json"),
                      json.dumps({**source, "samples_per_prompt": k, "metrics": metrics}, indent=1))
    for name, m in metrics.items():
        extra = f" | pass@{k} {m[f'pass@{k}']:.3f}" if k > 1 else ""
        info(f"eval {name}: reward {m['reward_mean']:.3f} | pass@1 {m['pass@1']:.3f}{extra} | "
             f"len {m['response_len_mean']:.1f} | truncated {m['truncated_frac']:.3f} | {m['num_prompts']} prompts",
             bare=True)
    info(f"samples in {out_dir}/samples.jsonl, metrics in {out_dir}/metrics.json")
    return metrics
