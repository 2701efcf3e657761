"""Placement end to end: all four models colocated on 2 logical devices (the residency
invariant over the recorded timeline, and exactly the transitions the schedule needs; the rollout
replicas in the trainer ranks' processes train exactly as in processes of their own),
partial colocation and full disaggregation (training end to end, learning like the
colocated run, which joins a cluster started with ``ray start --head``)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from runs import learning_metrics, small_eval_set

from conftest import REPO
from chatlearn.runtime.driver.scheduler import residency_violations

SHORT = ["runtime_args.num_episode=3", "runtime_args.sample_per_episode=32",
         "runtime_args.train_global_batch_size=16", "runtime_args.train_micro_batch_size=8",
         "models.policy.num_inference_per_prompt=4", "runtime_args.eval_episode_interval=3",
         "models.policy.eval_num_inference_per_prompt=1", "models.policy_trainer.kl_coef=0.01",
         "runtime_args.save_episode_interval=0", "models.policy_trainer.save_hf=false",
         # the parts move between turns as on GPUs (without a GPU they stay by default): the schedule is checked
         "runtime_args.offload_without_gpu=true"]

# the turns of one steady-state episode under full colocation, in order
EXPECTED = [
    ("policy", "offload", ["weights", "kv_cache"]),           # ref_policy's turn
    ("ref_policy", "onload", ["weights"]),
    ("ref_policy", "offload", ["weights"]),                   # the trainer's turn
    ("policy_trainer", "onload", ["weights"]),                # old log-probs ...
    ("policy_trainer", "onload", ["optimizer", "grads"]),     # ... then training, weights stay
    ("policy_trainer", "offload", ["optimizer", "grads"]),    # the push: trainer weights stay
    ("policy", "onload", ["weights"]),
    ("policy_trainer", "offload", ["weights"]),               # after the push
    ("policy", "onload", ["kv_cache"]),                       # the rollout stays for the next episode
]


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def command(out, *overrides):
    return [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *SHORT,
            f"runtime_args.eval_data_path={small_eval_set(os.path.dirname(out))}", f"runtime_args.output_dir={out}",
            *overrides]


def run_together(runs, timeout=560):
    """Runs ``[(out, overrides, env), ...]`` at the same time (independent runs: each its own Ray, or its
    own place on a shared cluster; most of a run's start-up is waiting, which the others fill); for each,
    (the finished process, its metrics rows, its timeline events). Every run must succeed."""
    procs = []
    try:
        for out, overrides, env in runs:
            procs.append((out, subprocess.Popen(command(out, *overrides), cwd=REPO, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True,
                                                env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})))
        done = []
        for out, proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            proc.stdout, proc.stderr = stdout, stderr
            assert proc.returncode == 0, f"{out}: " + stdout[-3000:] + stderr[-5000:]
            done.append((proc, read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "timeline.jsonl")))
        return done
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_four_models_colocated_on_two_devices(tmp_path):
    over = ["runtime_args.colocation=[policy,policy_trainer,ref_policy,reward]", "models.policy_trainer.num_gpu=2",
            "runtime_args.rollout_backend=vllm"]
    # runtime_args.fuse_rollout=false: the replicas in processes of their own (checked below); both at once
    (proc, rows, events), (apart, apart_rows, apart_events) = run_together(
        [(tmp_path / "out", over, None), (tmp_path / "apart", [*over, "runtime_args.fuse_rollout=false"], None)])
    assert "device group 0 (devices 0..1): policy, policy_trainer, ref_policy, reward" in proc.stdout
    # vLLM's CPU build, one replica per trainer rank: each rollout replica runs in its trainer rank's process
    assert "in the processes of policy_trainer (fused" in proc.stdout
    groups = [["policy", "policy_trainer", "ref_policy", "reward"]]

    # the invariant holds after every transition and during every stage
    for e in events:
        assert not residency_violations(groups, e["resident"]), e

    # the schedule skips what nothing needs: each steady episode makes exactly these turns
    for episode in (2, 3):
        got = [(e["model"], e["action"], e["parts"]) for e in events
               if e["kind"] == "transition" and e["episode"] == episode]
        assert got == EXPECTED, (episode, got)
        assert [r for r in rows if r["episode"] == episode][0]["sched/transitions"] == len(EXPECTED)
    # two-step wake of the rollout engine: weights, the push, then the KV cache; the KV cache is woken
    # inside the push's stage (a stage's event is written at its end), after the transfer, for the
    # landing check's probe (runtime_args.weight_push_check, on by default)
    ep3 = [e for e in events if e["episode"] == 3]
    order = [(e["kind"], e.get("model"), e.get("action") or e.get("stage"), tuple(e.get("parts", ())))
             for e in ep3]
    i = order.index(("transition", "policy", "onload", ("weights",)))
    j = order.index(("stage", "policy", "weight_push", ()))
    k = order.index(("transition", "policy", "onload", ("kv_cache",)))
    assert i < k < j
    # every turn of a steady episode really moved bytes (the vLLM engine on the CPU included)
    for e in events:
        if e["kind"] == "transition" and e["episode"] >= 2:
            assert e["bytes"] > 0, e
    for r in rows[1:]:
        assert r["train/logprob_diff_rollout_vs_trainer_max"] < 1e-4, r
        assert 0 <= r["perf/overhead_share"] < 1

    # runtime_args.fuse_rollout=false: the replicas in processes of their own train exactly alike (the
    # fused push broadcasts rank 0's buckets over the trainers' group, the separate one streams them)
    assert "in the processes of policy_trainer" not in apart.stdout
    assert learning_metrics(tmp_path / "apart") == learning_metrics(tmp_path / "out")
    # the same turns (what moves does not depend on which process holds the engine)
    assert ([(e["model"], e["action"], e["parts"]) for e in apart_events if e["kind"] == "transition"]
            == [(e["model"], e["action"], e["parts"]) for e in events if e["kind"] == "transition"])
    # one process holds both: the same peak; apart, the rollout's process has its own
    assert rows[-1]["memory/policy_peak_mb"] == rows[-1]["memory/policy_trainer_peak_mb"]
    assert apart_rows[-1]["memory/policy_peak_mb"] != apart_rows[-1]["memory/policy_trainer_peak_mb"]
    assert rows[-1]["sync/bytes"] == apart_rows[-1]["sync/bytes"] > 0


def _learning(rows):
    return [r["train/reward_mean"] for r in rows if "train/reward_mean" in r]


def start_ray_head():
    """A Ray cluster started with ``ray start --head`` (one logical device) and its address. --block: the
    head's processes live as long as the returned process, and go with it (not `ray stop`, which would stop
    every Ray cluster of the machine)."""
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable))
    assert ray_bin, "the ray command is installed with the package"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--port=0", "--num-cpus=2",
                             "--num-gpus=1", "--include-dashboard=false", "--disable-usage-stats"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen = []
    for line in head.stdout:
        seen.append(line)
        if "ray start --address=" in line:
            return head, line.split("'")[1]
    stop_ray_head(head, None)
    raise AssertionError("".join(seen))


def stop_ray_head(head, address):
    head.terminate()
    head.wait(timeout=120)
    # `ray start` leaves its address for later `ray.init()` calls on this machine
    current = os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")
    if address and os.path.isfile(current) and open(current).read().strip() == address:
        os.remove(current)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_placements_train_like_colocated_and_join_a_ray_cluster(tmp_path):
    """The colocated run joins a cluster started with ``ray start --head``; the partial and the
    disaggregated placements (a local Ray each) train exactly like it."""
    head, address = start_ray_head()
    try:  # the three at once: the colocated one on the started cluster, the others each on a Ray of its own
        done = run_together([(tmp_path / "colocated", ["runtime_args.colocation=[policy,policy_trainer,ref_policy]",
                                                       "runtime_args.rollout_backend=hf"], {"RAY_ADDRESS": address})]
                            + [(tmp_path / name, [f"runtime_args.colocation={coloc}", "runtime_args.rollout_backend=hf"],
                                None)
                               for name, coloc in (("partial", "[policy_trainer,ref_policy]"), ("disaggregated", "[]"))],
                            timeout=400)
    finally:
        stop_ray_head(head, address)
    runs = dict(zip(("colocated", "partial", "disaggregated"), done))
    assert f"joining the Ray cluster at {address}" in runs["colocated"][0].stdout
    assert [r["episode"] for r in runs["colocated"][1]] == [0, 1, 2, 3]  # the eval before training, then 3 episodes
    # colocated, the transformers engine runs in the trainer's process (runtime_args.fuse_rollout)
    assert "in the processes of policy_trainer (fused" in runs["colocated"][0].stdout
    assert "device group 1 (device 1): policy" in runs["partial"][0].stdout
    assert "device group 2 (device 2): ref_policy" in runs["disaggregated"][0].stdout
    # the rollout never leaves its own devices when it shares them with nothing
    for name in ("partial", "disaggregated"):
        events = runs[name][2]
        assert not [e for e in events if e["kind"] == "transition" and e["model"] == "policy"], name
        assert not [e for e in events if e["kind"] == "transition"] or name == "partial"
    # the same data, seeds and math: the same learning curve as the colocated run
    base = _learning(runs["colocated"][1])
    for name in ("partial", "disaggregated"):
        got = _learning(runs[name][1])
        assert got == pytest.approx(base, abs=1e-6), name
        assert runs[name][1][-1]["eval/reward_mean"] == pytest.approx(
            runs["colocated"][1][-1]["eval/reward_mean"], abs=1e-6)
        assert all(r["train/logprob_diff_rollout_vs_trainer_max"] < 1e-4 for r in runs[name][1][1:])
