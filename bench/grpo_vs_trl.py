"""chatlearn next to TRL's GRPOTrainer on the same GRPO job, on the CPU of this machine.

Both systems get the same model folder, the same prompts in the same order (file order), the
same group size, response length, sampling (temperature, top-p 1, no top-k), optimizer (AdamW,
constant learning rate, no warm-up, same betas/eps/weight decay/grad clip), optimizer steps per
generated batch, KL coefficient, clip ratio, reward (chatlearn's MathReward) and chat template,
fp32, and the same number of torch threads. The mapping is in ``grpo_compare.py`` and is
printed and checked before anything runs. chatlearn runs with both rollout backends (``vllm``,
``hf``); TRL generates with transformers (``use_vllm=False``).

Per run: samples/s and generated tokens/s over the steady-state steps (warm-up steps left out),
peak memory of all the run's processes together (``proc_memory.py``), mean reward over the last
3 steps, and for chatlearn the episode breakdown from its own ``time/*`` metrics. Each system
runs ``--repeats`` times, interleaved (A B C A B C ...); medians are reported, with the ratio
chatlearn / TRL. Results: ``bench/results/grpo_vs_trl.json`` and ``.md`` (also printed).

    .venv/bin/python bench/grpo_vs_trl.py [--workloads short,tiny,medium,long,long_mb]
        [--systems chatlearn-vllm,chatlearn-hf,trl] [--repeats 2] [--quick]
        [--results bench/results] [--cache /tmp/chatlearn_bench] [--keep-runs]

``--quick``: one repetition and a few steps (a smoke test; its numbers mean little). Torch
threads: chatlearn gives each model process ``os.cpu_count() // devices`` threads (one logical
device here), so TRL gets ``os.cpu_count()`` threads too. These one-device jobs run without Ray
(``runtime_args.single_process``, chatlearn's default where every model fits in one process); a run
that uses Ray starts one of its own in a private temp folder (``RAY_TMPDIR``). A failed run is recorded with its log tail and the
others go on; the JSON is rewritten after every run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import grpo_compare as gc  # noqa: E402
from proc_memory import ENV_MARKER, RunMemory  # noqa: E402

REPO = gc.REPO
sys.path.insert(0, REPO)


# ---------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------

def cpu_model() -> str:
    """The processor's name (``model name`` of /proc/cpuinfo where there is one), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_dir(model, cache: str) -> str:
    """The model folder of a workload: a folder as is, a ``ModelSpec`` built once into ``cache``."""
    if isinstance(model, str):
        return model
    path = os.path.join(cache, f"qwen2_{model.params() / 1e6:.0f}m_{model.key()}")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tmp = path + f".tmp{os.getpid()}"
    config = Qwen2Config(vocab_size=model.vocab, hidden_size=model.hidden, num_hidden_layers=model.layers,
                         num_attention_heads=model.heads, num_key_value_heads=model.kv_heads,
                         intermediate_size=model.intermediate, max_position_embeddings=model.max_positions,
                         tie_word_embeddings=True, eos_token_id=2, pad_token_id=0, bos_token_id=None,
                         dtype="float32")
    torch.manual_seed(model.seed)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(tmp)
    for name in gc.TOKENIZER_FILES:  # the embedded tokenizer, chat template and generation config
        shutil.copy(os.path.join(gc.TINY_MODEL, name), tmp)
    os.replace(tmp, path)
    return path


def resolved_config(w: gc.Workload, model: str, output_dir: str, backend: str, episodes: int):
    from chatlearn.config.load import load_config

    return load_config(gc.TEMPLATE, gc.chatlearn_overrides(w, model, output_dir, backend, episodes))


