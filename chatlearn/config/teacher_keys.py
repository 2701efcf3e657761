"""The checks of a distillation teacher (``models.<name>: {kind: teacher, ...}``) and of the algorithms that read
one (``algorithm: opd``): one paragraph each, naming the key and the fix, before anything starts.

:func:`check_teacher` reads the keys alone (the algorithm and the teacher go together; the teacher's devices, batch
and backend); :func:`check_teacher_folder` reads the teacher's folder once its ``load`` is resolved: a causal LM
whose context holds the policy's longest sequence, with the student's tokenizer (the same vocabulary, token for
id) and chat template: the teacher scores the student's token ids as they are, so another tokenizer would score
other words (cross-tokenizer distillation is out of scope).
"""
from __future__ import annotations

import json
import os

from chatlearn.config.algorithms import declared
from chatlearn.config.checks import positive as _positive
from chatlearn.config.kinds import KINDS, TEACHER, models_of
from chatlearn.config.model_shapes import model_context_length
from chatlearn.errors import ConfigError

ALGORITHM_KEY = "models.policy_trainer.algorithm"


def check_teacher(cfg) -> None:
    """The algorithm's needed kinds are declared (``opd``: a teacher) and a teacher has an algorithm that reads it;
    the teacher's keys (devices, batch, backend)."""
    t = cfg.models.policy_trainer
    decl = declared(t.algorithm, t.advantage_estimator)
    teachers = models_of(cfg, TEACHER)
    for need in decl.needs:
        if KINDS[need].schema is not None and not models_of(cfg, KINDS[need]):
            raise ConfigError(
                f"is {t.algorithm!r}, which learns from a model of kind {need}, but the config declares none. Add "
                f"one, e.g. models.{need}: {{kind: {need}, load: path/to/model}} (a model with the student's "
                f"tokenizer; docs/config.md, \"Distillation\"), or train with another algorithm (grpo).",
                key=ALGORITHM_KEY)
    check_gkd_keys(cfg)
    for name in teachers:
        key = f"models.{name}"
        if "teacher" not in decl.needs:
            raise ConfigError(
                f"is a teacher, but algorithm {t.algorithm!r} reads no teacher, so it would start and never run. "
                f"Set {ALGORITHM_KEY}: opd (on-policy distillation) or gkd (generalized JSD), or remove {key}.", key=f"{key}.kind")
        s = cfg.models[name]
        if s.num_gpu < 1:
            raise ConfigError("must be at least 1 (a logical device on a machine without a GPU); name the teacher "
                              "in runtime_args.colocation to let it take turns with the other models.",
                              key=f"{key}.num_gpu")
        if s.gpu_per_process not in (None, 1):
            raise ConfigError("must be 1: each Ray actor of the teacher drives one device.", key=f"{key}.gpu_per_process")
        _positive(s.generation_batch_size, f"{key}.generation_batch_size")
        _positive(s.logprob_chunk_tokens, f"{key}.logprob_chunk_tokens")
        if s.packing:
            _positive(s.max_token_in_packing, f"{key}.max_token_in_packing")
        if cfg.runtime_args.train_backend != "fsdp" and t.algorithm == "gkd":
            raise ConfigError(
                f"is {cfg.runtime_args.train_backend!r}, but algorithm: gkd trains on the teacher's top-k or whole "
                "distribution, which the Megatron trainer's loss does not take yet (its teacher pass gives the "
                "sampled tokens' log-probs and the argmax over the tensor-parallel ranks, what algorithm: opd "
                "needs). Use train_backend: fsdp for gkd, or algorithm: opd on Megatron.",
                key="runtime_args.train_backend")


# the keys of algorithm: gkd, each read by it alone
GKD_KEYS = ("gkd_beta", "gkd_temperature", "distill_topk", "gkd_lambda")
GKD_DEFAULTS = {"gkd_beta": 0.5, "gkd_temperature": 1.0, "distill_topk": None, "gkd_lambda": 1.0}


def check_gkd_keys(cfg) -> None:
    """``algorithm: gkd``'s keys: ``gkd_beta`` in [0, 1], ``gkd_temperature`` > 0, ``distill_topk`` null or
    >= 1; set away from their defaults under another algorithm, they would not act: refused."""
    t = cfg.models.policy_trainer
    key = "models.policy_trainer"
    if t.algorithm != "gkd":
        for name in GKD_KEYS:
            if getattr(t, name) != GKD_DEFAULTS[name]:
                raise ConfigError(
                    f"is set, but only algorithm: gkd reads it (the algorithm is {t.algorithm!r}), so it would not "
                    f"act. Set {ALGORITHM_KEY}: gkd, or remove {key}.{name}.", key=f"{key}.{name}")
        return
    for name in ("kl_coef", "entropy_coef", "filter_equal_groups"):
        if getattr(t, name) > 0:
            raise ConfigError(f"is {getattr(t, name)}, but algorithm gkd's loss is the generalized JSD to the "
                              "teacher alone (no reference model, no entropy bonus, no advantages), so it would not "
                              "act. Set it to 0 (False).", key=f"{key}.{name}")
    if t.distill_coef != 1.0:
        raise ConfigError(f"is {t.distill_coef}, but only algorithm: opd reads it (the weight of its reverse-KL "
                          "advantage); gkd trains on the divergence alone, so it would not act. Remove it.",
                          key=f"{key}.distill_coef")
    if not 0.0 <= t.gkd_beta <= 1.0:
        raise ConfigError(f"is {t.gkd_beta}: the generalized JSD's beta is in [0, 1] (0: forward KL from the "
                          "teacher, 1: reverse KL from the student, 0.5: the symmetric JSD).", key=f"{key}.gkd_beta")
    if not t.gkd_temperature > 0:
        raise ConfigError(f"is {t.gkd_temperature}: the temperature both distributions are taken at must be > 0.",
                          key=f"{key}.gkd_temperature")
    if t.distill_topk is not None and t.distill_topk < 1:
        raise ConfigError(f"is {t.distill_topk}: the teacher's most likely tokens kept per position, at least 1, "
                          "or null for the whole vocabulary.", key=f"{key}.distill_topk")
    check_gkd_lambda(cfg)


