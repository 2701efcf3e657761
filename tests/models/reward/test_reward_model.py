"""RewardModel (a sequence-classification reward model, FSDP2 on CPU/gloo): scores against plain transformers,
2 ranks against 1, offload/onload, its own chat template, the refusals, and the shipped ``assets/tiny_rm``.

Two jobs run once per module (1 rank and 2 ranks, spawned processes with a hard deadline, as the FSDP trainer's
tests run theirs); the tests compare what they return.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from test_fsdp_trainer import run_ranks

REPO = Path(__file__).resolve().parents[3]
POLICY = REPO / "assets" / "tiny_qwen2"
TINY_RM = REPO / "assets" / "tiny_rm"
KEY = "models.reward.load"
# A template unlike the policy's ChatML, so that the test sees which one renders.
RM_TEMPLATE = "{% for m in messages %}{{ '<|im_start|>[' + m['role'] + '] ' + m['content'] + '\n' }}{% endfor %}"
MAX_LENGTH = 64


def rm_text(conversation: list[dict]) -> str:
    """What RM_TEMPLATE renders, written out by hand."""
    return "".join(f"<|im_start|>[{m['role']}] {m['content']}\n" for m in conversation)


def conversations() -> list[list[dict]]:
    """7 conversations of different lengths (micro-batches of 3 are padded)."""
    out = []
    for i, (a, b, answer) in enumerate([(3, 4, "7"), (12, 30, "42"), (5, 5, "11"), (99, 1, "100"), (7, 0, "7"),
                                        (40, 2, "4"), (1, 1, "the answer is 2")]):
        prompt = f"What is {a} + {b}?" + (" Put the final answer in \\boxed{}." if i % 2 else "")
        out.append([{"role": "user", "content": prompt}, {"role": "assistant", "content": f"\\boxed{{{answer}}}"}])
    return out


def spec(path, **over):
    from chatlearn.models.specs import RewardModelSpec

    fields = dict(load=str(path), trust_remote_code=False, seed=0, micro_batch_size=3, max_length=MAX_LENGTH,
                  bf16=False, device="cpu")
    return RewardModelSpec(**{**fields, **over})


def make_rm(path: Path, num_labels: int = 1, template: str | None = RM_TEMPLATE) -> Path:
    """A tiny random Qwen2ForSequenceClassification with assets/tiny_qwen2's tokenizer; the score head
    scaled so that scores are O(1)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tok = AutoTokenizer.from_pretrained(POLICY)
    config = Qwen2Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         num_labels=num_labels, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config).float()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    tok.chat_template = template
    tok.save_pretrained(path)
    return path