def expected_prompts(cfg, model: str, episodes: int) -> list[list[list[int]]]:
    """Prompt token ids chatlearn takes in each episode (its data loading and sampler)."""
    from chatlearn.data.dataset import PromptSampler, load_prompts, load_tokenizer

    p, rt = cfg.models.policy, cfg.runtime_args
    tok = load_tokenizer(model, trust_remote_code=False, key="models.policy.load")
    data = load_prompts(rt.data_path.split(","), tok, max_prompt_tokens=p.max_prompt_tokens_length,
                        enable_thinking=p.enable_thinking, prompt_key=rt.prompt_key,
                        ground_truth_key=rt.ground_truth_key)
    sampler = PromptSampler(len(data), shuffle=rt.data_shuffle, seed=rt.seed)
    k = rt.sample_per_episode // p.num_inference_per_prompt
    return [[data.prompt_ids[i] for i in sampler.next(k)] for _ in range(episodes)]


def check_trl_prompts(gens: list[dict], expected: list[list[list[int]]], model: str, enable_thinking: bool) -> bool:
    """Whether TRL's prompts (recorded by the reward function), tokenized with the chat template,
    are chatlearn's prompts, episode by episode."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    for gen, want in zip(gens, expected):
        got = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                       tokenize=True, enable_thinking=enable_thinking) for c in gen["prompts"]]
        got = [g["input_ids"] if hasattr(g, "keys") else g for g in got]
        if [list(g) for g in got] != [list(x) for x in want]:
            return False
    return bool(gens)


# ---------------------------------------------------------------------------------------
# running one system
# ---------------------------------------------------------------------------------------

class RunFailed(Exception):
    """A benchmarked run exited with an error."""


class Arrivals:
    """Times at which each row of a growing metrics.jsonl appears (polled)."""

    def __init__(self, path: str, interval: float = 0.05):
        self.path, self.interval = path, interval
        self.times: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        pos, buf = 0, ""
        while not self._stop.is_set():
            if os.path.exists(self.path):
                with open(self.path, encoding="utf-8") as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
                now = time.perf_counter()
                buf += chunk
                while "\n" in buf:
                    line, buf = buf.split("\n", 1)
                    if line.strip():
                        self.times.setdefault(int(json.loads(line)["episode"]), now)
            self._stop.wait(self.interval)

    def stop(self) -> dict[int, float]:
        self._stop.set()
        self._thread.join()
        return self.times


def run_process(cmd: list[str], log: str, env_extra: dict, watch: str | None = None) -> dict:
    """Run ``cmd`` to its end while sampling the memory of its processes; returns timings and memory."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, **env_extra, **{ENV_MARKER: marker,
                                           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                                           "PYTHONPATH": REPO})
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own, so that its processes are counted
    arrivals = Arrivals(watch) if watch else None
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        mem = RunMemory(proc.pid, marker).start()
        rc = proc.wait()
    wall = time.perf_counter() - start
    deadline = time.monotonic() + 30  # let Ray's processes exit (and count them until they do)
    while mem.tracked and time.monotonic() < deadline:
        time.sleep(0.2)
    memory = mem.stop()
    memory["left_running"] = len(mem.tracked)
    times = arrivals.stop() if arrivals else {}
    if rc:
        with open(log) as f:
            tail = f.read()[-4000:]
        raise RunFailed(f"{' '.join(cmd[:4])} ... failed with exit code {rc}; log {log}:\n{tail}")
    return {"wall_s": wall, "start": start, "arrivals": times, **memory}


def run_chatlearn(w: gc.Workload, model: str, backend: str, episodes: int, warmup: int, work: str) -> dict:
    out = os.path.join(work, "output")
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", gc.TEMPLATE,
           *gc.chatlearn_overrides(w, model, out, backend, episodes), "--no-resume"]
    metrics_path = os.path.join(out, "metrics.jsonl")
    # Ray in a private temp folder: it starts a cluster of its own instead of joining one that
    # `ray start` left on the machine (found through <temp>/ray/ray_current_cluster)
    ray_tmp = tempfile.mkdtemp(prefix="clb", dir="/tmp")
    try:
        res = run_process(cmd, os.path.join(work, "log.txt"), {"RAY_TMPDIR": ray_tmp}, watch=metrics_path)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(out, "timeline.jsonl")) as f:
        events = [json.loads(line) for line in f if line.strip()]
    arrivals = res.pop("arrivals")
    result = {**res, **gc.chatlearn_steps(rows, arrivals, w.sample_per_episode, warmup)}
    result["breakdown"] = gc.mean_breakdown(rows, events, warmup)
    result["first_step_done_s"] = arrivals[min(arrivals)] - res["start"] if arrivals else None
    # from the last metrics row to the process's exit: plots, Ray and the workers stopping
    result["after_last_step_s"] = res["wall_s"] - (arrivals[max(arrivals)] - res["start"]) if arrivals else None
    result["startup"] = gc.chatlearn_startup(rows)
    result.pop("start")
    return result


