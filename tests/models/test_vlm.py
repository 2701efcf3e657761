"""Vision-language models (the toy ``assets/tiny_qwen2_vl``: Qwen2-VL, 16 vision tokens an image): images in
the data (every reference form, decoded once, shared by a group's samples), the transformers rollout with
images against the model's own forward, and the FSDP2 trainer against the rollout (padded and packed, 1 and 2
ranks), with the vision tower frozen by default and trained on request, the weight push's names, and a response
that samples the image placeholder token. The rollout and the one-rank trainer are checked on a tiny random
Qwen2.5-VL too (tests/support/tiny_qwen2_5_vl.py: its windowed vision attention).

The trainer parts run in rank processes (one job per world size, shared by the tests below).
"""
from __future__ import annotations

import base64
import io
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.trainer.test_fsdp_trainer import run_ranks, trainer_spec
from vlm_reference import batch_gap, sample_logprobs

ASSET = str(Path(__file__).resolve().parents[2] / "assets" / "tiny_qwen2_vl")
DIGITS = str(Path(__file__).resolve().parents[2] / "assets" / "vlm_digits")
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": 3}


def _png_bytes(colour=(10, 200, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), colour).save(buf, format="PNG")
    return buf.getvalue()


def _row(*images) -> dict:
    parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": "Add the digits."}]
    return {"data_source": "d", "prompt": [{"role": "user", "content": parts}], "reward_model": {"ground_truth": "3"}}


def test_every_image_reference_decodes_to_the_same_pixels(tmp_path):
    from PIL import Image

    from chatlearn.data.vision import decode_image

    data = _png_bytes()
    (tmp_path / "a.png").write_bytes(data)
    b64 = base64.b64encode(data).decode()
    refs = ["a.png", str(tmp_path / "a.png"), f"data:image/png;base64,{b64}", {"bytes": data, "path": None},
            Image.open(io.BytesIO(data))]
    pixels = [np.asarray(decode_image(r, str(tmp_path), "row")) for r in refs]
    assert all(p.shape == (64, 64, 3) and (p == pixels[0]).all() for p in pixels)


def test_prompts_with_images_load_expanded_and_shared(tmp_path):
    from chatlearn.data.dataset import VisionData, load_prompts, load_tokenizer
    from chatlearn.runtime.driver.sampling import Prompts, Sampling

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png_bytes())
    text = {"data_source": "d", "prompt": "What is 1 + 2?", "reward_model": {"ground_truth": "3"}}
    lines = [_row("img/a.png"), _row(base64.b64encode(_png_bytes((0, 0, 0))).decode() * 1), text]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    tok = load_tokenizer(ASSET, trust_remote_code=False, key="k")
    ps = load_prompts([str(tmp_path / "train.jsonl")], tok, max_prompt_tokens=64, enable_thinking=False,
                      prompt_key="prompt", ground_truth_key="reward_model.ground_truth",
                      vision=VisionData(ASSET, 1))
    image_id = json.loads(Path(ASSET, "config.json").read_text())["image_token_id"]
    assert [ids.count(image_id) for ids in ps.prompt_ids] == [16, 16, 0]
    assert ps.images[0] == [str(tmp_path / "img" / "a.png")] and ps.images[2] == []
    prompts = Prompts.of(ps, [0, 1, 2], k=3)
    sampling = Sampling.__new__(Sampling)
    sampling.cfg = type("C", (), {"models": type("M", (), {"policy": type("P", (), {"load": ASSET})})})
    sampling._processor = None
    vision = sampling.vision_inputs(prompts.images)
    assert vision[0] is vision[1] is vision[2] and vision[3] is vision[5] and vision[6] is None
    assert vision[0]["pixel_values"].shape == (64, 384) and vision[0]["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert not np.array_equal(vision[0]["pixel_values"], vision[3]["pixel_values"])


def _image_prompts(n: int = 3, asset: str = ASSET):
    """``n`` eval prompts of vlm_digits (ids, image dicts) and one text prompt of the same tokenizer."""
    from chatlearn.data.vision import VisionProcessor, decode_image, message_images

    proc = VisionProcessor(asset)
    with open(os.path.join(DIGITS, "eval.jsonl")) as f:
        recs = [json.loads(line) for line, _ in zip(f, range(n))]
    prompts, images = [], []
    for r in recs:
        ex = proc.render(r["prompt"], [decode_image(x, DIGITS, "t") for x in message_images(r["prompt"])])
        prompts.append(ex["input_ids"])
        images.append({"pixel_values": ex["pixel_values"].numpy(), "image_grid_thw": ex["image_grid_thw"].numpy()})
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": "Add 3 and 4."}], tokenize=True,
                                              add_generation_prompt=True, return_dict=False)
    return prompts + [list(text)], images + [None], proc.image_token_id


