"""The wrong model in the wrong place is refused in one paragraph before anything loads: ``chatlearn eval``
of a critic's checkpoint or of a value or reward model's folder (no language-model head to generate
with), ``chatlearn eval`` of a config whose reward comes from reward models alone (eval runs the reward
functions only: every sample would score 0), and a reward model whose tokenizer has more tokens than its
embedding. (A damaged critic shard: tests/models/trainer/test_fsdp_critic.py.)"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from chatlearn.cli import main
from chatlearn.config.load import load_run
from chatlearn.errors import ConfigError
from conftest import REPO

EVAL = ["runtime_args.rollout_backend=hf", "models.policy.eval_num_inference_per_prompt=1",
        "models.policy.max_response_tokens_length=8"]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("CHATLEARN_DEBUG", raising=False)


def paragraph(err: str) -> str:
    message = err[err.index("error: "):].strip()
    assert "\n\n" not in message and "Traceback" not in err, err
    return " ".join(message.split())


def evaluate(paths_overrides, *extra) -> int:
    return main(["eval", "template/grpo_fsdp.yaml", *paths_overrides, *EVAL, *extra])


def test_eval_of_a_critic_checkpoint_is_refused(paths_overrides, tmp_path, capsys):
    from chatlearn.checkpoint.sharded import FORMAT, META_FILE, VERSION

    critic = tmp_path / "episode_000001" / "critic"  # as a PPO run's checkpoint holds it, beside trainer/
    critic.mkdir(parents=True)
    (critic / META_FILE).write_text(json.dumps({"format": FORMAT, "version": VERSION, "role": "critic"}))
    (critic / ".metadata").write_bytes(b"")
    assert evaluate(paths_overrides, "--checkpoint", str(critic)) == 2
    err = paragraph(capsys.readouterr().err)
    for words in ("is the critic's checkpoint", str(critic), "value model", "checkpoints/episode_N"):
        assert words in err, (words, err)
    assert not os.path.exists(tmp_path / "out" / "eval" / "merged_model")


@pytest.mark.parametrize("head", ["Qwen2ForTokenClassification", "Qwen2ForSequenceClassification"])
def test_eval_of_a_value_or_reward_model_folder_is_refused(paths_overrides, reward_model_dir, tmp_path, capsys, head):
    folder = tmp_path / "value_model"
    shutil.copytree(reward_model_dir, folder)
    conf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**conf, "architectures": [head]}))
    assert evaluate(paths_overrides, "--checkpoint", str(folder)) == 2
    err = paragraph(capsys.readouterr().err)
    for words in (head, str(folder), "cannot generate with it"):
        assert words in err, (words, err)
    assert not os.path.exists(tmp_path / "out" / "eval" / "metrics.json")


def test_eval_of_the_reward_model_template_is_refused(arith_data, tmp_path, capsys, monkeypatch):
    """template/ppo_reward_model.yaml: the math rule at weight 0, the reward model's score the reward."""
    out = tmp_path / "out"
    code = main(["eval", "template/ppo_reward_model.yaml", *EVAL, f"runtime_args.eval_data_path={arith_data[1]}",
                 f"runtime_args.output_dir={out}"])
    assert code == 2
    err = paragraph(capsys.readouterr().err)
    for words in ("does not run reward models", "assets/tiny_rm", "models.reward.functions: math", "weight 0",
                  "score 0"):
        assert words in err, (words, err)
    assert not os.path.exists(out / "eval" / "metrics.json")
    # a reward function with a weight scores: no refusal (stopped where the rollout engine would start)
    import chatlearn.runtime.driver.evaluate as evaluate_module

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate_module, "Cluster", stop)
    assert main(["eval", "template/ppo_reward_model.yaml", *EVAL, f"runtime_args.eval_data_path={arith_data[1]}",
                 f"runtime_args.output_dir={out}",
                 "models.reward.functions=[{name: math, path: 'builtin:math', weight: 1.0}]"]) == 130


def test_a_reward_model_whose_tokenizer_outgrows_its_embedding_is_refused(paths_overrides, reward_model_dir,
                                                                          tmp_path):
    small = tmp_path / "small_vocab_rm"
    shutil.copytree(reward_model_dir, small)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(small))  # 316 tokens, the embedding 320 rows
    tok.add_tokens([f"<extra_{i}>" for i in range(10)])  # as a tokenizer of another model would have
    tok.save_pretrained(str(small))
    with pytest.raises(ConfigError) as err:
        load_run("template/grpo_fsdp.yaml", paths_overrides + [f"models.reward.load={small}", "models.reward.num_gpu=1"])
    assert err.value.key == "models.reward.load"
    for words in ("326 tokens", "ids up to 325", "320 rows of its embedding", "resize_token_embeddings"):
        assert words in str(err.value), (words, str(err.value))