def hf_scores(path: Path, texts: list[str]) -> np.ndarray:
    """Reference: one plain transformers forward per conversation (no padding), HF's own pooling."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return np.array([model(input_ids=torch.tensor([tok(t, add_special_tokens=False)["input_ids"]])).logits[0, 0]
                         for t in texts], dtype=np.float32)


def _error(fn) -> dict:
    try:
        fn()
    except Exception as err:  # noqa: BLE001  (reported to the test)
        return {"type": type(err).__name__, "key": getattr(err, "key", None), "message": str(err)}
    return {"type": None}


# --------------------------------------------------------------------------------------------- rank jobs


def job_one_rank(rank, world, path, bad_paths):
    from chatlearn.models.reward.model import RewardModel

    convs = conversations()
    rm = RewardModel(spec(path))
    out = {"scores": rm.score(convs), "ids": [rm.render(c) for c in convs]}
    out["offload"] = rm.offload(["weights", "optimizer", "kv_cache"])
    out["offload_again"] = rm.offload(["weights"])
    out["score_offloaded"] = _error(lambda: rm.score(convs))
    out["onload"] = rm.onload(["weights"])
    out["scores_after"] = rm.score(convs)
    out["one_by_one"] = np.concatenate([rm.score([c]) for c in convs])
    out["empty"] = rm.score([])
    long = [[{"role": "user", "content": "1 + " * 40}, {"role": "assistant", "content": "\\boxed{41}"}]]
    out["too_long"] = _error(lambda: rm.score(convs[:2] + long))
    rm.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    out["bad_template"] = _error(lambda: rm.score(convs))
    rm.tokenizer.chat_template = None
    out["no_template_ids"] = rm.render(convs[0])
    for name, bad in bad_paths.items():
        out[name] = _error(lambda bad=bad: RewardModel(spec(bad)))
    if TINY_RM.exists():
        out["asset"] = asset_scores(RewardModel(spec(TINY_RM, micro_batch_size=16, max_length=256)))
    return out


def job_two_ranks(rank, world, path):
    from chatlearn.models.reward.model import RewardModel

    rm = RewardModel(spec(path))
    convs = conversations()
    out = {"scores": rm.score(convs)}
    out["offload"] = rm.offload(["weights"])
    out["onload"] = rm.onload(["weights"])
    out["scores_after"] = rm.score(convs)
    out["sharded"] = any(type(p).__name__ == "DTensor" for p in rm.model.parameters())
    return out


ASSET_PROMPTS = 12


def asset_scores(rm) -> dict:
    """Scores of the correct answer and of wrong ones to the first eval prompts of the arith task."""
    rows = [json.loads(line) for line in (REPO / "assets" / "arith" / "eval.jsonl").read_text().splitlines()]
    rows = rows[:ASSET_PROMPTS]
    kinds = {"correct": lambda s: f"\\boxed{{{s}}}", "plus_one": lambda s: f"\\boxed{{{s + 1}}}",
             "minus_ten": lambda s: f"\\boxed{{{s - 10 if s >= 10 else s + 20}}}",
             "plus_ten": lambda s: f"\\boxed{{{s + 10}}}",
             "random": lambda s: f"\\boxed{{{(s * 37 + 11) % 199}}}", "no_box": lambda s: str(s)}
    return {kind: rm.score([[*r["prompt"], {"role": "assistant",
                                             "content": answer(int(r["reward_model"]["ground_truth"]))}]
                            for r in rows])
            for kind, answer in kinds.items()}


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    path = make_rm(root / "rm")
    bad = {"two_labels": str(make_rm(root / "two_labels", num_labels=2)), "causal_lm": str(POLICY)}
    nopad = root / "no_pad"
    shutil.copytree(path, nopad)
    conf = json.loads((nopad / "tokenizer_config.json").read_text())
    conf.update(pad_token=None, eos_token=None)
    (nopad / "tokenizer_config.json").write_text(json.dumps(conf))
    bad["no_pad"] = str(nopad)
    return {"path": str(path), "bad": bad}


@pytest.fixture(scope="module")
def one(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return run_ranks(job_one_rank, 1, out, folders["path"], folders["bad"], timeout=200)[0]


@pytest.fixture(scope="module")
def two(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    return run_ranks(job_two_ranks, 2, out, folders["path"], timeout=200)


# --------------------------------------------------------------------------------------------- tests


@pytest.mark.timeout(300)
def test_scores_match_a_plain_forward_of_each_conversation_with_the_rm_template(one, folders):
    from transformers import AutoTokenizer

    convs = conversations()
    texts = [rm_text(c) for c in convs]
    tok = AutoTokenizer.from_pretrained(folders["path"])
    assert one["ids"] == [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    policy = AutoTokenizer.from_pretrained(POLICY)  # the policy's ChatML renders differently
    assert one["ids"][0] != policy.apply_chat_template(convs[0], tokenize=True, return_dict=False)
    ref = hf_scores(Path(folders["path"]), texts)
    assert one["scores"].dtype == np.float32 and one["scores"].shape == (len(convs),)
    np.testing.assert_allclose(one["scores"], ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(one["one_by_one"], ref, rtol=0, atol=1e-5)
    assert np.ptp(ref) > 0.1  # the scores differ: a wrong pooling position would show
    assert one["empty"].shape == (0,)


@pytest.mark.timeout(300)
def test_without_a_chat_template_the_contents_are_joined_by_newlines(one, folders):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folders["path"])
    conv = conversations()[0]
    assert one["no_template_ids"] == tok("\n".join(m["content"] for m in conv))["input_ids"]


@pytest.mark.timeout(300)
def test_offload_onload_round_trip_keeps_the_scores(one):
    n = one["offload"]["bytes"]
    assert n > 0 and one["onload"] == {"bytes": n} and one["offload_again"] == {"bytes": 0}
    assert one["score_offloaded"]["type"] == "RuntimeError"
    np.testing.assert_array_equal(one["scores_after"], one["scores"])


@pytest.mark.timeout(300)
def test_two_ranks_give_the_scores_of_one(two, one):
    r0, r1 = two
    assert r0["sharded"] and r1["sharded"]
    np.testing.assert_array_equal(r0["scores"], r1["scores"])
    np.testing.assert_allclose(r0["scores"], one["scores"], rtol=0, atol=1e-5)
    assert 0 < r0["offload"]["bytes"] < one["offload"]["bytes"]  # this rank's shards
    assert r0["onload"] == r0["offload"]
    np.testing.assert_array_equal(r0["scores_after"], r0["scores"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, words", [("two_labels", "gives 2 labels"), ("causal_lm", "labels"),
                                         ("no_pad", "pad token")])
def test_models_that_cannot_score_are_refused(one, case, words):
    err = one[case]
    assert err["type"] == "UserError" and err["key"] == KEY and words in err["message"], err


@pytest.mark.timeout(300)
def test_over_long_conversation_and_template_error_name_the_key(one, folders):
    err = one["too_long"]
    assert err["type"] == "UserError" and err["key"] == KEY, err
    assert f"context of {MAX_LENGTH} tokens" in err["message"] and "index 2" in err["message"]
    err = one["bad_template"]
    assert err["type"] == "UserError" and err["key"] == KEY, err
    assert folders["path"] in err["message"] and "roles must alternate" in err["message"]
    assert "chat template" in err["message"]


@pytest.mark.timeout(300)
def test_shipped_tiny_rm_scores_correct_sums_above_wrong_ones(one):
    assert TINY_RM.exists(), "assets/tiny_rm is missing: python tools/build_reward_model_assets.py --out assets"
    got = one["asset"]
    correct = got["correct"]
    for kind, scores in got.items():
        if kind != "correct":
            assert (correct > scores).mean() >= 0.75, (kind, correct, scores)
            assert correct.mean() > scores.mean() + 1.0, (kind, correct, scores)
    assert (correct > 0).mean() >= 0.75 and (got["no_box"] < 0).all()
