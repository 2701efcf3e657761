"""A vision-language run end to end (``template/grpo_vlm.yaml``: the VLM toy on images of digits, the hf rollout,
the FSDP trainer, a reference for the KL term): SIGKILL while checkpoint 2 is written, rerun, the same metrics as
an uninterrupted run; the sample logs name each prompt's image; ``chatlearn merge`` of the last checkpoint gives
a folder that loads with its processor and the trainer's weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import runs

from conftest import REPO

RUN = ["runtime_args.num_episode=3", "runtime_args.sample_per_episode=32", "runtime_args.train_global_batch_size=16",
       "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
       "runtime_args.eval_episode_interval=2", "models.policy.eval_num_inference_per_prompt=1",
       "runtime_args.save_episode_interval=1", "models.policy_trainer.kl_coef=0.01",
       "runtime_args.log_args_dict.log_samples_interval=1", "runtime_args.log_args_dict.log_samples_num=2"]


def command(out):
    evals = os.path.join(os.path.dirname(out), "eval.jsonl")
    with open(os.path.join(REPO, "assets", "vlm_digits", "eval.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f.readlines()[:16]]
    for r in rows:  # the images by absolute path: the file is written elsewhere
        for part in r["prompt"][0]["content"]:
            if part["type"] == "image":
                part["image"] = os.path.join(REPO, "assets", "vlm_digits", part["image"])
    with open(evals, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_vlm.yaml", *RUN,
            f"runtime_args.eval_data_path={evals}", f"runtime_args.output_dir={out}"]


def finish(out):
    return runs.finish(command(out), timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_vlm_run_resumes_exactly_logs_its_images_and_merges(tmp_path):
    ref = tmp_path / "uninterrupted"
    finish(ref)
    expected = runs.learning_metrics(ref)
    assert [r["episode"] for r in expected] == [0, 1, 2, 3]
    with open(ref / "samples.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert rows and all(r["images"] and r["images"][0].endswith(".png") for r in rows)

    out = tmp_path / "killed_in_save"
    tmp_ckpt = out / "checkpoints" / "episode_000002.tmp"
    runs.run_and_kill(command(out), lambda: (tmp_ckpt / "trainer").exists(),
                      env={"CHATLEARN_CHECKPOINT_TEST_DELAY": "5@2"})
    assert (out / "checkpoints" / "latest").read_text().strip() == "episode_000001"
    assert "episode 1)" in finish(out)
    assert runs.learning_metrics(out) == expected

    merged = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", "merge", str(ref / "checkpoints" / "episode_000003"),
                           str(merged)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import torch
    from transformers import AutoModelForImageTextToText

    from chatlearn.data.vision import VisionProcessor

    model = AutoModelForImageTextToText.from_pretrained(merged).eval()
    saved = AutoModelForImageTextToText.from_pretrained(ref / "checkpoints" / "episode_000003" / "hf").eval() \
        if (ref / "checkpoints" / "episode_000003" / "hf").exists() else None
    assert VisionProcessor(str(merged)).image_token_id == model.config.image_token_id
    start = AutoModelForImageTextToText.from_pretrained(os.path.join(REPO, "assets", "tiny_qwen2_vl")).state_dict()
    now = model.state_dict()
    assert any(not torch.equal(now[k], start[k]) for k in now if "language_model" in k)  # it trained
    assert all(torch.equal(now[k], start[k]) for k in now if ".visual." in k)  # the frozen tower did not
    if saved is not None:
        assert all(torch.equal(v, saved.state_dict()[k]) for k, v in now.items())
