"""Sample logging (``runtime_args.log_args_dict.log_samples_interval`` / ``log_samples_num``): which
samples an episode logs and how they are decoded, that choosing them draws no random number, the
rows of ``samples.jsonl`` across a crash and a resume, W&B (a fake module) and TensorBoard (real,
read back) and the run summary; the rows of a real run are checked in tests/e2e/test_train_e2e.py."""
from __future__ import annotations

import json
import random
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf

from chatlearn.logging.sinks import MetricSinks


def read_rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sinks_cfg(out, *, tensorboard=False, wandb=False):
    return OmegaConf.create({"runtime_args": {
        "output_dir": str(out), "exp_name": "samples-test",
        "log_args_dict": {"log_dir": str(out), "enable_tensorboard": tensorboard, "tensorboard_dir": None,
                          "enable_wandb": wandb, "wandb_dir": None, "wandb_project": "p", "wandb_id": None,
                          "wandb_name": None, "wandb_resume": "allow"}}})


def row(prompt: str, reward: float = 1.0, **extra) -> dict:
    return {"sample": 0, "prompt": prompt, "response": "r", "reward": reward, "ground_truth": "1",
            "data_source": "arith", "response_tokens": 1, "finished": True, **extra}


# ---------------------------------------------------------------- choosing and decoding the samples
@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def make_batch(tokenizer, prompts: list[str], responses: list[str], finished: list[int]) -> dict:
    seqs, plens = [], []
    for p, r in zip(prompts, responses):
        pi = tokenizer(p, add_special_tokens=False)["input_ids"]
        ri = tokenizer(r, add_special_tokens=False)["input_ids"]
        seqs.append(pi + ri)
        plens.append(len(pi))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in seqs], out=offsets[1:])
    return {"tokens": np.asarray([t for s in seqs for t in s], dtype=np.int64), "offsets": offsets,
            "prompt_lens": np.asarray(plens, dtype=np.int64),
            "finish_reasons": np.asarray(finished, dtype=np.int8),
            "rollout_logprobs": np.zeros(int(offsets[-1]), dtype=np.float32)}


def rng_states():
    import torch

    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone()


def test_rows_spread_over_the_groups_decoded_and_no_random_number_drawn(tokenizer):
    import torch

    from chatlearn.runtime.driver.observe import EpisodeReport
    from chatlearn.runtime.driver.sampling import Sampling

    n, groups = 3, 4  # 4 prompts, 3 responses each
    prompts = [f"What is {g} + {g}?" for g in range(groups) for _ in range(n)]
    responses = [f"answer {g}.{j}" for g in range(groups) for j in range(n)]
    batch = make_batch(tokenizer, prompts, responses, [1, 0, 1] * groups)
    rewards = np.arange(n * groups, dtype=np.float32) / 10
    truths = [str(2 * g) for g in range(groups) for _ in range(n)]
    truths[3] = {"answer": 2}  # a structured ground truth becomes its text
    sources = ["arith"] * (n * groups)
    # only what sample_rows reads: the group size and the tokenizer
    run = EpisodeReport(None, SimpleNamespace(group_size=n), Sampling(None, tokenizer, None, None, None), None, None)
    before = {k: v.copy() for k, v in batch.items()}
    states = rng_states()

    got = run.sample_rows(batch, rewards, truths, sources, 6)

    # one response of each prompt first, then the second responses
    assert [r["sample"] for r in got] == [0, 3, 6, 9, 1, 4]
    for r in got:
        i = r["sample"]
        assert r["prompt"] == prompts[i] and r["response"] == responses[i], r
        assert r["reward"] == pytest.approx(float(rewards[i])) and isinstance(r["reward"], float)
        assert r["data_source"] == "arith" and r["finished"] is (i % n != 1)
        assert r["response_tokens"] == len(tokenizer(responses[i], add_special_tokens=False)["input_ids"])
    assert got[1]["ground_truth"] == "{'answer': 2}" and got[0]["ground_truth"] == "0"
    json.dumps(got)  # every value is JSON
    # more rows asked for than the episode has: every sample once
    assert sorted(r["sample"] for r in run.sample_rows(batch, rewards, truths, sources, 100)) == list(range(12))
    # the batch is untouched and no random number generator moved: training goes on as without logging
    assert all(np.array_equal(before[k], batch[k]) for k in batch)
    after = rng_states()
    assert after[0] == states[0] and np.array_equal(after[1], states[1]) and torch.equal(after[2], states[2])


