"""Multi-turn rollouts (``models.policy.multi_turn.environment``): model turns and environment steps
alternate, and the trajectory the trainer sees is, token for token, the one the rollout engine
generated.

Exact by construction: a trajectory is a list of token ids that only grows. The model's tokens are
appended as the engine returned them (with their log-probs, ``loss_mask`` 1); what an environment
answers is rendered by the chat template once (:class:`chatlearn.data.turns.TurnTemplate`) and its
tokens appended (``loss_mask`` 0: no loss, no gradient); nothing is ever decoded and encoded again.

A round, for all the trajectories still running at once (the rollout engine batches them, every
replica busy): one generate call continues each trajectory by one model turn (at most
``max_turn_tokens`` new tokens, and never past ``max_response_tokens_length`` tokens after the
prompt or the engine's context), then the environments step on the turns' text in a pool of
``num_workers`` threads, each call within ``step_timeout_s``. A trajectory ends when its environment
says done (``done``), after ``max_turns`` model turns (``max_turns``), when a turn or an
observation does not fit the token limits (``token_limit``), or when its environment raises or
returns something unusable (``error``) or overruns (``timeout``); the run goes on, and a warning
names the first such error. ``finish_reasons`` is 1 for ``done`` only. A tool that raises
(``builtin:tools``) is the model's answer, not an end: its first error is shown once.

A source that fails on every call of a rollout (the environment: no trajectory got an answer from
it, every one that called it ended by an error or time-out; a tool: every call raised) gets a loud
warning; after ``runtime_args.max_failed_env_episodes`` training episodes in a row in which the same
source failed so (0: never), the run stops naming it and its first error. Evaluation rollouts are
warned about, never counted.

The batch adds to the single-turn columns ``loss_mask`` (per token) and, per trajectory,
``env/reward`` (the discounted sum of the turns' rewards), ``env/turns``, ``env/status`` (index
into :data:`STATUSES`), ``env/observation_tokens``, ``env/info`` (JSON of the info numbers summed
over the steps), ``env/error`` (text, empty without one) and ``env/prompt`` (JSON of the messages
the reset returned in place of the row's prompt, empty without them: what the reward models score
as the prompt): arrays, so that checkpoints of rollouts ahead and every batch operation keep them.
With routing replay (an engine that returns ``routed_experts``) it carries the routes of the model's own
tokens, as each turn's generation recorded them; the prompt's and the observations' tokens have none (the
trainer routes those itself).
"""
from __future__ import annotations

import collections
import copy
import functools
import json
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from omegaconf import OmegaConf

from chatlearn.algorithms.advantages import loss_token_counts
from chatlearn.config.env_entries import load_environment, load_parser, tool_entries
from chatlearn.config.load import policy_sequence_length
from chatlearn.data.turns import TurnTemplate
from chatlearn.env.base import BadEnvironmentOutput, as_messages, as_step_result, awaited
from chatlearn.env.tools import Tool
from chatlearn.errors import UserError
from chatlearn.logging.console import warn as console_warn
from chatlearn.models.moe import layout as moe_layout

STATUSES = ("done", "max_turns", "token_limit", "error", "timeout")
DONE, MAX_TURNS, TOKEN_LIMIT, ERROR, TIMEOUT = range(len(STATUSES))
TURN_SEED_STRIDE = 1_000_003  # turn t of a rollout samples with seed + t * this
SHORTEN_TRIES = 3  # an observation longer than max_observation_tokens is cut down this many times at most
# Characters one token spans at most, near enough: before an observation is rendered and tokenized (on the
# driver, past the step's time limit) its messages are cut to max_observation_tokens x this many characters
# together, so a huge observation costs no more than one that fits.
CHARS_PER_TOKEN = 32
TRUNCATED = " ...(truncated)"


@dataclass
class Outcome:
    """One environment call: its value, what it raised, or that it ran past its time limit."""

    value: object = None
    error: BaseException | None = None
    timed_out: bool = False


