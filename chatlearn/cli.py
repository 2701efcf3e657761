"""Command line: ``chatlearn run CONFIG [key.path=value ...] [--dry-run]``."""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
import traceback

from chatlearn.errors import UserError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatlearn", description="Reinforcement learning for LLMs (GRPO).")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train with a YAML config",
                         description="Train with a YAML config. Extra arguments key.path=value override it.")
    run.add_argument("config", help="YAML config, e.g. template/grpo_fsdp.yaml")
    run.add_argument("overrides", nargs="*", help="overrides such as runtime_args.num_episode=10")
    run.add_argument("--dry-run", action="store_true", help="print the resolved config and the plan, then exit")
    run.add_argument("--no-resume", action="store_true",
                     help="start fresh even if output_dir holds a checkpoint (same as "
                          "runtime_args.enable_resume_training=False)")
    run.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # overrides may come before or after the flags: collect what argparse leaves over
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if rest:
        args.overrides = list(args.overrides or []) + rest
    debug = args.debug or os.environ.get("CHATLEARN_DEBUG") == "1"
    try:
        if args.command == "run":
            return _run(args)
    except UserError as err:
        if debug:
            traceback.print_exc()
        print(_paragraph(f"error: {err}"), file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def _run(args) -> int:
    from omegaconf import OmegaConf

    from chatlearn.config.load import load_config
    from chatlearn.config.plan import make_plan

    overrides = list(args.overrides) + (["runtime_args.enable_resume_training=False"] if args.no_resume else [])
    cfg = load_config(args.config, overrides)
    plan = make_plan(cfg)
    if args.dry_run:
        print("# resolved config")
        print(OmegaConf.to_yaml(cfg).rstrip())
        print("\n# plan")
        for line in plan.describe():
            print(line)
        return 0
    from chatlearn.runtime.engine import train

    train(cfg, plan, debug=args.debug or cfg.runtime_args.debug)
    return 0


def _paragraph(text: str) -> str:
    return textwrap.fill(" ".join(text.split()), width=100, break_long_words=False, break_on_hyphens=False)


if __name__ == "__main__":
    sys.exit(main())