def run_trl(w: gc.Workload, cfg, model: str, trl_kwargs: dict, episodes: int, warmup: int, work: str,
            threads: int, expected: list) -> dict:
    r = cfg.models.reward
    if r.functions:
        raise SystemExit("the benchmark's TRL side scores with MathReward alone; leave models.reward.functions empty")
    spec = {"model": model, "data_path": w.data_path, "max_prompt_tokens": w.max_prompt_tokens,
            "prompt_key": cfg.runtime_args.prompt_key, "threads": threads,
            "reward": {"correct_score": r.correct_score, "incorrect_score": r.incorrect_score},
            "out": os.path.join(work, "trl_result.json"),
            "trl": {**trl_kwargs, "output_dir": os.path.join(work, "trl_output")}}
    with open(os.path.join(work, "spec.json"), "w") as f:
        json.dump(spec, f)
    res = run_process([sys.executable, os.path.join(BENCH, "trl_grpo_run.py"), os.path.join(work, "spec.json")],
                      os.path.join(work, "log.txt"), {"OMP_NUM_THREADS": str(threads)})
    with open(spec["out"]) as f:
        raw = json.load(f)
    res.pop("arrivals")
    start = res.pop("start")
    steps = raw["config"]["steps_per_generation"] // raw["config"]["gradient_accumulation_steps"]
    result = {**res, **gc.trl_steps(raw["step_ends"], raw["train_start"], raw["gens"], steps, warmup)}
    # perf_counter is CLOCK_MONOTONIC on Linux: the child's times are on the harness's clock
    result["first_step_done_s"] = raw["step_ends"][steps - 1] - start if len(raw["step_ends"]) >= steps else None
    result["after_last_step_s"] = res["wall_s"] - (raw["step_ends"][-1] - start) if raw["step_ends"] else None
    result["startup"] = gc.trl_startup(raw, start)
    result["prompts_match_chatlearn"] = check_trl_prompts(raw["gens"], expected, model,
                                                         trl_kwargs["chat_template_kwargs"]["enable_thinking"])
    result["trl_built_config"] = raw["config"]
    result["generated_batches"] = len(raw["gens"])
    return result


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------

SUMMARY_KEYS = ("samples_per_s", "tokens_per_s", "step_s", "episode_samples_per_s", "episode_tokens_per_s",
                "peak_rss_mb", "peak_pss_mb", "cpu_s", "reward_last", "response_len_mean", "first_step_done_s",
                "after_last_step_s", "wall_s", "max_processes")