class EnvCalls:
    """Runs environment calls on threads, ``workers`` at a time, each within ``timeout`` seconds from
    when it starts. A call past its limit is abandoned (a Python thread cannot be stopped): its
    result, should it come, is dropped, and it no longer holds a worker's place."""

    def __init__(self, workers: int, timeout: float):
        self.workers, self.timeout = workers, timeout
        self.abandoned = 0  # calls left running past their limit, over the run

    def run(self, calls: list[Callable]) -> list[Outcome]:
        results: list = [None] * len(calls)
        finished: queue.SimpleQueue = queue.SimpleQueue()  # this run's own: a late call of an earlier run cannot land here
        waiting, running = collections.deque(range(len(calls))), {}

        def work(i: int) -> None:
            try:
                finished.put((i, Outcome(value=awaited(calls[i]()))))  # an async def method runs here
            except BaseException as err:  # noqa: BLE001 - the environment's error is recorded, the run goes on
                finished.put((i, Outcome(error=err)))

        while waiting or running:
            while waiting and len(running) < self.workers:
                i = waiting.popleft()
                threading.Thread(target=work, args=(i,), name=f"chatlearn-env-{i}", daemon=True).start()
                running[i] = time.monotonic() + self.timeout
            try:
                i, out = finished.get(timeout=max(0.0, min(running.values()) - time.monotonic()))
                if i in running:
                    del running[i]
                    results[i] = out
            except queue.Empty:
                now = time.monotonic()
                for i in [i for i, deadline in running.items() if deadline <= now]:
                    del running[i]
                    results[i] = Outcome(timed_out=True)
                    self.abandoned += 1
        return results


@dataclass
class Trajectory:
    """One sample's conversation so far: ``ids`` (prompt and response), and per response token
    ``mask`` (1: the model's) and ``logprobs``."""

    env: object
    ids: list
    prompt_len: int
    mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    status: int | None = None  # None while it runs
    error: str = ""
    failed: tuple | None = None  # (status, error) of a reset that failed: one model turn, then it ends
    action: str = ""
    last_token: int | None = None
    observation_tokens: int = 0
    info: dict = field(default_factory=dict)
    answered: int = 0  # steps the environment answered (returned a usable result)
    prompt_messages: list | None = None  # the first observation reset returned, which replaced the row's prompt
    # routing replay: (start, encoded routes [n, MoE layers, top_k]) of each model turn's tokens, start counted
    # from the end of the prompt (every other token, the prompt's and the observations', has no record)
    routes: list = field(default_factory=list)

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len

    def append(self, ids: list, logprobs: list | None) -> None:
        self.ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def end(self, status: int, error: str = "") -> None:
        self.status, self.error = status, error


