"""Command line: ``chatlearn run CONFIG [key.path=value ...] [--dry-run] [--accept-config-changes]``,
``chatlearn sft CONFIG [key.path=value ...]`` (supervised fine-tuning of the policy on conversations: the ``sft``
keys),
``chatlearn merge CKPT_DIR OUT_DIR`` (trainer checkpoint -> Hugging Face folder; a LoRA checkpoint -> peft's
adapter folder, or with ``--merged`` the merged model) and
``chatlearn plot OUTPUT_DIR`` (PNG plots of a run's metrics).

Each command imports what it needs inside the function that runs it, so that ``chatlearn --help`` and
``--version`` start in about 20 ms (``python -X importtime -c "import chatlearn.cli"``); a comment says what
such an import would add to that start."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
import traceback

from chatlearn import __version__
from chatlearn.config.container import check_output_volume
from chatlearn.errors import UserError
from chatlearn.logging.console import ThirdPartyLogs, failure_hint, info, warn


# a config names Python code; checking it runs that code's top level (as merge's --trust-remote-code says of models)
CONFIG_IS_CODE = ("A config is code: run, run --dry-run and eval import the Python modules it names (reward "
                  "functions, the multi-turn environment and tools, runtime_args.plugins), which runs their "
                  "top-level code. Run only configs you trust.")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatlearn", description="Reinforcement learning for LLMs (GRPO).",
                                     epilog=CONFIG_IS_CODE)
    parser.add_argument("--version", action="version", version=f"chatlearn {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train with a YAML config",
                         description="Train with a YAML config. Extra arguments key.path=value override it.",
                         epilog=CONFIG_IS_CODE)
    run.add_argument("config", help="YAML config, e.g. template/grpo_fsdp.yaml")
    run.add_argument("overrides", nargs="*", help="overrides such as runtime_args.num_episode=10")
    run.add_argument("--dry-run", action="store_true",
                     help="print the plan and the settings that differ from the defaults, then exit. It "
                          "imports the config's reward functions, environment, tools and plugins (running their "
                          "top-level code) to check them")
    run.add_argument("--all", action="store_true", help="with --dry-run: print every setting")
    run.add_argument("--verbose", action="store_true",
                     help="show the logs of vLLM, Ray, transformers, torch... on the console too (by default "
                          "they only go to OUTPUT_DIR/logs/)")
    run.add_argument("--no-resume", action="store_true",
                     help="start fresh instead of continuing the run in output_dir (same as "
                          "runtime_args.enable_resume_training=False); refused when output_dir already "
                          "holds a run, unless --overwrite is given")
    run.add_argument("--overwrite", action="store_true",
                     help="start fresh (implies --no-resume); a run already in output_dir is moved aside to "
                          "OUTPUT_DIR.old-<time>, not deleted")
    run.add_argument("--accept-config-changes", action="store_true",
                     help="resume even where the config differs from the checkpoint's in a way that alters "
                          "training (learning rate, data, group or batch sizes, ...); the accepted keys are "
                          "recorded in OUTPUT_DIR/configs/history.jsonl. Without it such a resume is refused "
                          "(harmless changes, such as num_episode or the intervals, need no flag)")
    run.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    ev = sub.add_parser("eval", help="evaluate a model with a YAML config (rollout engine and reward only)",
                        description="Sample eval_data_path with the eval_* parameters and "
                                    "eval_num_inference_per_prompt samples per prompt; write every sample and "
                                    "per-data-source metrics under OUTPUT_DIR/eval/.",
                        epilog=CONFIG_IS_CODE)
    ev.add_argument("config", help="YAML config, e.g. template/grpo_fsdp.yaml")
    ev.add_argument("overrides", nargs="*", help="overrides such as models.policy.eval_num_inference_per_prompt=8")
    ev.add_argument("--checkpoint", metavar="PATH", help="evaluate this instead of models.policy.load: a Hugging "
                                                         "Face folder, a peft adapter folder (merged onto its base "
                                                         "first), a run's checkpoints/episode_N, a "
                                                         "sharded trainer checkpoint, or a Hub model id")
    ev.add_argument("--overwrite", action="store_true",
                    help="replace an earlier result in OUTPUT_DIR/eval/ (its metrics.json and samples.jsonl are "
                         "moved to <name>.old-<time>, not deleted); without it chatlearn eval refuses")
    ev.add_argument("--keep-merged", action="store_true",
                    help="with a trainer checkpoint (no hf/) or an adapter folder: keep the merged model in "
                         "OUTPUT_DIR/eval/merged_model (by default it is deleted once the evaluation ends)")
    ev.add_argument("--base", metavar="DIR",
                    help="with LoRA adapters (a folder with adapter_config.json, or a LoRA run's checkpoint without "
                         "hf/): their base model folder (default: the adapter config's base_model_name_or_path, or "
                         "the folder the checkpoint records)")
    ev.add_argument("--verbose", action="store_true",
                    help="show third-party logs on the console too (by default: OUTPUT_DIR/eval/logs/)")
    ev.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    _sft_parser(sub)
    _merge_parser(sub)
    plot = sub.add_parser("plot", help="plot a run's metrics, or compare runs",
                          description="Write PNG plots of OUTPUT_DIR/metrics.jsonl into OUTPUT_DIR/plots/; with "
                                      "several runs, overlay them (one colour per run) into --out.")
    plot.add_argument("output_dir", nargs="+", metavar="RUN",
                      help="a run's output folder (runtime_args.output_dir); several to compare them")
    plot.add_argument("--out", default=None, metavar="DIR",
                      help="where to write the PNG files (default: RUN/plots; required with several runs)")
    plot.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    return parser


def _sft_parser(sub) -> None:
    """``chatlearn sft``'s arguments."""
    sft = sub.add_parser("sft", help="supervised fine-tuning on conversations (the sft keys)",
                         description="Fine-tune models.policy_trainer on the conversations of sft.data_path (loss on "
                                     "the assistant tokens), with the run's trainer, checkpoints and resume; the "
                                     "result, OUTPUT_DIR/result, is a Hugging Face folder that chatlearn run loads "
                                     "as models.policy_trainer.load. Extra arguments key.path=value override the "
                                     "config.", epilog=CONFIG_IS_CODE)
    sft.add_argument("config", help="YAML config, e.g. template/sft.yaml")
    sft.add_argument("overrides", nargs="*", help="overrides such as sft.max_steps=100")
    sft.add_argument("--no-resume", action="store_true",
                     help="start fresh instead of continuing the run in output_dir; refused when output_dir already "
                          "holds a run, unless --overwrite is given")
    sft.add_argument("--overwrite", action="store_true",
                     help="start fresh (implies --no-resume); a run already in output_dir is moved aside")
    sft.add_argument("--verbose", action="store_true", help="show third-party logs on the console too")
    sft.add_argument("--debug", action="store_true", help="show full tracebacks for errors")


