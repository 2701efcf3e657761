"""Metric sinks: metrics.jsonl, TensorBoard and W&B (offline), and secrets redacted from the logged config."""
from __future__ import annotations

import glob
import json
import os
import time

import pytest
from omegaconf import OmegaConf

from chatlearn.config.secrets import is_secret, redact
from chatlearn.logging.sinks import MetricSinks, wandb_credentials_configured

SECRET = "hf_S3CR3T_VALUE"


def make_cfg(out, *, tensorboard=False, wandb=False, **log_args):
    """The parts of a resolved config the sinks read, plus secrets to redact."""
    return OmegaConf.create({
        "runtime_args": {
            "output_dir": str(out), "exp_name": "sinks-test", "max_prompt_tokens_length": 64,
            "log_args_dict": {"log_dir": str(out), "enable_tensorboard": tensorboard, "tensorboard_dir": None,
                              "enable_wandb": wandb, "wandb_dir": None, "wandb_project": "chatlearn-tests",
                              "wandb_id": None, "wandb_name": "sinks", "wandb_resume": "allow", **log_args},
        },
        "models": {"policy": {"hf_token": SECRET, "tokenizer_model": "tok", "extra": {"apiKey": SECRET}}},
        "runtime_env": {"env": [{"WANDB_API_KEY": SECRET, "password": SECRET}]},
    })


def rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """No W&B credentials anywhere and no W&B settings from the environment."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    empty = tmp_path / "netrc"
    empty.write_text("")
    monkeypatch.setenv("NETRC", str(empty))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.mark.parametrize("name, secret", [
    ("api_key", True), ("wandb_api_key", True), ("hf_token", True), ("HF_TOKEN", True), ("accessToken", True),
    ("apiKey", True), ("key", True), ("client_secret", True), ("secrets", True), ("password", True),
    ("db_passwd", True), ("aws_credentials", True),
    ("max_prompt_tokens_length", False), ("max_token_in_packing", False), ("tokenizer_model", False),
    ("max_num_batched_tokens", False), ("pad_token_id", False), ("tokenizer_type", False),
    ("keep_last_checkpoints", False), ("monkey", False), ("lr", False),
])
def test_secret_names(name, secret):
    assert is_secret(name) is secret


def test_redact_nested():
    cfg = {"a": {"api_key": "x", "hf_token": None, "n": 3}, "lst": [{"password": "p"}, "plain"], "token": 5}
    assert redact(cfg) == {"a": {"api_key": "***", "hf_token": None, "n": 3}, "lst": [{"password": "***"}, "plain"],
                           "token": "***"}
    assert cfg["a"]["api_key"] == "x"  # the input is not modified


def test_jsonl_only_by_default(tmp_path, wandb_env):
    sinks = MetricSinks(make_cfg(tmp_path))
    before = time.time()
    sinks.write(1, {"train/loss": 0.5, "time/train": float("nan")})
    after = time.time()
    sinks.close()
    sinks.close()  # closing twice is harmless
    (row,) = rows(tmp_path / "metrics.jsonl")
    assert before - 0.01 <= row.pop("time/wall") <= after + 0.01  # the wall-clock time the row was written
    assert row == {"episode": 1, "time/train": None, "train/loss": 0.5}
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "wandb").exists()


def test_tensorboard_scalars_and_redacted_config(tmp_path, wandb_env):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    sinks = MetricSinks(make_cfg(tmp_path, tensorboard=True))
    for episode in range(3):
        sinks.write(episode, {"train/reward_mean": 0.1 * episode, "eval/arith/reward_mean": 0.5})
    sinks.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"train/reward_mean", "eval/arith/reward_mean"} <= set(acc.Tags()["scalars"])
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("train/reward_mean")] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    text = tensor_util.make_ndarray(acc.Tensors("config/text_summary")[0].tensor_proto)[0].decode()
    assert "max_prompt_tokens_length: 64" in text and "tokenizer_model: tok" in text
    assert "hf_token: '***'" in text and SECRET not in text


def test_wandb_offline_with_wandb_mode(tmp_path, wandb_env, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    sinks = MetricSinks(make_cfg(tmp_path, wandb=True, wandb_id="run-a"))
    sinks.write(0, {"eval/reward_mean": 0.25})
    sinks.write(1, {"train/reward_mean": 0.5, "train/loss": 0.1})
    sinks.close()
    assert "no API key" not in capsys.readouterr().out  # WANDB_MODE decides; nothing to fall back from
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*-run-a"))
    assert len(runs) == 1, os.listdir(tmp_path / "wandb")
    # W&B's service process (wandb-core) may still be writing the run file after finish()
    # returns (wandb 0.31): wait for the history to land (bounded).
    path = glob.glob(os.path.join(runs[0], "run-*.wandb"))[0]
    deadline = time.monotonic() + 60
    while True:
        with open(path, "rb") as f:
            data = f.read()
        if (b"train/reward_mean" in data and b"eval/reward_mean" in data) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert b"train/reward_mean" in data and b"eval/reward_mean" in data  # the history
    assert b"max_prompt_tokens_length" in data and b"***" in data  # the config, redacted
    assert SECRET.encode() not in data


def test_wandb_without_api_key_falls_back_to_offline(tmp_path, wandb_env, capsys):
    assert not wandb_credentials_configured()
    sinks = MetricSinks(make_cfg(tmp_path, wandb=True, wandb_dir=str(tmp_path / "wb")))
    sinks.write(1, {"train/reward_mean": 0.5})
    sinks.close()
    out = capsys.readouterr().out
    assert "[chatlearn] wandb: no API key configured" in out and "wandb sync" in out
    assert glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))


def test_credentials_from_netrc(tmp_path, wandb_env, monkeypatch):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    netrc.chmod(0o600)
    assert wandb_credentials_configured()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert not wandb_credentials_configured()
    monkeypatch.setenv("WANDB_API_KEY", "b" * 40)
    assert wandb_credentials_configured()


def test_failing_sink_is_dropped_and_jsonl_continues(tmp_path, wandb_env, capsys):
    sinks = MetricSinks(make_cfg(tmp_path, tensorboard=True))

    class Broken:
        name = "Broken"

        def write(self, episode, metrics):
            raise RuntimeError("disk full")

        def close(self):
            pass

    sinks._sinks.append(Broken())
    sinks.write(1, {"train/loss": 1.0})
    sinks.write(2, {"train/loss": 2.0})
    sinks.close()
    out = capsys.readouterr().out
    assert out.count("Broken logging stopped after an error: disk full") == 1
    assert [r["episode"] for r in rows(tmp_path / "metrics.jsonl")] == [1, 2]


SAMPLES = [{"sample": 0, "prompt": "What is 1 + 2?", "response": "It is | 3\nso \\boxed{3}", "reward": 1.0,
            "ground_truth": "3", "data_source": "arith", "response_tokens": 9, "finished": True},
           {"sample": 4, "prompt": "What is 2 + 2?", "response": "5", "reward": 0.0, "ground_truth": "4",
            "data_source": "arith", "response_tokens": 1, "finished": False}]


def test_samples_jsonl_rows_truncation_on_resume_and_a_torn_row(tmp_path, wandb_env):
    sinks = MetricSinks(make_cfg(tmp_path))
    sinks.write(1, {"train/loss": 0.5})
    assert not (tmp_path / "samples.jsonl").exists()  # no file until samples are logged
    sinks.write_samples(2, SAMPLES)
    sinks.write_samples(4, SAMPLES[:1])
    got = rows(tmp_path / "samples.jsonl")
    assert [(r["episode"], r["sample"]) for r in got] == [(2, 0), (2, 4), (4, 0)]
    assert {k: v for k, v in got[0].items() if k not in ("episode", "time/wall")} == SAMPLES[0]
    sinks.truncate_after(3)  # resumed from the checkpoint of episode 3
    sinks.write_samples(4, SAMPLES[1:])
    sinks.close()
    assert [(r["episode"], r["sample"]) for r in rows(tmp_path / "samples.jsonl")] == [(2, 0), (2, 4), (4, 4)]
    with open(tmp_path / "samples.jsonl", "a", encoding="utf-8") as f:
        f.write('{"episode": 6, "prom')  # a crash in the middle of a row
    sinks = MetricSinks(make_cfg(tmp_path))
    sinks.write_samples(6, SAMPLES[:1])
    sinks.close()
    assert [(r["episode"], r["sample"]) for r in rows(tmp_path / "samples.jsonl")][-2:] == [(4, 4), (6, 0)]


def test_samples_reach_tensorboard_as_a_markdown_table(tmp_path, wandb_env):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    sinks = MetricSinks(make_cfg(tmp_path, tensorboard=True))
    sinks.write_samples(10, SAMPLES)
    sinks.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    (event,) = acc.Tensors("samples/text_summary")
    assert event.step == 10
    text = tensor_util.make_ndarray(event.tensor_proto)[0].decode()
    lines = text.splitlines()
    assert lines[0] == "| prompt | response | reward | ground_truth | data_source | response_tokens | finished |"
    assert lines[2] == "| What is 1 + 2? | It is \\| 3<br>so \\\\boxed{3} | 1 | 3 | arith | 9 | True |"
    assert len(lines) == 4


def test_samples_reach_wandb_as_a_table(tmp_path, wandb_env, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    sinks = MetricSinks(make_cfg(tmp_path, wandb=True, wandb_id="run-s"))
    sinks.write_samples(10, SAMPLES)
    sinks.close()
    (run,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*-run-s"))
    deadline = time.monotonic() + 60
    while not glob.glob(os.path.join(run, "files", "media", "table", "samples_*.table.json")):
        assert time.monotonic() < deadline, os.listdir(run)
        time.sleep(0.2)
    (table,) = glob.glob(os.path.join(run, "files", "media", "table", "samples_*.table.json"))
    with open(table, encoding="utf-8") as f:
        data = json.load(f)
    assert data["columns"] == ["episode", "prompt", "response", "reward", "ground_truth", "data_source",
                               "response_tokens", "finished"]
    assert data["data"][1] == [10, "What is 2 + 2?", "5", 0.0, "4", "arith", 1, False]