class MultiTurnLoop:
    """The multi-turn rollout of a run (see the module docstring), built from the validated config on
    the driver: the environment class, the tools and the parser imported, the chat template probed."""

    def __init__(self, cfg, tokenizer):
        p = cfg.models.policy
        mt = p.multi_turn
        base_dir = os.getcwd()
        self.name = mt.environment
        self.env_cls = load_environment(mt.environment, base_dir)
        self.env_kwargs = OmegaConf.to_container(mt.environment_kwargs, resolve=True)  # plain dicts and lists
        self.env_extras: dict = {}  # what the built-in tool environment gets besides them (shared, read-only)
        self.tool_schemas = None
        roles = [mt.observation_role]
        if getattr(self.env_cls, "uses_tools", False):
            tools = [Tool(**e) for e in tool_entries(OmegaConf.to_container(mt, resolve=True), base_dir)]
            self.tool_schemas = [t.schema() for t in tools]
            self.env_extras = dict(tools=tools, parser=load_parser(mt.tool_parser, base_dir),
                                   max_tool_calls_per_turn=mt.max_tool_calls_per_turn)
            roles.append("tool")
        self.role = mt.observation_role
        self.template = TurnTemplate(tokenizer, tools=self.tool_schemas, roles=tuple(roles),
                                     enable_thinking=p.enable_thinking)
        self.tokenizer = tokenizer
        self.max_turns, self.discount = mt.max_turns, mt.reward_discount
        self.max_turn_tokens = mt.max_turn_tokens or p.max_response_tokens_length
        self.max_observation_tokens = mt.max_observation_tokens
        self.max_prompt, self.max_response = p.max_prompt_tokens_length, p.max_response_tokens_length
        self.context = policy_sequence_length(p)  # the engine's tokens per sequence (and no more than it produces)
        self.calls = EnvCalls(mt.num_workers, mt.step_timeout_s)
        self.timeout = mt.step_timeout_s
        self.max_failed = cfg.runtime_args.max_failed_env_episodes
        # source ("environment 'x'", "tool 'y'") -> (training episodes in a row in which it failed on
        # every call, the first and the last of them, the first error of the first)
        self.streaks: dict[str, tuple[int, int, int, str]] = {}
        self.tools_shown: set = set()  # the tools whose first error was shown

    # ------------------------------------------------------------------ a rollout
    def run(self, generate: Callable, prompts, sampling: dict, what: str, episode: int | None = None) -> dict:
        """The trajectories of ``prompts`` (a :class:`chatlearn.runtime.driver.sampling.Prompts`, one entry per
        sample) as a batch; ``generate(prompt ids, sampling)`` samples one model turn of each (the
        rollout replicas), with ``sampling``'s settings and its seed plus ``TURN_SEED_STRIDE`` per turn.
        ``what`` names the rollouts in warnings ("the rollouts of episode 3"); ``episode``: the training
        episode they belong to (None: an evaluation), counted towards ``max_failed_env_episodes``."""
        trajectories = self.start(prompts)
        for turn in range(self.max_turns):
            active = [t for t in trajectories if t.status is None]
            if not active:
                break
            self.model_turn(generate, active, sampling, turn)
            self.env_turn([t for t in active if t.status is None], turn)
        self.calls.run([t.env.close for t in trajectories])  # errors and overruns of close are ignored
        self.warn(trajectories, what, episode)
        return self.batch(trajectories)

    def start(self, prompts) -> list[Trajectory]:
        """An environment per sample, reset on its row; the first observation it returns (if any)
        replaces the row's prompt."""
        try:  # each instance its own copy of the kwargs: no state shared between trajectories
            envs = [self.env_cls(**copy.deepcopy(self.env_kwargs), **self.env_extras) for _ in prompts.ids]
        except Exception as err:  # noqa: BLE001 - the user's constructor: stop the run, naming it
            raise UserError(f"environment {self.name!r} (models.policy.multi_turn.environment) could not be built: "
                            f"{describe(err)}. Fix its constructor or models.policy.multi_turn.environment_kwargs."
                            ) from None
        messages = prompts.messages if prompts.messages is not None else [None] * len(prompts.ids)
        rows = [{"prompt": m, "ground_truth": g, "data_source": s, **e}
                for m, g, s, e in zip(messages, prompts.truths, prompts.sources, prompts.extra)]
        outcomes = self.calls.run([functools.partial(env.reset, row) for env, row in zip(envs, rows)])
        trajectories = []
        for env, ids, out in zip(envs, prompts.ids, outcomes):
            t = Trajectory(env=env, ids=list(ids), prompt_len=len(ids))
            trajectories.append(t)
            problem = self.problem(out, "reset")
            if problem is not None:
                t.failed = problem
            elif out.value is not None:
                try:
                    messages = as_messages(out.value, "user", "the first observation reset returned")
                except BadEnvironmentOutput as err:
                    t.failed = (ERROR, f"reset: {err}")
                    continue
                chars = sum(len(str(m["content"])) for m in messages)
                if chars > self.max_prompt * CHARS_PER_TOKEN:  # no need to tokenize it to know it is too long
                    raise UserError(f"environment {self.name!r}: reset returned a first observation of {chars} "
                                    f"characters, more than models.policy.max_prompt_tokens_length "
                                    f"({self.max_prompt}) tokens can hold (a token covers at most {CHARS_PER_TOKEN} "
                                    "characters). Return a shorter conversation, or raise max_prompt_tokens_length.")
                t.ids = self.template.prompt_ids(messages)
                t.prompt_len, t.prompt_messages = len(t.ids), messages
                if t.prompt_len > self.max_prompt:
                    raise UserError(f"environment {self.name!r}: reset returned a first observation of {t.prompt_len} "
                                    f"tokens, more than models.policy.max_prompt_tokens_length ({self.max_prompt}). "
                                    "Return a shorter conversation, or raise max_prompt_tokens_length.")
        return trajectories

    def model_turn(self, generate: Callable, active: list[Trajectory], sampling: dict, turn: int) -> None:
        """One model turn of each active trajectory, cut to what its limits leave."""
        room = [min(self.max_response - t.response_len, self.context - len(t.ids)) for t in active]
        out = generate([t.ids for t in active], {**sampling, "max_tokens": min(self.max_turn_tokens, max(room)),
                                                 "seed": sampling["seed"] + turn * TURN_SEED_STRIDE,
                                                 "continuation": True})
        off, plen = out["offsets"], out["prompt_lens"]
        for i, t in enumerate(active):
            start, end = int(off[i] + plen[i]), int(off[i + 1])
            new = [int(x) for x in out["tokens"][start:end]][:room[i]]
            if "routed_experts" in out:  # the engine's routes of the model's own tokens only
                t.routes.append((t.response_len, out["routed_experts"][start:start + len(new)]))
            t.append(new, [float(x) for x in out["rollout_logprobs"][start:start + len(new)]])
            t.turns += 1
            if t.failed is not None:
                t.end(*t.failed)
            elif end - start > room[i] or not out["finish_reasons"][i]:
                t.end(TOKEN_LIMIT)
            else:
                t.action = self.tokenizer.decode(new, skip_special_tokens=True)
                t.last_token = new[-1] if new else None

    def env_turn(self, stepping: list[Trajectory], turn: int) -> None:
        """Every trajectory's environment steps on its model turn; the observations are appended."""
        outcomes = self.calls.run([functools.partial(t.env.step, t.action) for t in stepping])
        for t, out in zip(stepping, outcomes):
            problem = self.problem(out, f"step {t.turns}")
            if problem is not None:
                t.end(*problem)
                continue
            try:
                result = as_step_result(out.value, self.role)
            except BadEnvironmentOutput as err:
                t.end(ERROR, f"step {t.turns}: {err}")
                continue
            t.answered += 1
            t.reward += self.discount ** turn * result.reward
            for k, v in result.info.items():  # summed over the steps
                t.info[k] = t.info[k] + v if k in t.info else v
            if result.done:
                t.end(DONE)
            elif t.turns >= self.max_turns:
                t.end(MAX_TURNS)
            else:
                self.observe(t, result.observation)

    def observe(self, t: Trajectory, messages: list) -> None:
        """Append the observation's tokens (shortened to ``max_observation_tokens``), or end the
        trajectory where they, and one more model token, do not fit."""
        try:
            ids = self.observation_ids(messages, t.last_token)
        except UserError as err:  # the template refuses these messages: this trajectory's error
            t.end(ERROR, f"step {t.turns}: {err}")
            return
        if ids is None or t.response_len + len(ids) + 1 > self.max_response or len(t.ids) + len(ids) + 1 > self.context:
            t.end(TOKEN_LIMIT)
            return
        t.append(ids, None)
        t.observation_tokens += len(ids)

    def observation_ids(self, messages: list, last_token: int | None) -> list | None:
        """The tokens of ``messages`` after a model turn; when longer than ``max_observation_tokens``
        the longest message is cut (up to ``SHORTEN_TRIES`` times, marked ``...(truncated)``), else None.
        Cut by characters first (:func:`cut_by_characters`): what is tokenized stays small."""
        if len(messages) > self.max_observation_tokens:  # every message takes a token at least
            return None
        messages = cut_by_characters(messages, self.max_observation_tokens * CHARS_PER_TOKEN)
        ids = self.template.observation_ids(messages, last_token)
        for _ in range(SHORTEN_TRIES):
            if len(ids) <= self.max_observation_tokens:
                return ids
            j = max(range(len(messages)), key=lambda k: len(messages[k]["content"]))
            content = messages[j]["content"]
            keep = max(0, int(len(content) * self.max_observation_tokens / len(ids)) - 32)
            messages[j]["content"] = content[:keep] + TRUNCATED
            ids = self.template.observation_ids(messages, last_token)
        return ids if len(ids) <= self.max_observation_tokens else None

    def problem(self, out: Outcome, call: str) -> tuple | None:
        """``(status, error text)`` of a call that raised or overran; None for one that returned."""
        if out.timed_out:
            return TIMEOUT, f"{call}: no answer within {self.timeout:g} s (models.policy.multi_turn.step_timeout_s)"
        if out.error is not None:
            return ERROR, f"{call}: {describe(out.error)}"
        return None

    def warn(self, trajectories: list[Trajectory], what: str, episode: int | None = None) -> None:
        """Warn of the environment's and the tools' errors of a rollout (loudly of a source that failed on
        every call), count the training episodes in a row in which a source failed so, and stop the run
        at ``max_failed_env_episodes`` of them (see the module docstring)."""
        failing: dict[str, str] = {}  # source -> its first error, of the sources that failed on every call
        lines: list[tuple] = []  # (the source of a line about one that failed on every call, or None; the line)
        failed = [(i, t) for i, t in enumerate(trajectories) if t.status in (ERROR, TIMEOUT)]
        if failed:
            i, first = failed[0]
            ended = f"{len(failed)} of {len(trajectories)} trajectories ended by an error or time-out"
            error = f"trajectory {i}: {first.error}"
            if any(t.answered for t in trajectories):
                lines.append((None, f"{what}: {ended} of environment {self.name!r} (the first, {error})"))
            else:
                source = f"environment {self.name!r}"
                failing[source] = error
                lines.append((source, f"{what}: {source} failed on every call: {ended} (the first, {error}) and "
                                      "none got an answer from it, so this rollout holds no observation or reward "
                                      "of the environment"))
        for name, (calls, raised, err) in tool_totals(trajectories).items():
            said = f"raised on {raised} of {calls} calls (the first: {describe(err)})" if raised else ""
            if raised == calls:
                source = f"tool {name!r}"
                failing[source] = describe(err)
                lines.append((source, f"{what}: {source} failed on every call: it {said}, so every call of it "
                                      "got an error back"))
            elif raised and name not in self.tools_shown:
                lines.append((None, f"{what}: tool {name!r} {said}; a tool's error goes back to the model as "
                                    "the call's result and the run goes on (a tool's first error is shown once)"))
            if raised:
                self.tools_shown.add(name)
        if episode is not None:
            self.count_failures(failing, episode)
        for source, line in lines:
            console_warn(line if source is None else line + (self.streak_note(source) if episode is not None else "."))
        if episode is not None:
            self.stop_if_failing()

    def count_failures(self, failing: dict, episode: int) -> None:
        """The streaks after training episode ``episode`` (a source that did not fail on every call
        breaks its streak; the rollouts of one episode, dynamic sampling's rounds, count once)."""
        streaks = {}
        for source, error in failing.items():
            count, start, last, first = self.streaks[source] if source in self.streaks else (0, episode, None, error)
            streaks[source] = (count + (last != episode), start, episode, first)
        self.streaks = streaks

    def streak_note(self, source: str) -> str:
        if self.max_failed == 0:
            return "; the run goes on (runtime_args.max_failed_env_episodes: 0)."
        return (f"; the run stops after {self.max_failed} such episodes in a row "
                f"(runtime_args.max_failed_env_episodes: {self.max_failed}; {self.streaks[source][0]} so far).")

    def stop_if_failing(self) -> None:
        """UserError naming the first source that failed on every call of ``max_failed_env_episodes``
        training episodes in a row."""
        for source, (count, start, last, first) in self.streaks.items():
            if 0 < self.max_failed <= count:
                key = "environment" if source.startswith("environment") else "tools"
                raise UserError(
                    f"{source} (models.policy.multi_turn.{key}) failed on every call of {count} episodes in a row "
                    f"(episodes {start}-{last}), so the run stops (runtime_args.max_failed_env_episodes: "
                    f"{self.max_failed}): the policy learns nothing from it. Its first error, in episode {start}: "
                    f"{first}. Fix it (call it on a few data rows by hand), or raise "
                    "runtime_args.max_failed_env_episodes (0: never stop). The last complete checkpoint is kept.")

    # ------------------------------------------------------------------ the batch
    @staticmethod
    def batch(trajectories: list[Trajectory]) -> dict:
        """The rollout batch of the trajectories (see the module docstring)."""
        n = len(trajectories)
        lens = np.array([len(t.ids) for t in trajectories], dtype=np.int64)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        zeros = [[0] * t.prompt_len for t in trajectories]
        routed = routed_column(trajectories, offsets)
        return {**routed,
            "tokens": np.fromiter((x for t in trajectories for x in t.ids), np.int64, int(offsets[-1])),
            "offsets": offsets,
            "prompt_lens": np.array([t.prompt_len for t in trajectories], dtype=np.int64),
            "rollout_logprobs": np.array([x for t, z in zip(trajectories, zeros) for x in z + t.logprobs],
                                         dtype=np.float32).reshape(-1),
            "loss_mask": np.array([x for t, z in zip(trajectories, zeros) for x in z + t.mask],
                                  dtype=np.uint8).reshape(-1),
            "finish_reasons": np.array([t.status == DONE for t in trajectories], dtype=np.int8).reshape(n),
            "env/reward": np.array([t.reward for t in trajectories], dtype=np.float64).reshape(n),
            "env/turns": np.array([t.turns for t in trajectories], dtype=np.int64).reshape(n),
            "env/status": np.array([t.status for t in trajectories], dtype=np.int8).reshape(n),
            "env/observation_tokens": np.array([t.observation_tokens for t in trajectories], dtype=np.int64).reshape(n),
            "env/info": np.array([json.dumps(t.info, sort_keys=True) for t in trajectories], dtype=str).reshape(n),
            "env/error": np.array([t.error for t in trajectories], dtype=str).reshape(n),
            "env/prompt": np.array([prompt_json(t.prompt_messages) for t in trajectories], dtype=str).reshape(n),
        }


