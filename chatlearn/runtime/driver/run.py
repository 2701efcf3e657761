"""A training run from start to end: ``chatlearn run``'s driver.

:func:`train` refuses what it must before anything loads (the output folder, a resumed run's config
changes against its checkpoint's, the data, the tokenizer), locks the output folder, writes the
resolved config (and keeps the earlier ones: chatlearn.runtime.rundir.config_history), starts the
cluster, builds the
:class:`~chatlearn.runtime.driver.engine.Engine` and runs its episodes, then draws the plots and
prints the run's summary."""
from __future__ import annotations

import functools
import os
import threading
import time

from omegaconf import DictConfig

from chatlearn.config.plan import Plan
from chatlearn.config.teacher_keys import needs_responses
from chatlearn.data.dataset import VisionData, load_prompts, load_tokenizer
from chatlearn.errors import UserError
from chatlearn.logging.console import attach_logs, info, warn
from chatlearn.logging.metrics import run_summary
from chatlearn.logging.plots import plot_after_run, read_metrics
from chatlearn.logging.startup import clock
from chatlearn.runtime.cluster.cluster import Cluster
from chatlearn.runtime.driver.engine import Engine
from chatlearn.runtime.driver.multiturn import MultiTurnLoop
from chatlearn.runtime.rundir.config_history import check_prompt_count, check_resume, record_config
from chatlearn.runtime.rundir.lock import RunLock
from chatlearn.runtime.rundir.output_dir import check_start, move_aside, previous_run, reconcile_logs
from chatlearn.runtime.rundir.output_dir import refusal as output_refusal
from chatlearn.runtime.rundir.preflight import check_paths


