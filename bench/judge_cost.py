"""Judge cost benchmark: what the judge's turn costs in a GRPO episode, local and served.

Runs ``template/grpo_judge.yaml`` (the tiny policy rewarded by ``assets/tiny_judge`` alone) for ``--episodes``
episodes (no evaluation, no checkpoint) once per mode:

* ``local``: the template's judge, colocated with the policy, its trainer and the reference, on the ``hf``
  backend, with ``runtime_args.offload_without_gpu=true`` so that its weights and KV cache move off and back as
  they would on a GPU (without it nothing moves here: the devices are logical);
* ``served``: the same judge served over HTTP by ``tests/support/openai_server.py`` (transformers, one request
  at a time, a stand-in for vLLM's OpenAI server) on 127.0.0.1, ``models.judge.endpoint`` pointing at it and the
  judge taken out of the colocation group (no devices, no turns);

each with the template's parser ``yes_prob`` (one forward, nothing generated), and with ``--generate`` also
``yes_no`` (the verdict generated, up to 4 tokens). From the run's ``metrics.jsonl`` and ``timeline.jsonl``, per
episode after the first (warm-up): ``time/judge`` (the judge's turn: its verdicts, and for the local judge its
onload), the verdict tokens generated, the judge's own offload and onload (seconds and bytes from the timeline's
transitions), ``time/episode`` and the judge's share of it. Medians over the episodes. Usage::

    .venv/bin/python bench/judge_cost.py [--episodes 4] [--generate]

Prints a markdown table and writes ``bench/results/judge_cost.json`` (no absolute paths). The served judge's
server runs on the same cores as the run here, so its time per sample is the tiny model's forward plus HTTP,
not a remote server's; on a machine shared with other work the numbers are noisy (the load is recorded).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "support"))
from openai_server import free_port, spawn  # noqa: E402  (the test server, started as a process of its own)

TEMPLATE = "template/grpo_judge.yaml"
COMMON = ["runtime_args.enable_eval_before_training=False", "runtime_args.eval_episode_interval=0",
          "runtime_args.save_episode_interval=0"]
SAMPLES = 256  # the template's sample_per_episode
YES_NO = ["models.judge.parser=yes_no", "models.judge.max_verdict_tokens=4"]


def rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def judge_moves(timeline: list[dict], episodes: int) -> dict[int, dict]:
    """Per episode (the timeline's rows carry none: counted by the judge's stages), the judge's own transitions:
    seconds and bytes of its offloads and onloads."""
    found: dict[int, dict] = {e: {"offload_s": 0.0, "onload_s": 0.0, "offload_bytes": 0, "onload_bytes": 0}
                              for e in range(1, episodes + 1)}
    episode = 1
    for e in timeline:
        if e.get("model") != "judge":
            continue
        if e["kind"] == "transition" and episode in found:
            found[episode][f"{e['action']}_s"] += float(e["seconds"])
            found[episode][f"{e['action']}_bytes"] += int(e["bytes"])
        elif e["kind"] == "stage" and e["stage"] == "judge":
            episode += 1  # its offload comes after its turn, in the next model's: counted with the next episode
    return found


def run_mode(mode: str, parser: str, episodes: int, port: int | None, out: str) -> dict:
    args = [*COMMON, f"runtime_args.num_episode={episodes}", f"runtime_args.output_dir={out}"]
    if parser == "yes_no":
        args += YES_NO
    if mode == "served":
        args += [f"models.judge.endpoint=http://127.0.0.1:{port}/v1", "models.judge.max_concurrency=8",
                 "runtime_args.colocation=[policy,policy_trainer,ref_policy]"]
    else:
        args += ["runtime_args.offload_without_gpu=true"]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", "run", TEMPLATE, *args], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{mode}/{parser} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    metrics = rows(os.path.join(out, "metrics.jsonl"))
    moves = judge_moves(rows(os.path.join(out, "timeline.jsonl")), episodes)
    per = []
    for r in metrics[1:]:  # the first episode warms up
        m = moves[r["episode"]]
        per.append({"judge_s": r["time/judge"], "episode_s": r["time/episode"], "samples": SAMPLES,
                    "tokens": r["train/judge/judge/tokens"], **m})
    med = {k: statistics.median(p[k] for p in per) for k in per[0]}
    return {"mode": mode, "parser": parser, "episodes": episodes, "wall_s": round(wall, 1),
            "judge_s": med["judge_s"], "ms_per_sample": 1000 * med["judge_s"] / med["samples"],
            "tokens_per_episode": med["tokens"], "offload_s": med["offload_s"], "onload_s": med["onload_s"],
            "moved_mb": (med["offload_bytes"] + med["onload_bytes"]) / 2 ** 20,
            "episode_s": med["episode_s"], "share": med["judge_s"] / med["episode_s"],
            "judge_reward_last": metrics[-1]["train/reward/judge/score"], "per_episode": per}


def table(found: list[dict]) -> str:
    lines = ["| judge | parser | time/judge s | ms / sample | verdict tokens / episode | its offload s | its onload s "
             "| moved MB | time/episode s | judge share |", "|" + " --- |" * 10]
    for r in found:
        lines.append(f"| {r['mode']} | {r['parser']} | {r['judge_s']:.2f} | {r['ms_per_sample']:.2f} | "
                     f"{r['tokens_per_episode']:.0f} | {r['offload_s']:.3f} | {r['onload_s']:.3f} | "
                     f"{r['moved_mb']:.1f} | {r['episode_s']:.2f} | {100 * r['share']:.1f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--generate", action="store_true", help="also the yes_no parser (verdicts generated)")
    ap.add_argument("--modes", default="local,served")
    args = ap.parse_args()
    parsers = ["yes_prob"] + (["yes_no"] if args.generate else [])
    load_before = os.getloadavg()
    found = []
    port = free_port()
    server = spawn(os.path.join(REPO, "assets", "tiny_judge"), port) if "served" in args.modes else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for parser in parsers:
                for mode in args.modes.split(","):
                    found.append(run_mode(mode, parser, args.episodes, port, os.path.join(tmp, f"{mode}_{parser}")))
                    print(table(found[-1:]).splitlines()[-1], flush=True)
                    write(found, args.episodes, load_before)  # each row as it comes
    finally:
        if server is not None:
            server.kill()
    print(table(found))


def write(found: list[dict], episodes: int, load_before) -> None:
    result = {"template": TEMPLATE, "samples_per_episode": SAMPLES, "episodes": episodes,
              "cpus": os.cpu_count(), "load_avg_before": [round(x, 2) for x in load_before],
              "load_avg_after": [round(x, 2) for x in os.getloadavg()],
              "served_by": "tests/support/openai_server.py (transformers, 1 thread, one request at a time, on the "
                           "same machine)", "rows": found}
    os.makedirs(os.path.join(REPO, "bench", "results"), exist_ok=True)
    with open(os.path.join(REPO, "bench", "results", "judge_cost.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