def routed_column(trajectories: list[Trajectory], offsets: np.ndarray) -> dict:
    """``{"routed_experts": column}`` where the engine recorded routes (routing replay): each model turn's
    tokens carry theirs, the prompt's and the observations' none; {} without routes."""
    found = [r for t in trajectories for _, r in t.routes]
    if not found:
        return {}
    first = found[0]
    column = np.full((int(offsets[-1]), *first.shape[1:]), moe_layout.none_value(first.dtype), dtype=first.dtype)
    for t, start in zip(trajectories, offsets[:-1]):
        for at, r in t.routes:
            begin = int(start) + t.prompt_len + at
            column[begin:begin + len(r)] = r
    return {"routed_experts": column}


def prompt_json(messages: list | None) -> str:
    """``env/prompt`` of a trajectory: JSON of the messages its reset returned (the prompt the policy saw in
    place of the row's), empty when the reset returned none."""
    return "" if messages is None else json.dumps(messages, ensure_ascii=False, default=str)


def prompt_messages(batch: dict, i: int) -> list | None:
    """The messages sample ``i``'s environment reset returned in place of its row's prompt (``env/prompt``),
    or None: the policy saw the row's prompt (a single-turn batch, or a reset that returned none)."""
    text = str(batch["env/prompt"][i]) if "env/prompt" in batch else ""
    return json.loads(text) if text else None