def train(cfg: DictConfig, plan: Plan, debug: bool = False, overwrite: bool = False,
          accept_config_changes: bool = False) -> dict:
    """Run ``cfg``. The output folder is locked for the run's lifetime (one run per folder); a run
    that starts fresh into a folder holding a run is refused, unless ``overwrite``: the old run is
    then moved aside (see chatlearn.runtime.rundir.output_dir). A resumed run whose config differs
    from its checkpoint's in a way that alters training is refused, unless ``accept_config_changes``
    (see chatlearn.runtime.rundir.config_history)."""
    rt, p = cfg.runtime_args, cfg.models.policy
    started, started_wall = time.monotonic(), time.time()
    check_start(cfg, overwrite)  # before loading anything: refusals come first
    check_paths(cfg, plan)  # every folder the run writes: a folder, writable, room for a checkpoint
    resumed = check_resume(cfg, accept_config_changes)
    if resumed.warning():
        warn(resumed.warning())
    tokenizer = load_tokenizer(p.load, trust_remote_code=p.trust_remote_code, key="models.policy.load")
    # multi-turn: the environment, tools and chat template are set up first; the prompts show the tools
    multi_turn = MultiTurnLoop(cfg, tokenizer) if p.multi_turn.environment is not None else None
    data = dict(max_prompt_tokens=p.max_prompt_tokens_length, enable_thinking=p.enable_thinking,
                prompt_key=rt.prompt_key, ground_truth_key=rt.ground_truth_key,
                ground_truth_pattern=rt.ground_truth_pattern, prompt_instruction=rt.prompt_instruction,
                tools=multi_turn.tool_schemas if multi_turn is not None else None,
                vision=VisionData(p.load, p.max_images_per_prompt))
    train_set = load_prompts(rt.data_path.split(","), tokenizer, name=rt.data_subset, split=rt.data_split, **data,
                             responses=needs_responses(cfg))
    check_prompt_count(resumed, len(train_set), accept_config_changes)
    for line in resumed.report():
        info(line)
    eval_set = None
    if rt.eval_data_path and (rt.eval_episode_interval > 0 or rt.enable_eval_before_training):
        eval_set = load_prompts(rt.eval_data_path.split(","), tokenizer, what="runtime_args.eval_data_path",
                                name=rt.eval_data_subset, split=rt.eval_data_split, **data,
                                drop_replies=needs_responses(cfg))
    with RunLock(rt.output_dir) as lock:
        # validated: only now is anything in output_dir touched
        if not rt.enable_resume_training:
            found = previous_run(rt.output_dir)
            if found and not overwrite:
                raise output_refusal(rt.output_dir, found)
            if found:
                moved = move_aside(cfg, lock)
                info(f"--overwrite: moved the previous run in {rt.output_dir} to {moved}")
        else:
            reconcile_logs(cfg)
        # config.yaml, and configs/ keeps every config the run ran with; a resumed run's once its checkpoint
        # has loaded, so that a resume refused there (adapters of another LoRA rank) writes nothing
        record = functools.partial(record_config, cfg, resumed)
        if resumed.checkpoint is None:
            record()
        attach_logs(rt.output_dir)  # third-party logs (chatlearn run): <output_dir>/logs/
        for name, s in (("train", train_set), ("eval", eval_set)):
            if s is not None:
                info(f"{name} data: {len(s)} prompts"
                     + (f" ({s.dropped_too_long} dropped: longer than max_prompt_tokens_length)"
                        if s.dropped_too_long else ""))
                if s.empty_truth_warning:
                    warn(s.empty_truth_warning)
        warn_repeated_prompts(len(train_set), plan)
        for line in plan.describe():
            info(line)
        startup = clock()
        startup.mark("data")
        with Cluster(cfg, plan) as cluster:
            startup.mark("ray")
            engine = Engine(cfg, plan, cluster, tokenizer, train_set, eval_set, multi_turn)
            startup.mark("models")
            with engine.sched.watchdog.watch("all models", "start-up times", call=True):  # a stalled worker is named
                times_of = cluster.startup_times()
            for name, times in times_of.items():
                startup.add_model(name, times)
            try:
                last = engine.train(on_resumed=record if resumed.checkpoint is not None else None)
            finally:
                engine.close()
            # the plots read the finished files: they are drawn while Ray's processes stop
            plots = threading.Thread(target=plot_after_run, args=(rt.output_dir,), name="plots", daemon=True)
            plots.start()
        plots.join()
    print_run_summary(rt.output_dir, time.monotonic() - started, started_wall)
    return last


def warn_repeated_prompts(prompts: int, plan: Plan) -> None:
    """Warn when the train data has fewer prompts than an episode draws: every episode then holds
    each prompt several times (its groups repeat one another)."""
    per_episode = plan.prompts_per_episode
    if prompts >= per_episode:
        return
    warn(f"the train data has {prompts} prompts, fewer than the {per_episode} prompts an episode draws "
         f"(runtime_args.sample_per_episode {per_episode * plan.group_size} / models.policy.num_inference_per_prompt "
         f"{plan.group_size}): every episode repeats each prompt about {per_episode / prompts:.1f} times, so its "
         "samples are mostly repeats of one another. Add prompts to runtime_args.data_path, or lower "
         "runtime_args.sample_per_episode.")


def print_run_summary(out: str, seconds: float, since: float) -> None:
    """The end of a run on the console (:func:`chatlearn.logging.metrics.run_summary`): how it went,
    where the time went, and where its outputs are."""
    try:
        rows = read_metrics(out)
    except UserError:  # no row written (an interrupted start)
        rows = []
    outputs = {}
    for label, name in (("metrics", "metrics.jsonl"), ("checkpoints", "checkpoints"), ("plots", "plots"),
                        ("samples", "samples.jsonl"), ("eval samples", os.path.join("eval", "samples.jsonl")),
                        ("logs", "logs")):
        path = os.path.join(out, name)
        if os.path.exists(path):
            outputs[label] = path + (os.sep if os.path.isdir(path) else "")
    for line in run_summary(rows, seconds, since, outputs):
        info(line, bare=True)