def _rollout_batch(asset: str):
    """The hf rollout's samples of 4 image prompts and a text prompt (left-padded together), with their images."""
    import backend_specs

    from chatlearn.models.rollout.hf import HFRollout

    prompts, images, image_id = _image_prompts(4, asset)
    ro = HFRollout(backend_specs.rollout_spec(asset, max_prompt_tokens_length=64, max_response_tokens_length=8))
    batch = ro.generate(prompts, SAMPLING, images)
    batch["images"] = images
    return batch, ro.model, image_id


@pytest.fixture(scope="module")
def rollout_batch():
    return _rollout_batch(ASSET)


@pytest.fixture(scope="module")
def qwen2_5_vl_rollout_batch(qwen2_5_vl_dir):
    return _rollout_batch(qwen2_5_vl_dir)


@pytest.mark.parametrize("which", ["rollout_batch", "qwen2_5_vl_rollout_batch"])
def test_hf_rollout_logprobs_match_the_models_own_forward_on_image_prompts(which, request):
    """The reference: transformers' forward of each sample alone, which computes the multimodal positions
    itself (``get_rope_index`` from the token types and the grid); Qwen2-VL (the toy) and Qwen2.5-VL."""
    batch, model, image_id = request.getfixturevalue(which)
    want = {"rollout_batch": "Qwen2VLForConditionalGeneration",
            "qwen2_5_vl_rollout_batch": "Qwen2_5_VLForConditionalGeneration"}[which]
    assert type(model).__name__ == want
    off, plen = batch["offsets"], batch["prompt_lens"]
    for i, item in enumerate(batch["images"]):
        ref = sample_logprobs(model, batch["tokens"][off[i]:off[i + 1]], plen[i], item, image_id)
        np.testing.assert_allclose(batch["rollout_logprobs"][off[i] + plen[i]:off[i + 1]], ref, atol=2e-5, rtol=0)


# --------------------------------------------------------------------------- the trainer, in rank processes


def _with_placeholder_response(batch: dict, image_id: int) -> dict:
    """The batch plus a copy of its first sample whose response's first token is the image placeholder: text
    there (no image features, text positions), as a sampled response token is."""
    off = batch["offsets"]
    toks = batch["tokens"][off[0]:off[1]].copy()
    toks[int(batch["prompt_lens"][0])] = image_id
    out = {"tokens": np.concatenate([batch["tokens"], toks]), "offsets": np.append(off, off[-1] + len(toks)),
           "prompt_lens": np.append(batch["prompt_lens"], batch["prompt_lens"][0]),
           "rollout_logprobs": np.concatenate([batch["rollout_logprobs"], np.zeros(len(toks), np.float32)]),
           "images": list(batch["images"]) + [batch["images"][0]]}
    n = len(out["prompt_lens"])
    out["advantages"] = np.linspace(-1, 1, n).astype(np.float32)
    out["old_logprobs"] = np.zeros(len(out["tokens"]), np.float32)
    return out