def tool_totals(trajectories: list[Trajectory]) -> dict:
    """``{tool name: (calls, calls that raised, the first exception)}`` over the trajectories of a rollout
    with tools (:attr:`chatlearn.env.tools.ToolEnvironment.tool_stats`; {} without tools)."""
    totals: dict = {}
    for t in trajectories:
        stats = getattr(t.env, "tool_stats", None)  # a ToolEnvironment's (a subclass may lack it)
        for name, (calls, raised, error) in (stats.items() if isinstance(stats, dict) else ()):
            c, r, e = totals[name] if name in totals else (0, 0, None)
            totals[name] = (c + calls, r + raised, e if e is not None else error)
    return {name: v for name, v in totals.items() if v[0]}


def cut_by_characters(messages: list, budget: int) -> list:
    """Copies of ``messages`` whose contents hold ``budget`` characters together at most: each past it
    is cut (marked ``...(truncated)``), the first messages keeping theirs."""
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if isinstance(content, str) and len(content) > budget:
            m["content"] = content[:budget] + TRUNCATED
        budget -= min(budget, len(content) if isinstance(content, str) else 0)
        out.append(m)
    return out


def env_metrics(batch: dict, prefix: str) -> dict:
    """``<prefix>/env/*`` of a multi-turn batch ({} for a single-turn one): means over the trajectories
    of the environment reward, turns, observation and model tokens, the share of each way a
    trajectory ended, and of each info number (summed over a trajectory's steps)."""
    if "env/turns" not in batch:
        return {}
    out = {f"{prefix}/env/trajectory_reward_mean": float(np.mean(batch["env/reward"])),
           f"{prefix}/env/turns_mean": float(np.mean(batch["env/turns"])),
           f"{prefix}/env/observation_tokens_mean": float(np.mean(batch["env/observation_tokens"])),
           f"{prefix}/env/model_tokens_mean": float(np.mean(loss_token_counts(batch)))}
    status = np.asarray(batch["env/status"])
    out.update({f"{prefix}/env/{name}_frac": float(np.mean(status == k)) for k, name in enumerate(STATUSES)})
    infos = [json.loads(str(s)) for s in batch["env/info"]]
    for key in sorted({k for info in infos for k in info}):
        out[f"{prefix}/env/info/{key}"] = float(np.mean([info[key] if key in info else 0.0 for info in infos]))
    return out


