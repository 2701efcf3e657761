"""The pure parts of bench/grpo_vs_trl.py: the chatlearn <-> TRL mapping, the run order and
medians, steady-state throughput, the episode breakdown, and the process-tree memory sampler."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))

import grpo_compare as gc  # noqa: E402
from proc_memory import ENV_MARKER, RunMemory  # noqa: E402


def resolved(w: gc.Workload, tmp_path, extra=()):
    from chatlearn.config.load import load_config

    model = gc.TINY_MODEL  # the medium spec's folder is generated; the mapping does not read it
    if w.max_prompt_tokens + w.max_response > 256:  # the tiny model's positions: a copy that takes more
        import json
        import shutil

        model = str(tmp_path / "tiny_long")
        if not os.path.exists(model):
            shutil.copytree(gc.TINY_MODEL, model)
            with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            config["max_position_embeddings"] = w.max_prompt_tokens + w.max_response
            with open(os.path.join(model, "config.json"), "w", encoding="utf-8") as f:
                json.dump(config, f)
    return load_config(gc.TEMPLATE, [*gc.chatlearn_overrides(w, model, str(tmp_path / "out"), "vllm", 7), *extra])


@pytest.mark.parametrize("name", sorted(gc.WORKLOADS))
def test_mapping_agrees_with_chatlearns_plan(name, tmp_path):
    from chatlearn.config.plan import make_plan

    w = gc.WORKLOADS[name]
    cfg = resolved(w, tmp_path)
    plan = make_plan(cfg)
    kw = gc.trl_config_kwargs(cfg, str(tmp_path / "trl"), 7)
    assert gc.mismatches(gc.shared_settings(cfg, {**kw, "model": cfg.models.policy_trainer.load})) == []
    # TRL's arithmetic (GRPOConfig.__post_init__), written out: micro-steps per generated batch,
    # optimizer steps = micro-steps / gradient accumulation
    micro_steps = kw["generation_batch_size"] // kw["per_device_train_batch_size"]
    assert micro_steps // kw["gradient_accumulation_steps"] == plan.steps_per_episode == w.steps_per_episode
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == plan.samples_per_step
    assert kw["generation_batch_size"] == plan.samples_per_episode
    assert kw["max_steps"] == 7 * plan.steps_per_episode
    assert (kw["num_generations"], kw["max_completion_length"]) == (plan.group_size, w.max_response)
    assert kw["loss_type"] == "dapo" and kw["beta"] == cfg.models.policy_trainer.kl_coef == 0.0
    assert cfg.runtime_args.data_shuffle is False and kw["shuffle_dataset"] is False
    assert cfg.models.policy.top_k == -1 and kw["top_k"] == 0 and kw["top_p"] == 1.0


def test_mapping_reports_a_difference(tmp_path):
    w = gc.WORKLOADS["tiny"]
    kw = gc.trl_config_kwargs(resolved(w, tmp_path), str(tmp_path / "trl"), 7)
    changed = resolved(w, tmp_path, ["models.policy.temperature=0.7", "models.policy_trainer.kl_coef=0.01",
                                     "models.policy_trainer.optimizer.lr_decay_style=cosine"])
    assert sorted(gc.mismatches(gc.shared_settings(changed, {**kw, "model": gc.TINY_MODEL}))) == [
        "kl coefficient", "lr schedule", "temperature"]


@pytest.mark.parametrize("name", sorted(gc.WORKLOADS))
def test_trl_builds_the_mapped_config(name, tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    from chatlearn.config.plan import make_plan

    cfg = resolved(gc.WORKLOADS[name], tmp_path)
    built = GRPOConfig(**gc.trl_config_kwargs(cfg, str(tmp_path / "trl"), 7))
    assert built.steps_per_generation // built.gradient_accumulation_steps == make_plan(cfg).steps_per_episode
    assert built.generation_batch_size == cfg.runtime_args.sample_per_episode
    assert built.lr_scheduler_type == "constant" and built.warmup_steps == 0 and not built.bf16
    assert gc.mismatches(gc.shared_settings(cfg, {**vars(built), "model": cfg.models.policy_trainer.load})) == []


def test_medium_model_size():
    spec = gc.MEDIUM_SPEC
    assert 20e6 <= spec.params() <= 60e6
    torch = pytest.importorskip("torch")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    small = gc.ModelSpec(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96)
    config = Qwen2Config(vocab_size=small.vocab, hidden_size=small.hidden, num_hidden_layers=small.layers,
                         num_attention_heads=small.heads, num_key_value_heads=small.kv_heads,
                         intermediate_size=small.intermediate, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    assert small.params() == sum(p.numel() for p in model.parameters())


def test_run_order_interleaves_and_medians():
    systems = ["chatlearn-vllm", "chatlearn-hf", "trl"]
    order = gc.run_order(systems, 3)
    assert [s for _, s in order] == systems * 3
    assert [r for r, _ in order] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(a != b for (_, a), (_, b) in zip(order, order[1:]))
    runs = [{"x": 3.0, "y": None}, {"x": 1.0, "y": 2.0}, {"x": 10.0, "y": 4.0}, {"x": 2.0}]
    assert gc.medians(runs, ["x", "y", "z"]) == {"x": statistics.median([3, 1, 10, 2]), "y": 3.0, "z": None}


def test_steady_state_throughput():
    rows = [{"episode": e, "time/episode": 2.0 * e, "train/response_len_mean": 5.0 + e, "train/reward_mean": 0.1 * e}
            for e in range(1, 6)]
    rows[-1]["time/checkpoint"] = 0.5
    arrivals = {e: 100.0 + 3.0 * e * e for e in range(1, 6)}
    out = gc.chatlearn_steps(rows, arrivals, samples=10, warmup=2)
    # episodes 3 and 4 (1-2 warm-up, 5 saved a checkpoint)
    assert out["episode_samples_per_s"] == pytest.approx(20 / (6 + 8))
    assert out["episode_tokens_per_s"] == pytest.approx((8 * 10 + 9 * 10) / 14)
    assert out["wall_step_s"] == pytest.approx(((27 - 12) + (48 - 27)) / 2)
    assert out["wall_samples_per_s"] == pytest.approx(20 / 36)
    assert out["reward_last"] == pytest.approx((0.3 + 0.4 + 0.5) / 3)

    # 5 generated batches of 2 optimizer steps each; batch g ends at step_ends[2g + 1]
    step_ends = [10.0, 11.0, 13.0, 17.0, 20.0, 26.0, 30.0, 33.0, 40.0, 41.0]
    gens = [{"samples": 8, "tokens": 8 * (g + 2), "reward_mean": g / 10} for g in range(5)]
    trl = gc.trl_steps(step_ends, 5.0, gens, steps_per_gen=2, warmup=2)
    # batches 2 and 3 (0-1 warm-up, 4 the last): 17 -> 26 -> 33
    assert trl["wall_step_s"] == pytest.approx((33 - 17) / 2)
    assert trl["wall_samples_per_s"] == pytest.approx(16 / 16)
    assert trl["wall_tokens_per_s"] == pytest.approx((32 + 40) / 16)
    assert trl["response_len_mean"] == pytest.approx(4.5)


def test_episode_breakdown_adds_up():
    events = [
        {"episode": 3, "kind": "stage", "stage": "generate", "seconds": 2.0},
        {"episode": 3, "kind": "transition", "seconds": 0.1},  # policy out
        {"episode": 3, "kind": "transition", "seconds": 0.2},  # trainer in: belongs to old_logprobs
        {"episode": 3, "kind": "stage", "stage": "reward", "seconds": 0.7},  # written in between
        {"episode": 3, "kind": "stage", "stage": "old_logprobs", "seconds": 1.0},
        {"episode": 3, "kind": "transition", "seconds": 0.05},
        {"episode": 3, "kind": "stage", "stage": "train", "seconds": 3.0},
        {"episode": 3, "kind": "transition", "seconds": 0.01},
        {"episode": 3, "kind": "stage", "stage": "weight_push", "seconds": 0.4},
        {"episode": 3, "kind": "transition", "seconds": 0.04},  # KV cache after the push: no stage
        {"episode": 4, "kind": "stage", "stage": "generate", "seconds": 2.0},
    ]
    trans = gc.transitions_by_stage(events)
    assert trans[(3, "old_logprobs")] == pytest.approx(0.3)
    assert trans[(3, "train")] == pytest.approx(0.05)
    assert trans[(3, "weight_push")] == pytest.approx(0.01)
    assert trans.get((4, "generate"), 0.0) == 0.0 and (3, "reward") not in trans
    row = {"episode": 3, "time/episode": 7.0, "time/generate": 2.0, "time/reward": 1.5, "time/old_logprobs": 1.0,
           "time/train": 3.0, "time/weight_push": 0.4, "time/transitions": 0.4, "time/model_compute": 5.6}
    b = gc.episode_breakdown(row, trans)
    assert b["generation"] == pytest.approx(2.0)
    assert b["logprobs"] == pytest.approx(0.7)
    assert b["reward_exposed"] == pytest.approx(0.5)  # scoring outlasted the 1.0 s log-prob pass
    assert b["training"] == pytest.approx(2.95)
    assert b["weight_push"] == pytest.approx(0.39)
    assert b["other"] == pytest.approx(7.0 - (2.0 + 0.7 + 0.5 + 2.95 + 0.39 + 0.4))
    assert sum(b[k] for k in gc.BREAKDOWN) == pytest.approx(7.0)
    assert b["overhead_share"] == pytest.approx(0.2)
    rows = [dict(row, episode=e) for e in (1, 2, 3)] + [dict(row, episode=4, **{"time/checkpoint": 1.0})]
    mean = gc.mean_breakdown(rows, events, warmup=1)  # episodes 2 and 3
    assert mean["episode"] == pytest.approx(7.0) and mean["overhead_share"] == pytest.approx(0.2)


CHILD = """
import os, time
if os.fork() == 0:  # a grandchild that leaves the tree (re-parented) and holds 100 MB
    os.setsid()
    if os.fork() == 0:
        more = b"\\x02" * 100_000_000
        time.sleep(3)
        os._exit(0)
    os._exit(0)