def _merge_parser(sub) -> None:
    """``chatlearn merge``'s arguments."""
    merge = sub.add_parser("merge", help="turn a trainer checkpoint into a Hugging Face model folder",
                           description="Merge a trainer checkpoint (FSDP or Megatron, any number of ranks) into a "
                                       "Hugging Face model folder: safetensors shards, config, tokenizer. A LoRA "
                                       "run's checkpoint (adapters only) gives peft's adapter folder "
                                       "(adapter_config.json, adapter_model.safetensors; PeftModel.from_pretrained "
                                       "loads it onto the base), or with --merged the merged model.")
    merge.add_argument("ckpt_dir", help="checkpoint folder written by the trainer (or a run's checkpoint "
                                        "folder holding it under trainer/)")
    merge.add_argument("out_dir", help="new Hugging Face model folder to write")
    merge.add_argument("--hf-config", metavar="DIR", help="take config.json and the tokenizer files from "
                                                          "DIR, a model folder or a Hugging Face Hub id "
                                                          "(default: the folder the trainer loaded)")
    merge.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                       help="dtype of the written weights (default: float32, as trained; LoRA: the adapters as "
                            "trained, the merged model in the base model's dtype)")
    merge.add_argument("--merged", action="store_true",
                       help="LoRA checkpoint: write the merged Hugging Face model (each adapted weight W + B @ A x "
                            "alpha / rank, config and tokenizer of the base) instead of the adapter folder")
    merge.add_argument("--base", metavar="DIR",
                       help="LoRA checkpoint: the base model folder the adapters were trained on (default: the "
                            "folder the checkpoint records; it must still be the same model)")
    merge.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default: 5GB)")
    merge.add_argument("--trust-remote-code", action="store_true",
                       help="allow running the Python code of the model's config.json (auto_map); never "
                            "taken from the checkpoint itself")
    merge.add_argument("--debug", action="store_true", help="show full tracebacks for errors")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # overrides may come before or after the flags: collect what argparse leaves over
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if rest:
        if args.command not in ("run", "eval", "sft"):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = list(args.overrides or []) + rest
    debug = args.debug or os.environ.get("CHATLEARN_DEBUG") == "1"
    if getattr(args, "verbose", False):
        os.environ["CHATLEARN_VERBOSE"] = "1"  # read by chatlearn.logging.console, here and in the workers
    from chatlearn.runtime.cluster.signals import exit_code, stop_message, stop_on_sigterm  # heavy: +3 ms (signal)

    stop_on_sigterm()  # SIGTERM (Slurm, Kubernetes) and SIGHUP (a closed terminal) stop like Ctrl-C, exit 143 / 129
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "eval":
            return _eval(args)
        if args.command == "sft":
            return _sft(args)
        if args.command == "plot":
            return _plot(args)
        if args.command == "merge":
            return _merge(args)
    except UserError as err:
        # raised inside a Ray actor it arrives wrapped (RayTaskError(UserError)): report the original
        err = getattr(err, "cause", None) or err
        if debug:
            traceback.print_exc()
        info(_paragraph(f"error: {err.message}"), stderr=True, bare=True)
        return err.exit_code
    except KeyboardInterrupt:
        from chatlearn.runtime.cluster.watchdog import stall_message  # heavy: +16 ms at start (multiprocessing)

        if stall_message():  # the watchdog interrupted a driver that did not end after a stall
            info(_paragraph(f"error: {stall_message()}"), stderr=True, bare=True)
            return 1
        try:
            info(stop_message(), stderr=True, bare=True)
        except OSError:  # the terminal is gone (SIGHUP): the exit code says it
            pass
        return exit_code()
    return 0