def job_vlm(rank, world, batch, asset=ASSET):
    """Log-probs padded and packed; one optimizer step with the vision tower frozen (the default) and one with
    it training; the weight push's names of each."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer
    from chatlearn.models.vision import is_vision_param

    res = {}
    for name, over in (("frozen", {}), ("packed", {"packing": True}), ("trained", {"freeze_vision_tower": False})):
        trainer = FSDPTrainer(trainer_spec(asset, kl_coef=0.0, entropy_coef=0.0, logprob_micro_batch_size=2, **over))
        res[name + "_logp"] = trainer.compute_logprobs(batch, temperature=1.0)
        before = {n: p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
                  for n, p in trainer.model.named_parameters()}
        res[name + "_metrics"] = trainer.train(dict(batch, old_logprobs=res[name + "_logp"]))
        after = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in trainer.model.named_parameters()}
        res[name + "_vision_moved"] = any(not torch.equal(before[n], after[n]) for n in before if is_vision_param(n))
        res[name + "_text_moved"] = any(not torch.equal(before[n], after[n]) for n in before if not is_vision_param(n))
        res[name + "_pushed"] = [s[0] for s in trainer.weight_specs()]
        del trainer
    return res


@pytest.fixture(scope="module")
def vlm_batch(rollout_batch):
    batch, _, image_id = rollout_batch
    return _with_placeholder_response(batch, image_id)


@pytest.fixture(scope="module")
def one(vlm_batch, tmp_path_factory):
    return run_ranks(job_vlm, 1, tmp_path_factory.mktemp("vlm1"), vlm_batch, timeout=400)[0]


@pytest.fixture(scope="module")
def two(vlm_batch, tmp_path_factory):
    t0 = time.monotonic()
    out = run_ranks(job_vlm, 2, tmp_path_factory.mktemp("vlm2"), vlm_batch, timeout=400)
    print(f"2-rank VLM job: {time.monotonic() - t0:.1f}s")
    return out


@pytest.fixture(scope="module")
def qwen2_5_vl_one(qwen2_5_vl_dir, qwen2_5_vl_rollout_batch, tmp_path_factory):
    batch, _, image_id = qwen2_5_vl_rollout_batch
    batch = _with_placeholder_response(batch, image_id)
    return batch, run_ranks(job_vlm, 1, tmp_path_factory.mktemp("q25"), batch, qwen2_5_vl_dir, timeout=400)[0]


def _responses(batch: dict, values: np.ndarray, samples) -> np.ndarray:
    off, plen = batch["offsets"], batch["prompt_lens"]
    return np.concatenate([values[off[i] + plen[i]:off[i + 1]] for i in samples])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_logprobs_match_the_rollouts_on_image_prompts(vlm_batch, one):
    """Padded and packed (each sample's multimodal positions, the text positions first), against the hf
    rollout's log-probs of the same samples (the rollout's 5; the 6th is not the rollout's)."""
    first = range(5)
    for name in ("frozen", "packed"):
        np.testing.assert_allclose(_responses(vlm_batch, one[name + "_logp"], first),
                                   _responses(vlm_batch, vlm_batch["rollout_logprobs"], first), atol=2e-5, rtol=0)
    np.testing.assert_allclose(one["packed_logp"], one["frozen_logp"], atol=2e-5, rtol=0)  # the placeholder too
    assert np.isfinite(one["frozen_logp"]).all()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_qwen2_5_vl_trainer_logprobs_match_the_rollouts_and_its_tower_stays_frozen(qwen2_5_vl_one):
    """Qwen2.5-VL (windowed vision attention) in the FSDP2 trainer, padded and packed, against the hf rollout's
    log-probs of the same samples; the frozen tower stays and is left out of the push, a trained one moves."""
    from chatlearn.models.vision import is_vision_param

    batch, res = qwen2_5_vl_one
    for name in ("frozen", "packed"):
        np.testing.assert_allclose(_responses(batch, res[name + "_logp"], range(5)),
                                   _responses(batch, batch["rollout_logprobs"], range(5)), atol=2e-5, rtol=0)
    assert res["frozen_text_moved"] and not res["frozen_vision_moved"]
    assert res["trained_text_moved"] and res["trained_vision_moved"]
    assert not any(is_vision_param(n) for n in res["frozen_pushed"])
    assert any(is_vision_param(n) for n in res["trained_pushed"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vision_tower_frozen_by_default_and_trained_on_request(one):
    assert one["frozen_text_moved"] and not one["frozen_vision_moved"]
    assert one["trained_text_moved"] and one["trained_vision_moved"]
    from chatlearn.models.vision import is_vision_param

    assert not any(is_vision_param(n) for n in one["frozen_pushed"])  # the push leaves a frozen tower
    assert any(is_vision_param(n) for n in one["trained_pushed"])
    assert set(one["trained_pushed"]) - set(one["frozen_pushed"]) == {n for n in one["trained_pushed"]
                                                                      if is_vision_param(n)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_match_one_rank_with_images(one, two):
    r0, r1 = two
    for name in ("frozen", "packed", "trained"):
        np.testing.assert_allclose(r0[name + "_logp"], one[name + "_logp"], atol=2e-5, rtol=0)
        for key in ("loss", "grad_norm"):
            assert r0[name + "_metrics"][key] == r1[name + "_metrics"][key]
            assert r0[name + "_metrics"][key] == pytest.approx(one[name + "_metrics"][key], rel=1e-4, abs=1e-6), key


def test_lora_on_a_vlm_takes_the_language_model_only():
    """LoRA on a vision-language model: ``all-linear`` adapters go on the language model's layers, none on the vision
    tower (peft alone would take the tower's too), and the config check (on a meta model) sees the same layers."""
    from types import SimpleNamespace

    import transformers

    from chatlearn.config.lora_keys import adapter_targets, check_lora_model, meta_model
    from chatlearn.models.trainer import lora

    model = transformers.AutoModelForImageTextToText.from_pretrained(ASSET)
    lora.wrap(model, SimpleNamespace(target_modules="all-linear", rank=4, alpha=8, dropout=0.0, modules_to_save=[]), 0)
    wrapped = {n.rsplit(".lora_A.", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert wrapped and not any(".visual." in n for n in wrapped)
    assert all(".language_model." in n for n in wrapped)
    planned = set(adapter_targets(meta_model(ASSET, False), "all-linear"))
    assert {n.removeprefix("base_model.model.") for n in wrapped} == planned
    check_lora_model(ASSET, False, 4, "all-linear", [])


def job_vlm_lora_push(rank, world, batch):
    """LoRA on the toy VLM (the language model's q/v projections): one optimizer step, then what an adapter push
    sends (the pushed tensors and the manifest) and the trainer's log-probs of ``batch`` after the step."""
    from chatlearn.models.specs import LoraSpec
    from chatlearn.models.trainer.fsdp import FSDPTrainer
    from chatlearn.runtime.weight_push.stream import adapter_manifest, push_view

    lora = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"), modules_to_save=(),
                    push="adapters")
    trainer = FSDPTrainer(trainer_spec(ASSET, lora=lora, lr=1e-2, kl_coef=0.0, entropy_coef=0.0,
                                       logprob_micro_batch_size=2))
    trainer.train(dict(batch, old_logprobs=trainer.compute_logprobs(batch, temperature=1.0)))
    view = push_view(trainer)
    tensors = dict(view.export_tensors([n for n, *_ in view.weight_specs()]))
    return {"manifest": adapter_manifest(view), "tensors": {n: t.clone() for n, t in tensors.items()},
            "logp": trainer.compute_logprobs(batch, temperature=1.0)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_adapters_pushed_into_the_rollout_of_a_vlm(vlm_batch, tmp_path):
    """``lora.push: adapters`` on a VLM: the pushed adapters (model.language_model.* names) merged onto the base
    folder's weights (named model.layers.*: the manifest's renames, transformers' own mapping) give the rollout
    the trainer's weights: its forward equals the trainer's log-probs on the image prompts."""
    import backend_specs

    from chatlearn.models.rollout.hf import HFRollout
    from chatlearn.models.rollout.lora_push import AdapterMerge
    from chatlearn.models.vision import is_vision_param

    out = run_ranks(job_vlm_lora_push, 1, tmp_path, vlm_batch, timeout=400)[0]
    manifest = out["manifest"]
    assert manifest["renames"]["model.layers.0.self_attn.q_proj.weight"] == \
        "model.language_model.layers.0.self_attn.q_proj.weight"
    assert all(w.startswith("model.language_model.layers.") for w, *_ in manifest["layers"])
    ro = HFRollout(backend_specs.rollout_spec(ASSET, max_prompt_tokens_length=64, max_response_tokens_length=8))
    before = {n: p.detach().clone() for n, p in ro.model.named_parameters()}
    image_id = ro.model.config.image_token_id

    def gap() -> float:
        """The largest |trainer - rollout forward| log-prob over the responses of the rollout's 5 samples."""
        return batch_gap(ro.model, vlm_batch, out["logp"], vlm_batch["images"], image_id, range(5))

    assert gap() > 1e-3  # the step moved the trainer away from the base the rollout starts from
    merge = AdapterMerge(manifest)
    merge.begin(ro)
    merge.take(ro, list(out["tensors"].items()))
    merge.finish(ro)
    after = dict(ro.model.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and all(n.endswith(("q_proj.weight", "v_proj.weight")) and not is_vision_param(n) for n in moved)
    assert gap() < 2e-5