def trajectory_segments(tokenizer, batch: dict, i: int) -> list[dict]:
    """Sample ``i`` of a multi-turn batch after its prompt, as its runs of model tokens
    (``{"role": "model", ...}``) and observation tokens (``"observation"``), each decoded with its
    special tokens: exactly the text the model saw and wrote."""
    start, end = int(batch["offsets"][i]), int(batch["offsets"][i + 1])
    begin = start + int(batch["prompt_lens"][i])
    mask, tokens = np.asarray(batch["loss_mask"][begin:end]), np.asarray(batch["tokens"][begin:end])
    cuts = [0] + [j for j in range(1, len(mask)) if mask[j] != mask[j - 1]] + [len(mask)]
    return [{"role": "model" if mask[a] else "observation", "text": tokenizer.decode(tokens[a:b].tolist())}
            for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def trajectory_fields(tokenizer, batch: dict, i: int) -> dict:
    """What a sample row (samples.jsonl, eval/samples.jsonl) adds for sample ``i`` of a multi-turn
    batch ({} for a single-turn one): the trajectory's segments (:func:`trajectory_segments`), its
    turns, environment reward, how it ended and the error that ended it."""
    if "env/turns" not in batch:
        return {}
    return {"trajectory": trajectory_segments(tokenizer, batch, i), "turns": int(batch["env/turns"][i]),
            "env_reward": float(batch["env/reward"][i]), "env_status": STATUSES[int(batch["env/status"][i])],
            "env_error": str(batch["env/error"][i])}


def describe(err: BaseException) -> str:
    """``Type: message (at file:line in function)``, the last frame of the user's code."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename != __file__]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    text = " ".join(str(err).split())
    text = text if len(text) <= 300 else text[:300] + " (...)"
    return f"{type(err).__name__}: {text}{where}" if text else f"{type(err).__name__}{where}"
