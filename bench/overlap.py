"""Asynchronous rollouts against on-policy: the same job, rollout and trainer on two logical devices
(``runtime_args.colocation=[]``), run with ``runtime_args.max_staleness`` 0 and 1, repetitions
interleaved (0, 1, 0, 1, ...). Writes ``bench/results/overlap.json``: each run's training
throughput (samples per second of the episodes' time), the evaluation after the same episodes,
their medians, the ratio and the difference. Paths in the result are relative.

    python bench/overlap.py [--episodes 20] [--reps 2] [--out bench/results/overlap.json]

Throughput is ``num_episode x sample_per_episode / sum(time/episode)``: the episode loop, without
start-up, evaluation and the logging between episodes (both runs evaluate the same way). With
staleness the rollout of episode n+1 runs inside episode n's time, so the sum covers every rollout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the template's job (256 samples, 2 optimizer steps per episode) with rollout and trainer apart;
# on this job generation plus scoring and the old-log-prob pass plus training take comparable time
JOB = ["runtime_args.colocation=[]", "runtime_args.enable_eval_before_training=False",
       "runtime_args.save_episode_interval=0", "models.policy_trainer.save_hf=false"]


def run_once(staleness: int, episodes: int, out: str) -> dict:
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *JOB,
           f"runtime_args.num_episode={episodes}", f"runtime_args.eval_episode_interval={episodes}",
           f"runtime_args.max_staleness={staleness}", f"runtime_args.output_dir={out}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"run failed (max_staleness={staleness}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(out, "config.yaml"), encoding="utf-8") as f:
        spe = int(next(line.split(":")[1] for line in f if line.strip().startswith("sample_per_episode:")))
    trained = [r for r in rows if r["episode"] > 0]
    loop = sum(r["time/episode"] for r in trained)
    final = trained[-1]
    return {
        "max_staleness": staleness,
        "episodes": len(trained),
        "samples_per_episode": spe,
        "episode_time_s": round(loop, 3),
        "samples_per_s": round(len(trained) * spe / loop, 3),
        "wall_s": round(wall, 1),
        "eval_reward_mean": final["eval/reward_mean"],
        "train_reward_mean_last5": round(statistics.mean(r["train/reward_mean"] for r in trained[-5:]), 4),
        "staleness_max": max(r.get("train/staleness_max", 0.0) for r in trained),
        "time_generate_s": round(sum(r.get("time/generate", 0.0) for r in trained), 3),
        "time_train_s": round(sum(r.get("time/train", 0.0) for r in trained), 3),
        "time_overlapped_s": round(sum(r.get("time/overlapped", 0.0) for r in trained), 3),
        "time_rollout_wait_s": round(sum(r.get("time/rollout_wait", 0.0) for r in trained), 3),
    }


def summarize(runs: list[dict]) -> dict:
    by = {k: [r for r in runs if r["max_staleness"] == k] for k in (0, 1)}
    med = {k: {"samples_per_s": statistics.median(r["samples_per_s"] for r in v),
               "eval_reward_mean": statistics.mean(r["eval_reward_mean"] for r in v)} for k, v in by.items()}
    return {
        "on_policy_samples_per_s_median": med[0]["samples_per_s"],
        "stale1_samples_per_s_median": med[1]["samples_per_s"],
        "speedup_stale1_over_on_policy": round(med[1]["samples_per_s"] / med[0]["samples_per_s"], 3),
        "on_policy_eval_reward_mean": round(med[0]["eval_reward_mean"], 4),
        "stale1_eval_reward_mean": round(med[1]["eval_reward_mean"], 4),
        "eval_difference_stale1_minus_on_policy": round(med[1]["eval_reward_mean"] - med[0]["eval_reward_mean"], 4),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=20)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=os.path.join("bench", "results", "overlap.json"))
    args = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="overlap_bench_") as tmp:
        for rep in range(args.reps):
            for staleness in (0, 1):  # interleaved
                r = run_once(staleness, args.episodes, os.path.join(tmp, f"s{staleness}_r{rep}"))
                r["repetition"] = rep
                runs.append(r)
                print(json.dumps(r), flush=True)
    result = {
        "benchmark": "bench/overlap.py",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip(),
        "job": {"template": "template/grpo_fsdp.yaml", "overrides": JOB,
                "num_episode": args.episodes,
                "eval": "eval/reward_mean after the last episode (eval set: assets/arith/eval.jsonl)"},
        "order": "interleaved: max_staleness 0, 1, 0, 1",
        "machine": {"cpus": os.cpu_count(), "platform": platform.machine(), "gpu": "none (two logical CPU devices)"},
        "runs": runs,
        "summary": summarize(runs),
        "notes": ("samples_per_s = episodes x sample_per_episode / sum(time/episode), start-up and evaluation "
                  "excluded. On 2 cores generation and training compete for the same cores when they overlap "
                  "(time_generate_s and time_train_s grow), so the gain is smaller than the time overlapped; "
                  "runs are deterministic: the repetitions of a setting give the same evaluation."),
    }
    out = os.path.join(REPO, args.out) if not os.path.isabs(args.out) else args.out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