def _eval(args) -> int:
    from chatlearn.config.load import load_config
    from chatlearn.runtime.driver.evaluate import evaluate_only

    with ThirdPartyLogs() as logs:
        cfg = load_config(args.config, args.overrides)
        _check_volume(cfg.runtime_args.output_dir)
        logs.attach(os.path.join(cfg.runtime_args.output_dir, "eval"))
        evaluate_only(cfg, checkpoint=args.checkpoint, overwrite=args.overwrite, keep_merged=args.keep_merged,
                      base=args.base)
    return 0


def _sft(args) -> int:
    from chatlearn.runtime.driver.sft import load_sft_config, run_sft

    fresh = args.no_resume or args.overwrite
    overrides = list(args.overrides) + (["runtime_args.enable_resume_training=False"] if fresh else [])
    with ThirdPartyLogs() as logs:
        cfg = load_sft_config(args.config, overrides)
        _check_volume(cfg.runtime_args.output_dir)
        logs.attach(cfg.runtime_args.output_dir)
        run_sft(cfg, overwrite=args.overwrite)
    return 0


def _run(args) -> int:
    from chatlearn.config.load import load_run
    from chatlearn.logging.startup import clock  # heavy: +1 ms at start
    from chatlearn.runtime.rundir.output_dir import check_start

    clock().mark("imports")

    if args.all and not args.dry_run:
        raise UserError("--all only changes what --dry-run prints: add --dry-run, or leave --all out.")
    fresh = args.no_resume or args.overwrite
    overrides = list(args.overrides) + (["runtime_args.enable_resume_training=False"] if fresh else [])
    cfg, plan = load_run(args.config, overrides)  # the plan validation computed
    clock().mark("config")
    from chatlearn.config.schema import compat_warning

    ignored = compat_warning(cfg)
    if ignored:
        info(_paragraph(f"warning: {ignored}"), stderr=True, bare=True)
    # a dry run only reads: a run in progress in output_dir is noted, not an error
    check_start(cfg, overwrite=args.overwrite, check_lock=not args.dry_run)
    if args.dry_run:
        _dry_run(args, cfg, plan)
        return 0
    _check_volume(cfg.runtime_args.output_dir)
    from chatlearn.runtime.driver.run import train

    with ThirdPartyLogs() as logs:
        try:
            train(cfg, plan, debug=args.debug or cfg.runtime_args.debug, overwrite=args.overwrite,
                  accept_config_changes=args.accept_config_changes)
        except (UserError, KeyboardInterrupt):
            raise
        except Exception as err:
            from chatlearn.runtime.cluster.group import dead_worker_message
            from chatlearn.runtime.cluster.signals import Terminated, terminated  # heavy: +3 ms at start (signal)

            if terminated():  # the job was stopped: what failed after it (its workers) went the same way
                raise Terminated() from None
            hint = failure_hint(err, cfg.runtime_args.output_dir) if logs.path else ""
            stalled = _stalled(err, hint)
            if stalled:  # the watchdog stopped a stalled stage, or a collective timed out: one paragraph
                if args.debug:
                    traceback.print_exc()
                info(_paragraph(f"error: {stalled}"), stderr=True, bare=True)
                return 1
            dead = dead_worker_message(err)
            if dead:  # a worker died: which model and rank, not a traceback of the driver
                if args.debug:
                    traceback.print_exc()
                info(_paragraph(f"error: {dead}"), stderr=True, bare=True)
                if hint:
                    info(hint, stderr=True, bare=True)
                return 1
            if not hint:
                raise
            # a worker's own last words (a crash) are in its log, not on the console: shown last
            traceback.print_exc()
            info(hint, stderr=True, bare=True)
            return 1
    return 0