block = b"\\x01" * 150_000_000
time.sleep(3)
"""


def test_run_memory_counts_the_whole_tree():
    marker = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=dict(os.environ, **{ENV_MARKER: marker}))
    mem = RunMemory(proc.pid, marker, interval=0.05, pss_interval=0.2).start()
    proc.wait()
    time.sleep(1.0)
    out = mem.stop()
    assert out["peak_rss_mb"] > 150 + 100  # the child alone holds 150 MB + the interpreter
    assert out["max_processes"] >= 2 and out["cpu_s"] > 0


def test_result_files_carry_no_path_of_this_machine(tmp_path):
    """Paths in bench result files: repo-relative inside the repository, ``<name>/...`` under a named
    root (the benchmark's cache), else ``<abs>/basename``; the committed results hold none."""
    import glob
    import json

    report = {"model": os.path.join(REPO, "assets", "tiny_qwen2"), "n": 3, "ok": "samples/s",
              "runs": [{"work": str(tmp_path / "cache" / "run_0")}, {"work": "/elsewhere/x"}],
              "args": [str(tmp_path / "cache"), "relative/path"]}
    assert gc.portable_paths(report, {"cache": str(tmp_path / "cache")}) == {
        "model": "assets/tiny_qwen2", "n": 3, "ok": "samples/s",
        "runs": [{"work": "<cache>/run_0"}, {"work": "<abs>/x"}], "args": ["<cache>", "relative/path"]}
    for path in glob.glob(os.path.join(REPO, "bench", "results", "*.json")):
        def strings(v):
            if isinstance(v, dict):
                return [s for x in v.values() for s in strings(x)]
            if isinstance(v, list):
                return [s for x in v for s in strings(x)]
            return [v] if isinstance(v, str) else []
        with open(path, encoding="utf-8") as f:
            absolute = [s for s in strings(json.load(f)) if os.path.isabs(s)]
        assert not absolute, (path, absolute[:3])


def test_readme_table_is_the_recorded_results():
    """README.md's benchmark table is what bench/grpo_vs_trl.py --readme makes of
    bench/results/grpo_vs_trl.json, and that file has the layout the README and tools read:
    workloads.<name>.ratio_vs_trl.<system>.{samples_per_s, peak_pss_mb, first_step_done_s,
    whole_command_speed} for every chatlearn system on every workload of the benchmark, and each
    system's start-up phases."""
    import json

    with open(os.path.join(REPO, "bench", "results", "grpo_vs_trl.json")) as f:
        report = json.load(f)
    assert set(gc.WORKLOADS) <= set(report["workloads"])
    for name, wl in report["workloads"].items():
        for system in ("chatlearn-vllm", "chatlearn-hf"):
            ratios = wl["ratio_vs_trl"][system]
            assert all(isinstance(ratios[k], float) for k in ("samples_per_s", "peak_rss_mb", "peak_pss_mb",
                                                              "first_step_done_s", "whole_command_speed")), name
            assert {"imports", "ray", "models", "first_episode", "total"} <= set(wl["startup"][system]), name
        assert {"imports", "setup", "first_episode"} <= set(wl["startup"]["trl"]), name
        assert wl["settings"] and all(a == b for a, b in wl["settings"].values()), name  # both sides', alike
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert gc.replace_readme_table(readme, gc.readme_table(report)) == readme


def test_startup_phases_of_both_systems():
    """chatlearn's start-up comes from its first ``perf/startup/*`` row; TRL's from the marks its runner
    records on the harness's clock, its first episode ending with the last optimizer step of the
    first generated batch."""
    rows = [{"episode": 0, "eval/reward_mean": 0.1},
            {"episode": 1, "perf/startup/imports_s": 1.5, "perf/startup/ray_s": 2.0, "perf/startup/total_s": 9.0,
             "perf/startup/policy_trainer/process_s": 4.0, "perf/overhead_share": 0.1},
            {"episode": 2, "perf/startup/total_s": 99.0}]
    assert gc.chatlearn_startup(rows) == {"imports": 1.5, "ray": 2.0, "total": 9.0, "policy_trainer/process": 4.0}
    raw = {"imports_done": 14.0, "setup_done": 17.0, "train_start": 17.5, "step_ends": [19.0, 20.0, 22.0],
           "config": {"steps_per_generation": 4, "gradient_accumulation_steps": 2}}
    out = gc.trl_startup(raw, start=10.0)
    assert out == pytest.approx({"imports": 4.0, "setup": 3.0, "to_train": 0.5, "first_episode": 2.5, "total": 10.0})
