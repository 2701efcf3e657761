"""End to end with LoRA (models.policy_trainer.lora): the tiny default, transformers rollout, 2 episodes
(the suite's shared ``lora`` run, tests/support/shared_runs.py; tests/e2e/test_lora_resume.py resumes it).

The run checks: the plan starts no ref_policy (the trainer gives the reference log-probs with its
adapters disabled), the adapters learn (non-zero gradient norm, the policy moves away from the
reference), the rollout generates with the trained adapters (the adapters alone pushed after episode 1 and
merged by the rollout onto its base weights: the push's landing probe agrees with the trainer; sync/bytes is
a fraction of sync/full_bytes), the checkpoint holds only the adapters, the HF
folder is the merged model, and ``chatlearn merge`` of the checkpoint gives peft's adapter folder and (``--merged``)
the merged model, which ``chatlearn eval`` scores alike."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from shared_runs import finished

from conftest import REPO

@pytest.mark.slow
@pytest.mark.timeout(900)  # the run (if no test made it yet), then two merges and two evaluations
def test_lora_run(tmp_path):
    run = finished("lora").check()
    out = run.out
    assert "ref_policy: not started (LoRA" in run.stdout
    rows = run.rows()
    train = [r for r in rows if "train/loss" in r]
    assert [r["episode"] for r in train] == [1, 2]
    for r in train:
        assert r["train/grad_norm"] > 0, r
        assert "time/ref_logprobs" in r, r
    # the trainer's log-probs of the sampled tokens come from the (only) optimizer step's forward: they
    # equal the rollout's in episode 1 (B = 0); the merged adapters in the rollout are checked by every
    # push's landing probe: a gap far within float32's tolerance
    assert train[0]["train/logprob_diff_rollout_vs_trainer_max"] < 1e-4, train[0]
    pushes = [r for r in rows if "sync/bytes" in r]
    assert pushes and all(0 < r["sync/bytes"] * 5 < r["sync/full_bytes"] for r in pushes), pushes  # adapters alone
    assert all(r["sync/landing_gap_max"] < 1e-4 for r in pushes), pushes
    # episode 1 (one optimizer step): the adapters start at B = 0, the policy is the base
    assert train[0]["train/kl"] == 0
    assert train[1]["train/kl"] > 1e-6  # episode 2: trained adapters (also in the rollout, checked above)
    ckpt = out / "checkpoints" / "episode_000002"
    meta = json.loads((ckpt / "trainer" / "chatlearn_checkpoint.json").read_text())
    assert meta["tensors"] and all(".lora_A." in n or ".lora_B." in n for n in meta["tensors"])
    assert meta["lora"]["rank"] == 8 and meta["lora"]["base"]["folder"].endswith("tiny_qwen2")
    from safetensors import safe_open

    with safe_open(str(ckpt / "hf" / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in names and not [n for n in names if "lora" in n]
    merge_and_evaluate(ckpt, tmp_path)


EVAL = ["runtime_args.rollout_backend=hf", "models.policy.eval_num_inference_per_prompt=2",
        "models.policy.max_response_tokens_length=16"]


def merge_and_evaluate(ckpt, tmp_path):
    """The run's LoRA checkpoint through ``chatlearn merge`` (peft's adapter folder, and ``--merged``) and
    ``chatlearn eval`` of both folders, on the first 16 prompts of the eval set: the same samples and scores."""
    from chatlearn.cli import main

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["merge", str(ckpt), str(adapter)]) == 0
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
    assert main(["merge", str(ckpt), str(merged), "--merged"]) == 0
    data = tmp_path / "eval.jsonl"
    with open(os.path.join(REPO, "assets", "arith", "eval.jsonl"), encoding="utf-8") as f:
        data.write_text("".join(f.readlines()[:16]))
    results = {}
    for name, folder in (("adapter", adapter), ("merged", merged)):
        cmd = [sys.executable, "-m", "chatlearn.cli", "eval", "template/grpo_fsdp.yaml", *EVAL,
               f"runtime_args.eval_data_path={data}", f"runtime_args.output_dir={tmp_path / ('eval_' + name)}",
               "--checkpoint", str(folder)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        ev = tmp_path / f"eval_{name}" / "eval"
        results[name] = (json.loads((ev / "metrics.json").read_text()),
                         [json.loads(line) for line in (ev / "samples.jsonl").read_text().splitlines()])
    (m_adapter, s_adapter), (m_merged, s_merged) = results["adapter"], results["merged"]
    assert m_adapter["metrics"] == m_merged["metrics"]
    assert [s["response"] for s in s_adapter] == [s["response"] for s in s_merged] and len(s_adapter) == 32
    assert m_adapter["model_deleted"] and not (tmp_path / "eval_adapter" / "eval" / "merged_model").exists()