def needs_responses(cfg) -> bool:
    """Whether the training prompts must carry reference responses: ``algorithm: gkd`` with ``gkd_lambda`` < 1."""
    t = cfg.models.policy_trainer
    return t.algorithm == "gkd" and t.gkd_lambda < 1.0


def check_gkd_lambda(cfg) -> None:
    """``gkd_lambda`` in [0, 1]; below 1 (some episodes train on the dataset's responses) not with what builds a
    batch otherwise: a multi-turn environment, dynamic sampling."""
    t, key = cfg.models.policy_trainer, "models.policy_trainer.gkd_lambda"
    if not 0.0 <= t.gkd_lambda <= 1.0:
        raise ConfigError(f"is {t.gkd_lambda}: the share of episodes trained on the student's own samples is in "
                          "[0, 1] (1: every episode, TRL's lmbda; 0: the dataset's responses only).", key=key)
    if t.gkd_lambda == 1.0:
        return
    if cfg.models.policy.multi_turn.environment is not None:
        raise ConfigError(f"is {t.gkd_lambda}, but the rollout is multi-turn (models.policy.multi_turn.environment): "
                          "a dataset response is one assistant message, not a trajectory with an environment's "
                          "turns. Set it to 1 (the student's trajectories only), or drop the environment.", key=key)
    if cfg.runtime_args.dynamic_sampling:
        raise ConfigError(f"is {t.gkd_lambda}, but runtime_args.dynamic_sampling samples more groups by their "
                          "rewards, which an episode of the dataset's responses does not sample. Set it to 1, or "
                          "turn dynamic_sampling off (gkd reads no advantages).", key=key)


def check_teacher_folder(cfg, name: str, longest: int) -> None:
    """Teacher ``name``'s ``load`` (a resolved local folder): a context of at least ``longest`` tokens (the policy's
    prompt + response), the student's vocabulary and chat template (the policy's model folder)."""
    s, key = cfg.models[name], f"models.{name}.load"
    student = cfg.models.policy.load
    limit = model_context_length(s.load)
    if limit is not None and limit < longest:
        raise ConfigError(
            f"the teacher takes {limit} tokens ({s.load}/config.json), fewer than the policy's longest prompt + "
            f"response ({longest} tokens, models.policy): it scores every sample whole. Use a teacher with a "
            "longer context, or lower models.policy.max_prompt_tokens_length / max_response_tokens_length.", key=key)
    with open(os.path.join(s.load, "config.json"), encoding="utf-8") as f:
        archs = json.load(f).get("architectures") or []
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise ConfigError(f"{s.load!r} is not a causal language model: its config.json declares {archs}, and a "
                          "teacher gives next-token log-probs (an LM head). Point it at a *ForCausalLM model.",
                          key=key)
    mine, theirs = _tokenizer(s.load, s.trust_remote_code, key), _tokenizer(
        student, cfg.models.policy.trust_remote_code, "models.policy.load")
    a, b = mine.get_vocab(), theirs.get_vocab()
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
        raise ConfigError(
            f"the teacher's tokenizer ({s.load}, {len(a)} tokens) differs from the student's ({student}, {len(b)} "
            f"tokens; e.g. {', '.join(f'{tok!r}: {i}' for tok, i in differ)}): the teacher scores the student's "
            "token ids as they are, so it would score other text. Use a teacher with the student's tokenizer (the "
            "same model family), or copy the student's tokenizer files into the teacher's folder if they encode "
            "the same text; cross-tokenizer distillation is not supported.", key=key)
    if (mine.chat_template or None) != (theirs.chat_template or None):
        raise ConfigError(
            f"the teacher's chat template ({s.load}) differs from the student's ({student}): the prompts are "
            "rendered with the student's, which the teacher was not trained on, so its log-probs would score an "
            "unfamiliar format. Use a teacher with the student's chat template (tokenizer_config.json / "
            "chat_template.jinja).", key=key)


def _tokenizer(folder: str, trust_remote_code: bool, key: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - any failure to load is the user's folder
        raise ConfigError(f"the tokenizer in {folder!r} does not load ({type(err).__name__}: {err}). Add its "
                          "tokenizer files to the folder.", key=key) from None