# ---------------------------------------------------------------- samples.jsonl
def test_no_file_until_rows_are_logged_then_crash_safe_rows(tmp_path):
    sinks = MetricSinks(sinks_cfg(tmp_path))
    sinks.write(1, {"train/loss": 0.1})
    sinks.truncate_after(1)  # a resume before any sample was logged: still no file
    sinks.close()
    assert not (tmp_path / "samples.jsonl").exists()

    sinks = MetricSinks(sinks_cfg(tmp_path))
    sinks.write_samples(10, [row("a"), row("b \u00e9\n| x")])
    sinks.close()
    got = read_rows(tmp_path / "samples.jsonl")
    assert [r["prompt"] for r in got] == ["a", "b \u00e9\n| x"] and {r["episode"] for r in got} == {10}
    assert all(isinstance(r["time/wall"], float) for r in got)
    with open(tmp_path / "samples.jsonl", encoding="utf-8") as f:
        assert len(f.read().splitlines()) == 2  # a newline inside a prompt stays escaped in its row


def test_resume_drops_rows_past_the_checkpoint_and_a_torn_row(tmp_path, capsys):
    from chatlearn.logging.jsonl import truncate_after

    sinks = MetricSinks(sinks_cfg(tmp_path))
    for episode in (10, 20, 30):
        sinks.write_samples(episode, [row(f"p{episode}a"), row(f"p{episode}b")])
    sinks.close()
    with open(tmp_path / "samples.jsonl", "a", encoding="utf-8") as f:
        f.write('{"episode": 40, "prompt": "cut sh')  # a crash in the middle of a row

    # the run resumes from the checkpoint of episode 25: the rows of 30 and the torn one go
    sinks = MetricSinks(sinks_cfg(tmp_path))
    sinks.truncate_after(25)
    assert [r["episode"] for r in read_rows(tmp_path / "samples.jsonl")] == [10, 10, 20, 20]
    sinks.write_samples(30, [row("again")])
    sinks.close()
    assert [(r["episode"], r["prompt"]) for r in read_rows(tmp_path / "samples.jsonl")] == [
        (10, "p10a"), (10, "p10b"), (20, "p20a"), (20, "p20b"), (30, "again")]
    assert "not complete JSON rows" in capsys.readouterr().err

    # a torn row without a resume (appending after a crash): the next row starts on its own line
    with open(tmp_path / "samples.jsonl", "a", encoding="utf-8") as f:
        f.write('{"episode": 40, "pro')
    sinks = MetricSinks(sinks_cfg(tmp_path))
    sinks.write_samples(40, [row("next")])
    sinks.close()
    assert [r["prompt"] for r in read_rows(tmp_path / "samples.jsonl")][-2:] == ["again", "next"]
    assert truncate_after(str(tmp_path / "samples.jsonl"), 40) == 0  # nothing damaged left


def test_reconcile_logs_truncates_samples_like_metrics(tmp_path):
    from chatlearn.checkpoint.manager import CheckpointManager
    from chatlearn.runtime.rundir.output_dir import reconcile_logs

    out = tmp_path / "out"
    sinks = MetricSinks(sinks_cfg(out))
    for episode in (1, 2, 3):
        sinks.write(episode, {"train/loss": 0.1})
        sinks.write_samples(episode, [row(f"p{episode}")])
    sinks.close()
    CheckpointManager(str(out / "checkpoints"), 3).save(2, lambda tmp: None, {"sampler": {}})
    cfg = OmegaConf.create({"runtime_args": {"output_dir": str(out), "keep_last_checkpoints": 3}})
    reconcile_logs(cfg)
    assert [r["episode"] for r in read_rows(out / "samples.jsonl")] == [1, 2]
    assert [r["episode"] for r in read_rows(out / "metrics.jsonl")] == [1, 2]