def _check_volume(output_dir: str) -> None:
    """In the container image: refuse an output folder the container cannot write, warn when the run's
    results would be lost with the container (chatlearn/config/container.py)."""
    note = check_output_volume(output_dir)
    if note:
        info(_paragraph(f"warning: {note}"), stderr=True, bare=True)


def _stalled(err: BaseException, hint: str) -> str | None:
    """The paragraph of a run the watchdog stopped (a stalled worker or stage), or of a collective that
    timed out (in the error, or in the dead worker's log ``hint``); None for any other failure."""
    from chatlearn.runtime.cluster.watchdog import collective_timeout_message, stall_message  # heavy: +16 ms at start

    return stall_message() or collective_timeout_message(err, hint)


def _dry_run(args, cfg, plan) -> None:
    """``--dry-run``: the settings, a resumed run's config changes against its checkpoint's (refused as a
    run would be), and the plan; nothing is written."""
    from omegaconf import OmegaConf

    from chatlearn.logging.sinks import changed_config, config_yaml
    from chatlearn.runtime.rundir.config_history import check_resume
    from chatlearn.runtime.rundir.lock import RunLock, describe  # heavy: +6 ms at start
    from chatlearn.runtime.rundir.output_dir import previous_run
    from chatlearn.runtime.rundir.preflight import check_paths

    out = cfg.runtime_args.output_dir
    resumed = check_resume(cfg, args.accept_config_changes)  # the refusal a run would meet, before any output
    check_paths(cfg, plan)  # every path the run writes is writable, with room for a checkpoint (as a run checks)
    counts = _dry_run_data(cfg, resumed, args.accept_config_changes)  # the data, read and checked as a run does
    # the dry run's output: the settings and the plan, as they are
    if args.all:
        info("# resolved config, every setting (secrets shown as ***)", bare=True)
        info(config_yaml(cfg).rstrip(), bare=True)
    else:
        changed = changed_config(cfg)
        info("# settings that differ from the defaults (--all: every setting; secrets shown as ***)", bare=True)
        info(OmegaConf.to_yaml(changed).rstrip() if changed else "# (none)", bare=True)
    if resumed.warning():
        warn(resumed.warning())
    if resumed.changes:
        info("", bare=True)
        for line in resumed.report():
            info(f"# {line}", bare=True)
    info("\n# plan", bare=True)
    for line in counts:
        info(line, bare=True)
    for line in plan.describe():
        info(line, bare=True)
    holder = RunLock(out).live_holder()
    if holder is not None:
        info(f"# note: {out} is in use by {describe(holder)}; a run now would be refused", bare=True)
    if args.overwrite and previous_run(out):
        info(f"# --overwrite: the run in {out} would be moved to {out}.old-<time>", bare=True)


