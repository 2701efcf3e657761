"""Sizes that cannot run are refused at validation, naming the key and what it would need
(chatlearn/config/sizes.py): an episode, a replay buffer, a KV cache or a micro-batch whose buffer
alone needs more memory than the machine has. The machine's memory is fixed at 1 GiB here."""
from __future__ import annotations

import importlib.util

import pytest

from chatlearn.config import sizes
from chatlearn.config.load import load_run
from chatlearn.errors import ConfigError

TEMPLATE = "template/grpo_fsdp.yaml"
GIB = 2**30


@pytest.fixture(autouse=True)
def _one_gib_cpu_machine(monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(sizes, "available_memory", lambda: GIB)
    monkeypatch.setattr(sizes, "local_cpu_run", lambda plan: True)


def refused(paths_overrides, *overrides) -> str:
    with pytest.raises(ConfigError) as err:
        load_run(TEMPLATE, [*paths_overrides, "runtime_args.rollout_backend=hf", *overrides])
    return str(err.value)


def test_an_episode_larger_than_memory_names_sample_per_episode(paths_overrides):
    msg = refused(paths_overrides, "runtime_args.sample_per_episode=1048576",
                  "runtime_args.train_global_batch_size=1048576")
    assert msg.startswith("runtime_args.sample_per_episode: is 1048576")
    assert "1048576 samples of up to 80 tokens" in msg and "need about 2.5 GiB" in msg
    assert "this machine has 1.0 GiB of memory available" in msg
    assert "at most about 419430" in msg  # 1 GiB / (80 tokens x 32 bytes)


def test_a_replay_of_every_episode_names_max_replay_episode(paths_overrides):
    msg = refused(paths_overrides, "runtime_args.max_replay_episode=-1", "runtime_args.num_episode=1000000")
    assert msg.startswith("runtime_args.max_replay_episode: is -1")
    assert "the 1000000 episodes the driver holds at once" in msg and "at most about 1637" in msg


def test_a_generation_batch_whose_kv_cache_cannot_fit_is_refused(paths_overrides):
    msg = refused(paths_overrides, "runtime_args.sample_per_episode=16384",
                  "runtime_args.train_global_batch_size=16384", "models.policy.generation_batch_size=65536")
    assert msg.startswith("models.policy.generation_batch_size: is 65536")
    assert "(16384 sequences of 80 tokens at " in msg  # the batch: the episode's samples at most


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_a_vllm_kv_cache_fit_larger_than_memory_is_refused(paths_overrides):
    msg = refused(paths_overrides, "runtime_args.rollout_backend=vllm", "models.policy.generation_batch_size=65536")
    assert msg.startswith("models.policy.generation_batch_size: is 65536")
    assert "the KV cache of vLLM (models.policy.kv_cache fit: 65536 sequences of 80 tokens" in msg


def test_a_micro_batch_whose_activations_cannot_fit_is_refused(paths_overrides):
    big = ["runtime_args.sample_per_episode=16384", "runtime_args.train_global_batch_size=16384",
           "models.policy.generation_batch_size=64"]
    msg = refused(paths_overrides, *big, "runtime_args.train_micro_batch_size=16384")
    assert msg.startswith("runtime_args.train_micro_batch_size: is 16384")
    assert "a micro-batch of 16384 samples x 80 tokens" in msg and "layers x hidden size" in msg
    msg = refused(paths_overrides, *big, "models.policy_trainer.packing=true",
                  "models.policy_trainer.max_token_in_packing=1000000000000")
    assert msg.startswith("models.policy_trainer.max_token_in_packing: is 1000000000000")
    assert "a packed micro-batch of 1310720 tokens" in msg  # the rank's step share at most


def test_sizes_bounded_by_the_episode_and_the_template_run(paths_overrides):
    # a generation batch, chunk or packing limit beyond the episode allocates only what the episode holds
    load_run(TEMPLATE, [*paths_overrides, "runtime_args.rollout_backend=hf",
                        "models.policy.generation_batch_size=1000000000",
                        "models.policy_trainer.logprob_chunk_tokens=1000000000000",
                        "models.policy_trainer.max_token_in_packing=1000000000000"])
    load_run(TEMPLATE, paths_overrides)


def test_workers_elsewhere_are_not_checked_against_this_machine(paths_overrides, monkeypatch):
    monkeypatch.undo()  # the real local_cpu_run
    monkeypatch.chdir(__import__("conftest").REPO)
    monkeypatch.setattr(sizes, "available_memory", lambda: GIB)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    load_run(TEMPLATE, [*paths_overrides, "runtime_args.rollout_backend=hf", "runtime_args.single_process=false",
                        "runtime_args.sample_per_episode=16384", "runtime_args.train_global_batch_size=16384",
                        "runtime_args.train_micro_batch_size=16384"])
    # the driver's episodes are this machine's memory wherever the workers run
    with pytest.raises(ConfigError, match="runtime_args.sample_per_episode: is 1048576"):
        load_run(TEMPLATE, [*paths_overrides, "runtime_args.rollout_backend=hf", "runtime_args.single_process=false",
                            "runtime_args.sample_per_episode=1048576", "runtime_args.train_global_batch_size=1048576"])
