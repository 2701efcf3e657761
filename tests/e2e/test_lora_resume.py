"""Exact resume of a LoRA run (models.policy_trainer.lora): the suite's shared ``lora`` run
(tests/support/shared_runs.py) copied as a SIGKILL in the middle of its second checkpoint's save leaves
it (``shared_runs.rewound_copy``), the same command again: the same learning metrics and the same adapters as
the uninterrupted run (the full-weight counterpart, with a real SIGKILL: tests/e2e/test_resume.py).

What a LoRA run must restore beyond a full-weight one: the adapters alone on top of the base model read
from ``load`` again, the optimizer state of the adapters only, the reference log-probs given by the trainer
with its adapters disabled (a KL term, no ref_policy), and the merged weights pushed into the rollout
after the resume (episode 2's rollout then samples with episode 1's adapters), the Adam moments and
step count of episode 1's step (episode 2's step starts from them)."""
from __future__ import annotations

import os

import pytest
import runs
from shared_runs import finished, rewound_copy


def checkpoint_tensors(ckpt) -> dict:
    """Every tensor of a checkpoint's ``trainer/`` (the adapters and their optimizer state), flattened."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(ckpt / "trainer"), os.path.join(tmp, "state.pt"))
        state = torch.load(os.path.join(tmp, "state.pt"), weights_only=False)
    flat = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}/{k}", v)
        elif torch.is_tensor(node):
            flat[prefix] = node
    walk("", state)
    return flat


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_sigkill_during_a_save_resumes_exactly(tmp_path):
    whole = finished("lora").check()
    ref = whole.out
    expected = runs.learning_metrics(ref)
    assert [r["episode"] for r in expected] == [1, 2]
    assert expected[1]["train/kl"] > 0  # episode 2 samples and trains with episode 1's adapters

    # as killed while checkpoint 2 was being written (episode 2 trained and logged): checkpoint 1 stays, the
    # rerun resumes from it and trains episode 2 again
    out = rewound_copy(ref, tmp_path / "killed_in_save", 1)
    stdout = whole.rerun(out)
    assert "(episode 1)" in stdout  # resumed from checkpoint 1
    assert runs.learning_metrics(out) == expected
    assert not (out / "checkpoints" / "episode_000002.tmp").exists()

    # the final adapters (and their optimizer state) are the uninterrupted run's, bit for bit
    final = "checkpoints/episode_000002"
    want, got = checkpoint_tensors(ref / final), checkpoint_tensors(out / final)
    adapters = [k for k in want if k.startswith("/model/")]
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters), sorted(want)[:5]
    assert any(k.startswith("/optimizer/") for k in want)
    assert sorted(got) == sorted(want)
    assert [k for k in want if not bool((want[k] == got[k]).all())] == []