def _dry_run_data(cfg, resumed, accept: bool) -> list[str]:
    """Read the train and eval data with the policy's tokenizer as a run does
    (chatlearn.runtime.driver.run.train): a missing or malformed file, a row without the prompt or
    ground-truth key, prompts all too long, or a data set of another size than the checkpoint's is
    refused here as it would be there. Returns the lines that count the prompts."""
    from chatlearn.config.teacher_keys import needs_responses
    from chatlearn.data.dataset import VisionData, load_prompts, load_tokenizer
    from chatlearn.runtime.rundir.config_history import check_prompt_count

    rt, p = cfg.runtime_args, cfg.models.policy
    tokenizer = load_tokenizer(p.load, trust_remote_code=p.trust_remote_code, key="models.policy.load")
    tools = None
    if p.multi_turn.environment is not None:  # the tools the chat template shows change the prompts' lengths
        from chatlearn.runtime.driver.multiturn import MultiTurnLoop

        tools = MultiTurnLoop(cfg, tokenizer).tool_schemas
    data = dict(max_prompt_tokens=p.max_prompt_tokens_length, enable_thinking=p.enable_thinking,
                prompt_key=rt.prompt_key, ground_truth_key=rt.ground_truth_key,
                ground_truth_pattern=rt.ground_truth_pattern, prompt_instruction=rt.prompt_instruction, tools=tools,
                vision=VisionData(p.load, p.max_images_per_prompt))
    sets = [("train", load_prompts(rt.data_path.split(","), tokenizer, name=rt.data_subset, split=rt.data_split,
                                   **data, responses=needs_responses(cfg)))]
    check_prompt_count(resumed, len(sets[0][1]), accept)
    if rt.eval_data_path and (rt.eval_episode_interval > 0 or rt.enable_eval_before_training):
        sets.append(("eval", load_prompts(rt.eval_data_path.split(","), tokenizer, what="runtime_args.eval_data_path",
                                          name=rt.eval_data_subset, split=rt.eval_data_split, **data,
                                          drop_replies=needs_responses(cfg))))
    for _, s in sets:
        if s.empty_truth_warning:
            warn(s.empty_truth_warning)
    return [f"{name} data: {len(s)} prompts" + (f" ({s.dropped_too_long} dropped: longer than "
                                                 "max_prompt_tokens_length)" if s.dropped_too_long else "")
            for name, s in sets]


def _merge(args) -> int:
    from chatlearn.checkpoint.merge import merge_checkpoint

    out = merge_checkpoint(args.ckpt_dir, args.out_dir, hf_config=args.hf_config, dtype=args.dtype,
                           max_shard_size=args.max_shard_size, trust_remote_code=args.trust_remote_code,
                           base=args.base, merged=args.merged, log=lambda msg: info(msg, bare=True))
    what = "peft adapter folder, " if out.get("adapter") else ""
    info(f"wrote {out['out_dir']}: {what}{out['num_tensors']} tensors, {out['total_bytes'] / 1e6:.1f} MB "
         f"({out['dtype']}) in {len(out['shards'])} shard(s), in {out['seconds']:.1f}s", bare=True)
    return 0


def _plot(args) -> int:
    from chatlearn.logging.plots import plot_runs  # heavy: +13 ms at start (dataclasses, inspect)

    runs = args.output_dir
    if len(runs) > 1 and not args.out:
        raise UserError(f"{len(runs)} runs to compare, but no --out: say where the overlaid plots go, e.g. "
                        "`chatlearn plot " + " ".join(runs) + " --out compare/` (a run's own plots/ folder is "
                        "kept for its own plots).")
    for path in plot_runs(runs, args.out or os.path.join(runs[0], "plots")):
        info(path, bare=True)  # the command's output: one written file a line
    return 0


def _version() -> str:
    """The installed package's version (its metadata), else the source tree's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("chatlearn")
    except PackageNotFoundError:
        return __version__


def _paragraph(text: str) -> str:
    return textwrap.fill(" ".join(text.split()), width=100, break_long_words=False, break_on_hyphens=False)


def entry() -> None:
    """The ``chatlearn`` command: :func:`main`, then, after ``run`` and ``eval``, the process ends at once
    once its output is flushed. Every file of the run is closed by then; what is left is the
    interpreter's teardown of the libraries a run without Ray loaded into this process (torch, vLLM:
    seconds of native destructors and thread pools on a CPU machine), which does nothing for the user."""
    ends = len(sys.argv) > 1 and sys.argv[1] in ("run", "eval", "sft")
    if ends:
        from chatlearn.runtime.cluster import local  # heavy: +12 ms at start (multiprocessing)

        local.PROCESS_ENDS_WITH_RUN = True  # a run without Ray leaves its models to the end of the process
    code = main()
    if ends:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 0 if code is None else 1)
    sys.exit(code)


if __name__ == "__main__":
    entry()
