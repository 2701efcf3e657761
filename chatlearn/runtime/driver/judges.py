"""The judges' turns: each model of kind ``judge`` gives every sample a verdict, on its devices.

For each sample the driver renders the judge's ``prompt_template`` (Jinja) with

    question   the prompt's last user message (a prompt given as text: that text)
    response   the response's text
    reference  the row's ground truth (``runtime_args.ground_truth_key``)

and sends it (as one user message) to the judge's workers (:class:`chatlearn.models.reward.judge.JudgeModel`),
each taking its turn in config order (the scheduler makes it resident, offloading what shares its devices); a
served judge (``endpoint`` set) is asked over HTTP from here instead
(:class:`chatlearn.models.reward.served_judge.ServedJudge`: no devices, no turn).
The verdict becomes a score through the judge's ``parser`` (:func:`parse_verdict`):

    last_number   the last number in the verdict, if within ``score_range``
    boxed         the number in the last ``\\boxed{}``, if within ``score_range``
    yes_no        1 when the verdict's first word is ``yes_word``, 0 when it is ``no_word``
    yes_prob      P(yes) / (P(yes) + P(no)) of the reply's first token (the judge's logits; nothing generated)
    module:function   the user's function of the verdict text, returning a float or None

A verdict the parser cannot read scores ``default_score`` and is counted (``<train|eval>/judge/<name>/unparsed``).
The scores join the reward as the reward models' do (:class:`chatlearn.runtime.driver.reward_models.RewardModels`:
weight, normalisation, metrics).
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Callable

import jinja2
import numpy as np

from chatlearn.calls import put

from chatlearn.config.judge_keys import BUILTIN_PARSERS, environment, served_inert_keys
from chatlearn.config.kinds import JUDGE, kind_of
from chatlearn.config.names import Stage
from chatlearn.config.reward_entries import load_object
from chatlearn.errors import UserError
from chatlearn.logging.console import warn
from chatlearn.models.reward.served_judge import ServedJudge, ServedJudgeSettings
from chatlearn.runtime.driver.reward_models import RewardModels

NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _in_range(value: float, options: dict) -> float | None:
    low, high = options["score_range"]
    return value if math.isfinite(value) and low <= value <= high else None


def parse_verdict(parser: str | Callable, text: str, options: dict) -> float | None:
    """The score of verdict ``text`` by ``parser`` (a built-in's name or a function), None when it cannot be read.
    ``options``: ``score_range`` (low, high), ``yes_word``, ``no_word``."""
    if callable(parser):
        found = parser(text)
        return None if found is None or not math.isfinite(float(found)) else float(found)
    if parser == "last_number":
        numbers = NUMBER.findall(text)
        return _in_range(float(numbers[-1]), options) if numbers else None
    if parser == "boxed":
        boxes = BOXED.findall(text)
        numbers = NUMBER.fullmatch(boxes[-1].strip()) if boxes else None
        return _in_range(float(numbers.group(0)), options) if numbers else None
    if parser == "yes_no":
        words = re.findall(r"[A-Za-z]+", text)
        first = words[0].lower() if words else ""
        yes, no = str(options["yes_word"]).lower(), str(options["no_word"]).lower()
        return 1.0 if first == yes else 0.0 if first == no else None
    raise ValueError(f"unknown judge parser {parser!r}")


def question_of(messages: list[dict] | None, text: str) -> str:
    """A sample's question: the last user message of its chat messages, else the prompt's text."""
    users = [m for m in messages or [] if m.get("role") == "user"]
    content = users[-1].get("content") if users else text
    return "" if content is None else str(content)


@dataclass(frozen=True)
class JudgeSettings:
    """What the driver reads of a judge (``models.<name>``)."""

    name: str
    key: str
    template: str
    parser: str
    parse: str | Callable  # a built-in's name, or the user's function
    options: dict
    default_score: float
    max_unparsed_episodes: int
    weight: float
    normalize: str
    weight_key: str

    @classmethod
    def of(cls, cfg, name: str, base_dir: str | None = None) -> "JudgeSettings":
        j, key = cfg.models[name], f"models.{name}"
        parse = j.parser if j.parser in BUILTIN_PARSERS else load_object(
            j.parser, key=f"{key}.parser", base_dir=base_dir, what="judge parser", runs_in="the driver")
        return cls(name, key, j.prompt_template, j.parser, parse,
                   {"score_range": tuple(float(x) for x in j.score_range), "yes_word": j.yes_word,
                    "no_word": j.no_word}, float(j.default_score), int(j.max_unparsed_episodes), float(j.weight),
                   j.normalize, f"{key}.weight")


class Judges:
    """The run's judges (``names``, in config order): their turns and their scores."""

    def __init__(self, cfg, names: list[str], groups: dict, sampling, sched):
        self.settings = {name: JudgeSettings.of(cfg, name) for name in names}
        self.templates = {name: environment(undefined=jinja2.StrictUndefined).from_string(s.template)
                          for name, s in self.settings.items()}
        self.groups, self.sampling, self.sched = groups, sampling, sched
        # the served judges' HTTP clients (the others are the groups' workers)
        self.served = {name: ServedJudge(ServedJudgeSettings.of(cfg, name)) for name in names
                       if kind_of(cfg, name).served}
        for name, client in self.served.items():
            client.probe()  # the endpoint answers and serves the judge's model, before the first episode
            for k in served_inert_keys(cfg.models[name]):
                warn(f"models.{name}.{k} is set, but models.{name} is a served judge (models.{name}.endpoint): "
                     "it has no devices or engine of this run's, so the key does not apply (the server's own "
                     "settings do).")
        self.failed_in_a_row = {name: 0 for name in self.settings}  # training episodes with no verdict read

    def __bool__(self) -> bool:
        return bool(self.settings)

    def close(self) -> None:
        """Close the served judges' clients."""
        for client in self.served.values():
            client.close()

    def verdicts(self, name: str, rendered: list[list[dict]]) -> list[dict]:
        """The judge's outputs (one per replica, or the served judge's one) on the rendered prompts, in order."""
        if name in self.served:
            client = self.served[name]
            before = client.retries
            out = client.judge(rendered)
            return [{**out, "retries": client.retries - before}]
        self.sched.take_turn(name)
        group = self.groups[name]  # each replica judges a contiguous share
        shares = np.array_split(np.arange(len(rendered)), len(group.actors))
        outs, _ = group.call_each("judge", [(put([rendered[i] for i in share]),) for share in shares])
        return outs

    def count_failures(self, name: str, unparsed: int, n: int) -> None:
        """After a training episode: a judge none of whose ``n`` verdicts could be read in
        ``max_unparsed_episodes`` episodes in a row stops the run (a UserError naming the key)."""
        s = self.settings[name]
        self.failed_in_a_row[name] = self.failed_in_a_row[name] + 1 if n and unparsed == n else 0
        if s.max_unparsed_episodes and self.failed_in_a_row[name] >= s.max_unparsed_episodes:
            raise UserError(f"judge {name!r}: its parser ({s.parser}) could read none of its verdicts in "
                            f"{self.failed_in_a_row[name]} episodes in a row, so every sample scored default_score "
                            "and nothing was learned from it; the run stops. Check the judge's replies against its "
                            "parser (train/judge/<name>/unparsed), its prompt_template and max_verdict_tokens, or "
                            "raise max_unparsed_episodes (0: never stop).",
                            key=f"{s.key}.max_unparsed_episodes")

    def fields(self, batch: dict, prompts) -> list[dict]:
        """Each sample's template fields (see the module docstring)."""
        texts, responses = self.sampling.prompts_text(batch), self.sampling.responses_text(batch)
        messages = prompts.messages or [None] * len(responses)
        return [{"question": question_of(m, t), "response": r, "reference": truth}
                for m, t, r, truth in zip(messages, texts, responses, prompts.truths)]

    def render(self, name: str, fields: list[dict]) -> list[list[dict]]:
        template = self.templates[name]
        try:
            return [[{"role": "user", "content": template.render(**f)}] for f in fields]
        except jinja2.TemplateError as err:
            raise UserError(f"judge {name!r}: its prompt_template cannot be rendered for a sample: "
                            f"{type(err).__name__}: {err}. The fields are question, response and reference.",
                            key=f"models.{name}.prompt_template") from None

    def score_all(self, batch: dict, prompts, run=None, training: bool = False) -> tuple[dict[str, np.ndarray], dict]:
        """Every judge's score of each sample (float64 [N]), each in its turn (a ``run`` times the turns as the
        ``judge`` stage of each), and their metrics (``judge/<name>/unparsed``, ``judge/<name>/tokens``, a served
        judge's ``judge/<name>/retries``, without the prefix)."""
        scores, metrics = {}, {}
        fields = self.fields(batch, prompts) if self.settings else []
        for name, s in self.settings.items():
            rendered = self.render(name, fields)
            with run.stage(Stage.JUDGE, name) if run is not None else contextlib.nullcontext():
                outs = self.verdicts(name, rendered)
            if s.parser == "yes_prob":  # NaN: a served judge's top tokens held neither word's
                found = [float(p) if math.isfinite(p) else None for out in outs for p in out["yes_probs"]]
            else:
                found = [parse_verdict(s.parse, t, s.options) for out in outs for t in out["texts"]]
            unparsed = sum(v is None for v in found)
            if training:
                self.count_failures(name, unparsed, len(found))
            scores[name] = np.asarray([s.default_score if v is None else v for v in found], np.float64)
            metrics.update({f"judge/{name}/unparsed": float(unparsed),
                            f"judge/{name}/tokens": float(sum(out["generated_tokens"] for out in outs))})
            if name in self.served:  # its requests retried (the endpoint failed them)
                metrics[f"judge/{name}/retries"] = float(sum(out["retries"] for out in outs))
        return scores, metrics


class ModelScores(dict):
    """The scoring models' raw scores by name (a dict), with the judges' own metrics (``metrics``)."""

    metrics: dict


class ScoringModels:
    """The run's models that score the samples: its reward models, then its judges, each taking its turn;
    their scores join the reward functions' as :meth:`RewardModels.add` weighs, normalises and reports them."""

    def __init__(self, cfg, plan, groups: dict, sampling, sched):
        self.reward_models = RewardModels(cfg, plan.reward_models, groups, sampling, sched)
        self.judges = Judges(cfg, plan.of_kind(JUDGE), groups, sampling, sched)

    def __bool__(self) -> bool:
        return bool(self.reward_models) or bool(self.judges)

    def score_all(self, batch: dict, prompts, run=None) -> ModelScores:
        found = ModelScores(self.reward_models.score_all(batch, prompts, run))
        judged, found.metrics = self.judges.score_all(batch, prompts, run, training=run is not None)
        found.update(judged)
        return found

    def add(self, scored, scores: ModelScores, prefix: str = "train", normalize: bool = True) -> tuple:
        """``scored`` with every model's weighted score added, and the metrics (:meth:`RewardModels.add`; the
        judges' ``<prefix>/judge/<name>/unparsed`` and ``.../tokens`` too)."""
        scored, metrics = self.reward_models.add(scored, scores, prefix, normalize, others=self.judges.settings)
        metrics.update({f"{prefix}/{k}": v for k, v in getattr(scores, "metrics", {}).items()})
        return scored, metrics
