"""``chatlearn sft`` end to end (the FSDP2 trainer in the driver's process): a short fine-tune of the toy on the
addition conversations, its result folder loaded by ``chatlearn run``'s config as the policy, and exact resume
after a SIGKILL in the middle of a checkpoint save (the same metrics rows and the same final weights as the run
that was not interrupted)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import runs
import torch
from metrics_doc import undocumented
from safetensors.torch import load_file

from conftest import REPO

RUN = ["sft.max_steps=6", "sft.global_batch_size=16", "models.policy_trainer.train_micro_batch_size=8",
       "sft.save_interval=2", "sft.eval_interval=3", "sft.eval_reward=false", "runtime_args.keep_last_checkpoints=2",
       "models.policy_trainer.optimizer.lr_warmup_iters=1"]


def eval_conversations(folder, n: int = 16) -> str:
    path = os.path.join(folder, "sft_eval.jsonl")
    with open(os.path.join(REPO, "assets", "arith_sft", "eval.jsonl"), encoding="utf-8") as f:
        rows = f.readlines()[:n]
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(rows))
    return path


def command(out):
    return [sys.executable, "-m", "chatlearn.cli", "sft", "template/sft.yaml", *RUN,
            f"sft.eval_data_path={eval_conversations(os.path.dirname(out))}", f"runtime_args.output_dir={out}"]


def finish(out):
    return runs.finish(command(out))


def sft_rows(out) -> list:
    return [{k: v for k, v in r.items() if k == "episode" or k.startswith("sft/") and k != "sft/tokens_per_s"}
            for r in runs.metric_rows(out)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The FSDP2 run of ``RUN`` (6 steps), shared by the tests below: (its folder, its console, its rows)."""
    ref = tmp_path_factory.mktemp("sft") / "uninterrupted"
    stdout = finish(ref)
    return ref, stdout, sft_rows(ref)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sft_learns_loads_as_the_policy_and_resumes_exactly_after_sigkill(uninterrupted, tmp_path):
    ref, stdout, rows = uninterrupted
    assert [r["episode"] for r in rows] == list(range(7))  # step 0: the eval loss before training
    assert [("sft/eval_loss" in r) for r in rows] == [True, False, False, True, False, False, True]
    assert all(r["sft/num_tokens"] > 0 and r["sft/skipped_steps"] == 0 for r in rows[1:])
    assert rows[-1]["sft/eval_loss"] < rows[0]["sft/eval_loss"]  # it learns the held-out answers
    assert not undocumented({k for r in runs.metric_rows(ref) for k in r if k != "time/wall"})  # docs/metrics.md
    assert sorted(os.listdir(ref / "checkpoints")) == ["episode_000004", "episode_000006", "latest"]
    result = ref / "result"
    assert "chatlearn run ... models.policy_trainer.load=" in stdout

    # the result is a Hugging Face folder chatlearn run takes as the policy (validated as a model folder)
    from chatlearn.config.load import load_config

    cfg = load_config(os.path.join(REPO, "template/grpo_fsdp.yaml"),
                      [f"models.policy_trainer.load={result}", "runtime_args.rollout_backend=hf"])
    assert cfg.models.policy.load == str(result)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(result)

    # killed while writing checkpoint 4 (step 4 trained, its row written): checkpoint 2 stays usable, and the
    # rerun trains steps 3 to 6 again exactly
    out = tmp_path / "killed_in_save"
    tmp_ckpt = out / "checkpoints" / "episode_000004.tmp"
    runs.run_and_kill(command(out), lambda: (tmp_ckpt / "trainer").exists(),
                      env={"CHATLEARN_CHECKPOINT_TEST_DELAY": "5@4"})
    assert not (out / "checkpoints" / "episode_000004").exists() and (out / "checkpoints" / "episode_000002").exists()
    assert len(runs.metric_rows(out)) == 5  # steps 0..4
    resumed = finish(out)
    assert "resuming from" in resumed and "episode_000002" in resumed
    assert sft_rows(out) == rows
    mine, theirs = load_file(out / "result" / "model.safetensors"), load_file(result / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_on_the_megatron_trainer_tracks_fsdp(uninterrupted, tmp_path):
    """``chatlearn sft`` on the Megatron trainer (TP 2, the trainer actors under the test-only CPU device shim, as
    in test_megatron_e2e.py): the same loss, gradient norm and eval loss per step as the FSDP2 run of the same
    config (the shared 6-step run), and a result folder transformers loads."""
    site = os.path.join(REPO, "tests", "support", "megatron_cpu_site")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CHATLEARN_TEST_MEGATRON_CPU_SHIM": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)}
    megatron = ["runtime_args.train_backend=megatron", "models.policy_trainer.num_gpu=2",
                "models.policy_trainer.tensor_model_parallel_size=2", "sft.save_interval=6"]  # one save: the end
    out = tmp_path / "megatron"
    proc = subprocess.run([*command(out), *megatron], cwd=REPO, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = {"megatron": sft_rows(out), "fsdp": uninterrupted[2]}
    assert len(rows["megatron"]) == len(rows["fsdp"]) == 7
    for mine, theirs in zip(rows["megatron"], rows["fsdp"]):
        assert set(mine) <= set(theirs)  # FSDP2 adds its prefix-sharing share (sft/shared_token_frac)
        for key in ("sft/loss", "sft/grad_norm", "sft/eval_loss", "sft/num_tokens"):
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], rel=2e-4), (mine["episode"], key)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "result")