def summarise(runs: list[dict]) -> dict:
    """Headline numbers of one run: throughput from the wall-clock step intervals."""
    flat = []
    for r in runs:
        flat.append({"samples_per_s": r.get("wall_samples_per_s"), "tokens_per_s": r.get("wall_tokens_per_s"),
                     "step_s": r.get("wall_step_s"), **{k: r.get(k) for k in SUMMARY_KEYS
                                                       if k not in ("samples_per_s", "tokens_per_s", "step_s")}})
    return gc.medians(flat, list(SUMMARY_KEYS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(gc.WORKLOADS))
    parser.add_argument("--systems", default=",".join(gc.SYSTEMS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 repetition, few steps: a smoke test")
    parser.add_argument("--results", default=os.path.join(BENCH, "results"))
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "chatlearn_bench"),
                        help="where generated models and run folders go")
    parser.add_argument("--keep-runs", action="store_true", help="keep each run's output folder")
    parser.add_argument("--update", action="store_true",
                        help="keep the workloads of the existing results that --workloads leaves out (each "
                             "records the commit it measured)")
    parser.add_argument("--readme", action="store_true",
                        help="run nothing: summarise the runs in --results again (JSON and markdown) and write "
                             "the README's table from them")
    args = parser.parse_args()
    if args.readme:
        return rewrite_reports(args.results)
    workloads = [gc.WORKLOADS[n] for n in args.workloads.split(",")]
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in gc.SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {', '.join(gc.SYSTEMS)}")
    if "trl" in systems:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("TRL is not installed: .venv/bin/pip install -c requirements/constraints-cpu.txt "
                             "-e '.[bench]' (or leave trl out of --systems)")
    repeats = 1 if args.quick else args.repeats
    threads = os.cpu_count() or 1
    os.makedirs(args.results, exist_ok=True)
    os.makedirs(args.cache, exist_ok=True)
    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    for mod in ("trl", "vllm", "ray"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    report = {"machine": f"{cpu_model()}, {threads} CPU(s)", "threads": threads,
              "repeats": repeats, "quick": args.quick, "versions": versions, "workloads": {}}

    suffix = "_quick" if args.quick else ""
    json_path = os.path.join(args.results, f"grpo_vs_trl{suffix}.json")
    if args.update and os.path.exists(json_path):
        with open(json_path, encoding="utf-8") as f:
            earlier = json.load(f)
        if (earlier["machine"], earlier["repeats"]) != (report["machine"], report["repeats"]):
            raise SystemExit(f"--update: {json_path} was measured on {earlier['machine']} with {earlier['repeats']} "
                             "repetition(s); measure every workload again here (without --update)")
        report["workloads"] = earlier["workloads"]  # those measured now are replaced, in their place
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or None
    failed = 0
    for w in workloads:
        episodes, warmup = gc.with_episodes(w, args.quick)
        model = model_dir(w.model, args.cache)
        probe = os.path.join(args.cache, "probe")
        cfg = resolved_config(w, model, probe, "vllm", episodes)
        trl_kwargs = gc.trl_config_kwargs(cfg, probe, episodes)
        settings = gc.shared_settings(cfg, {**trl_kwargs, "model": model})
        bad = gc.mismatches(settings)
        if bad:
            raise SystemExit(f"workload {w.name}: chatlearn and TRL settings differ: {bad}")
        params = gc.ModelSpec.params(w.model) if isinstance(w.model, gc.ModelSpec) else None
        desc = (f"{os.path.basename(model)}{f' ({params / 1e6:.1f}M params)' if params else ''}, "
                f"{w.sample_per_episode} samples ({w.sample_per_episode // w.group_size} prompts x {w.group_size}) "
                f"per step, {w.steps_per_episode} optimizer steps of {w.global_batch} (micro-batch "
                f"{w.micro_batch}), max {w.max_response} new tokens, {episodes} steps ({warmup} warm-up)")
        print(f"[bench] {w.name}: {desc}", flush=True)
        for name, (a, b) in settings.items():
            print(f"[bench]   {name}: chatlearn {a} | TRL {b}", flush=True)
        expected = expected_prompts(cfg, model, episodes) if "trl" in systems else []
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        entry = report["workloads"][w.name] = {
            "description": desc, "commit": commit, "episodes": episodes, "warmup": warmup, "model": model,
            "settings": {k: [str(a), str(b)] for k, (a, b) in settings.items()}, "runs": runs}
        for rep, system in gc.run_order(systems, repeats):
            work = tempfile.mkdtemp(prefix=f"{w.name}_{system}_{rep}_", dir=args.cache)
            print(f"[bench] {w.name} rep {rep + 1}/{repeats}: {system} ...", flush=True)
            try:
                if system == "trl":
                    res = run_trl(w, cfg, model, trl_kwargs, episodes, warmup, work, threads, expected)
                else:
                    res = run_chatlearn(w, model, system.split("-", 1)[1], episodes, warmup, work)
            except RunFailed as err:  # recorded; the other runs go on
                print(f"[bench]   FAILED: {err}", flush=True)
                runs[system].append({"error": str(err)[-2000:], "work": work})
                failed += 1
                continue
            res["work"] = work
            runs[system].append(res)
            print(f"[bench]   {res.get('wall_samples_per_s') or 0:.2f} samples/s, "
                  f"{res.get('wall_tokens_per_s') or 0:.1f} tokens/s, peak RSS sum {res['peak_rss_mb']:.0f} MB, "
                  f"reward {res.get('reward_last') or 0:.3f}, wall {res['wall_s']:.0f} s"
                  + (f", prompts as chatlearn's: {res['prompts_match_chatlearn']}" if system == "trl" else ""),
                  flush=True)
            if not args.keep_runs:
                shutil.rmtree(work, ignore_errors=True)
            entry.update(summarise_workload(runs))
            write_json(report, json_path, args.cache)  # after every run: an interrupted benchmark keeps what it measured
    text = gc.markdown(report)
    write_json(report, json_path, args.cache)
    with open(os.path.join(args.results, f"grpo_vs_trl{suffix}.md"), "w") as f:
        f.write(text)
    print(text)
    if failed:
        raise SystemExit(f"{failed} run(s) failed; see 'error' in {json_path}")


def rewrite_reports(results: str) -> None:
    """Summarise the recorded runs of ``results/grpo_vs_trl.json`` again (the medians and ratios as
    this version computes them), rewrite it and its markdown, and put the table into README.md."""
    json_path = os.path.join(results, "grpo_vs_trl.json")
    with open(json_path) as f:
        report = json.load(f)
    for entry in report["workloads"].values():
        entry.update(summarise_workload(entry["runs"]))
    with open(json_path + ".tmp", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(json_path + ".tmp", json_path)
    with open(os.path.join(results, "grpo_vs_trl.md"), "w") as f:
        f.write(gc.markdown(report))
    readme = os.path.join(REPO, "README.md")
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    with open(readme, "w", encoding="utf-8") as f:
        f.write(gc.replace_readme_table(text, gc.readme_table(report)))
    print(gc.readme_table(report))


def summarise_workload(runs: dict[str, list[dict]]) -> dict:
    """Medians per system over its successful runs, ratios chatlearn / TRL, chatlearn's breakdown."""
    ok = {s: [r for r in rs if "error" not in r] for s, rs in runs.items()}
    med = {s: summarise(rs) for s, rs in ok.items()}
    ratios = {s: {k: gc.ratio(med[s][k], med["trl"][k]) for k in
                  ("samples_per_s", "tokens_per_s", "peak_rss_mb", "peak_pss_mb", "cpu_s", "first_step_done_s",
                   "wall_s")}
              for s in med if s != "trl" and "trl" in med}
    for s in ratios:  # the whole command as a speed: TRL's seconds / chatlearn's (above 1: chatlearn is done first)
        ratios[s]["whole_command_speed"] = gc.ratio(med["trl"]["wall_s"], med[s]["wall_s"])
    startup = {s: gc.medians([r["startup"] for r in rs if r.get("startup")],
                             gc.startup_order({k for r in rs for k in r.get("startup") or {}}))
               for s, rs in ok.items()}
    breakdown = {s: gc.medians([r["breakdown"] for r in rs], list(gc.SHOWN)) for s, rs in ok.items() if s != "trl"}
    out = {"median": med, "ratio_vs_trl": ratios, "breakdown": breakdown, "startup": startup}
    if ok.get("trl"):
        out["trl_prompts_match_chatlearn"] = all(r["prompts_match_chatlearn"] for r in ok["trl"])
    return out


def write_json(report: dict, path: str, cache: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(gc.portable_paths(report, {"cache": cache}), f, indent=1, default=str)
    os.replace(path + ".tmp", path)

if __name__ == "__main__":
    main()