# ---------------------------------------------------------------- W&B (a fake module) and TensorBoard
class FakeRun:
    def __init__(self):
        self.logged, self.metrics, self.finished = [], [], False

    def define_metric(self, name, **kw):
        self.metrics.append((name, kw))

    def log(self, data):
        self.logged.append(data)

    def finish(self):
        self.finished = True


class FakeTable:
    def __init__(self, columns, data):
        self.columns, self.data = columns, data


@pytest.fixture
def fake_wandb(monkeypatch):
    run = FakeRun()
    module = types.ModuleType("wandb")
    module.init = lambda **kw: run
    module.Settings = lambda **kw: kw
    module.Table = FakeTable
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.setenv("WANDB_MODE", "offline")
    return run


def test_wandb_gets_a_table_at_the_episode(tmp_path, fake_wandb):
    sinks = MetricSinks(sinks_cfg(tmp_path, wandb=True))
    sinks.write(10, {"train/reward_mean": 0.5})
    sinks.write_samples(10, [row("What is 1 + 1?", 1.0, ground_truth="2"), row("What is 2 + 2?", 0.0)])
    sinks.close()
    assert ("*", {"step_metric": "episode"}) in fake_wandb.metrics and fake_wandb.finished
    logged = fake_wandb.logged[-1]
    assert logged["episode"] == 10 and set(logged) == {"samples", "episode"}
    table = logged["samples"]
    assert table.columns[:4] == ["episode", "prompt", "response", "reward"]
    assert table.data[0][:5] == [10, "What is 1 + 1?", "r", 1.0, "2"] and table.data[1][3] == 0.0
    assert all(len(r) == len(table.columns) for r in table.data)


def test_a_failing_wandb_table_leaves_samples_jsonl_and_training_going(tmp_path, fake_wandb, capsys):
    def broken(columns, data):
        raise RuntimeError("table too large")

    sys.modules["wandb"].Table = broken
    sinks = MetricSinks(sinks_cfg(tmp_path, wandb=True))
    sinks.write_samples(10, [row("a")])
    sinks.write_samples(20, [row("b")])
    sinks.close()
    assert [r["prompt"] for r in read_rows(tmp_path / "samples.jsonl")] == ["a", "b"]
    assert capsys.readouterr().out.count("W&B logging stopped after an error: table too large") == 1


def test_tensorboard_gets_a_markdown_table_at_the_episode(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    sinks = MetricSinks(sinks_cfg(tmp_path, tensorboard=True))
    sinks.write_samples(10, [row("What is 1 + 1?")])
    sinks.write_samples(20, [row("p | q\nr", 0.25), row("s")])
    sinks.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Tensors("samples/text_summary")
    assert [e.step for e in events] == [10, 20]
    tables = [tensor_util.make_ndarray(e.tensor_proto)[0].decode().splitlines() for e in events]
    assert tables[0][0].startswith("| prompt | response | reward |") and len(tables[0]) == 3
    assert tables[1][2].startswith("| p \\| q<br>r | r | 0.25 |") and len(tables[1]) == 4


# ---------------------------------------------------------------- the run summary
def test_run_summary_lists_samples_only_when_the_file_exists(tmp_path, capsys):
    from chatlearn.runtime.driver.run import print_run_summary

    MetricSinks(sinks_cfg(tmp_path)).close()
    print_run_summary(str(tmp_path), 1.0, 0.0)
    assert "samples.jsonl" not in capsys.readouterr().out.splitlines()[-1]
    sinks = MetricSinks(sinks_cfg(tmp_path))
    sinks.write_samples(10, [row("a")])
    sinks.close()
    print_run_summary(str(tmp_path), 1.0, 0.0)
    assert f"samples {tmp_path / 'samples.jsonl'}" in capsys.readouterr().out.splitlines()[-1]
