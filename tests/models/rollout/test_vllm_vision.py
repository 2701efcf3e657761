"""The vLLM rollout with images (chatlearn/models/rollout/vllm_vision.py), for the toy Qwen2-VL
``assets/tiny_qwen2_vl`` and a tiny random Qwen2.5-VL (tests/support/tiny_qwen2_5_vl.py).

Fast: the placeholder collapse against the data layer's expansion; the images recovered from the pixel values
give the same pixel values again through transformers' own Qwen2-VL image processor (the one vLLM's processor
runs); the request dict's keys, the engine keywords and the weight-name mapping read from the installed vLLM's
source (``TokensPrompt``, ``EngineArgs``, ``Qwen2VLForConditionalGeneration.hf_to_vllm_mapper``); the
refusal where vLLM cannot import its Qwen2-VL module.

Slow: the real vLLM 0.32 engine through ``VLLMRollout`` on image prompts (one and two images, square and not)
and a text prompt, in a process of its own with tests/support/vllm_no_torchvision on PYTHONPATH (vLLM's
Qwen2-VL module needs torchvision, which this machine lacks: the hook stands in for the two transformers
pieces that import it): log-probs against transformers' forward, then a language-model push (vision tower
frozen) and a full push under the trainer's parameter names, each seen to move the engine onto the new weights.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from chatlearn.data.vision import VisionProcessor, expand_image_tokens
from chatlearn.models.rollout import vllm_vision

ROOT = Path(__file__).resolve().parents[3]
ASSET = str(ROOT / "assets" / "tiny_qwen2_vl")
VLLM = importlib.util.find_spec("vllm")
VLLM_DIR = Path(VLLM.submodule_search_locations[0]) if VLLM is not None else None
needs_vllm = pytest.mark.skipif(VLLM is None, reason="vLLM is not installed")


def test_collapse_inverts_the_data_layers_expansion():
    rng = np.random.default_rng(0)
    pad = 7
    for _ in range(50):
        n = int(rng.integers(1, 4))
        ids = [int(t) for t in rng.integers(10, 20, 12)]
        for k in sorted(rng.choice(len(ids), n, replace=False), reverse=True):
            ids.insert(int(k), pad)
        counts = [int(c) for c in rng.integers(1, 6, n)]
        assert vllm_vision.collapse_image_tokens(expand_image_tokens(ids, counts, pad), counts, pad) == ids
    with pytest.raises(ValueError, match="fewer than"):  # a run shorter than its image's tokens
        vllm_vision.collapse_image_tokens([1, pad, pad, 2], [3], pad)
    with pytest.raises(ValueError, match="more image placeholders"):
        vllm_vision.collapse_image_tokens([1, pad, 2, pad], [1], pad)
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        vllm_vision.collapse_image_tokens([1, pad, 2], [1, 1], pad)


def _images(rng, sizes):
    from PIL import Image

    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB") for h, w in sizes]


def test_images_recovered_from_pixel_values_give_the_same_pixel_values():
    """The asset's processor (every image resized to 64 x 64) and one with Qwen2-VL's own patch 14 and a pixel
    range that keeps non-square sizes; the second pass is asked not to resize, as the engine is
    (``engine_kwargs``): ``smart_resize`` is not idempotent in general (with ``min_pixels == max_pixels`` a
    resized 56 x 84 image, 4704 pixels, would be resized again)."""
    import transformers

    rng = np.random.default_rng(1)
    proc = VisionProcessor(ASSET).image_processor
    wide = transformers.AutoImageProcessor.from_pretrained(
        ASSET, patch_size=14, size={"shortest_edge": 56 * 56, "longest_edge": 200 * 200})
    for processor, sizes in ((proc, [(64, 64), (40, 90), (120, 33)]), (wide, [(100, 150), (61, 61), (200, 90)])):
        settings = {**vllm_vision.model_vision_settings(ASSET), "patch_size": processor.patch_size}
        first = processor(images=_images(rng, sizes), return_tensors="np")
        back = vllm_vision.images_from_pixels(first["pixel_values"], first["image_grid_thw"], settings)
        assert [x.shape[:2] for x in back] == [(int(h) * processor.patch_size, int(w) * processor.patch_size)
                                               for _, h, w in first["image_grid_thw"]]
        again = processor(images=back, return_tensors="np", do_resize=False)
        np.testing.assert_array_equal(again["image_grid_thw"], first["image_grid_thw"])
        np.testing.assert_allclose(again["pixel_values"], first["pixel_values"], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="patches of 3 x 2 x 14 x 14"):
        vllm_vision.images_from_pixels(first["pixel_values"][:, :-1], first["image_grid_thw"], settings)
    with pytest.raises(ValueError, match="patches for image grids"):
        vllm_vision.images_from_pixels(first["pixel_values"][:-4], first["image_grid_thw"], settings)


def test_prompt_input_one_placeholder_per_image_and_the_images():
    from PIL import Image

    vp = VisionProcessor(ASSET)
    settings = vllm_vision.model_vision_settings(ASSET)
    pics = _images(np.random.default_rng(2), [(64, 64), (50, 70)])
    msg = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Add."}]}]
    ex = vp.render(msg, pics)
    item = {"pixel_values": ex["pixel_values"].numpy(), "image_grid_thw": ex["image_grid_thw"].numpy()}
    req = vllm_vision.prompt_input(ex["input_ids"], item, settings)
    assert set(req) == {"prompt_token_ids", "multi_modal_data"}
    assert req["prompt_token_ids"].count(vp.image_token_id) == 2
    grid = item["image_grid_thw"]
    assert len(ex["input_ids"]) - len(req["prompt_token_ids"]) == sum(int(g.prod()) // 4 - 1 for g in grid)
    assert [(x.height, x.width) for x in req["multi_modal_data"]["image"]] == [(h * 8, w * 8) for _, h, w in grid]
    assert all(isinstance(x, Image.Image) and x.mode == "RGB" for x in req["multi_modal_data"]["image"])
    assert vllm_vision.prompt_input([1, 2], None, settings) == {"prompt_token_ids": [1, 2]}
    assert vllm_vision.engine_kwargs(None, 3) == {}
    assert vllm_vision.engine_kwargs(settings, 3)["limit_mm_per_prompt"] == {"image": 3, "video": 0}


def _class_fields(path: Path, names: tuple) -> set:
    """The annotated fields of the classes ``names`` in the source file ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.target.id for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name in names
            for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


@needs_vllm
def test_request_and_engine_keywords_exist_in_the_installed_vllm():
    """``TokensPrompt`` (with its ``_PromptOptions``) and ``EngineArgs`` of the installed vLLM have every key the
    adapter sends."""
    prompt_keys = _class_fields(VLLM_DIR / "inputs" / "llm.py", ("TokensPrompt", "_PromptOptions"))
    settings = vllm_vision.model_vision_settings(ASSET)
    item = {"pixel_values": np.zeros((64, 384), np.float32), "image_grid_thw": np.array([[1, 8, 8]])}
    assert set(vllm_vision.prompt_input([1] + [settings["image_token_id"]] * 16 + [2], item, settings)) <= prompt_keys
    engine = _class_fields(VLLM_DIR / "engine" / "arg_utils.py", ("EngineArgs",))
    assert set(vllm_vision.engine_kwargs(settings, 2)) <= engine


# each family: vLLM's module and class, as the model's config.json names the class
VLLM_CLASSES = {"qwen2_vl": ("qwen2_vl.py", "Qwen2VLForConditionalGeneration"),
                "qwen2_5_vl": ("qwen2_5_vl.py", "Qwen2_5_VLForConditionalGeneration")}


def _folder(family: str, request) -> str:
    return ASSET if family == "qwen2_vl" else request.getfixturevalue("qwen2_5_vl_dir")


def _mapper_prefixes(family: str = "qwen2_vl") -> dict:
    """``orig_to_new_prefix`` of the family's ``hf_to_vllm_mapper`` (``Qwen2VLForConditionalGeneration``'s or
    ``Qwen2_5_VLForConditionalGeneration``'s) in the installed vLLM's source (the modules cannot be imported here
    without torchvision)."""
    module, name = VLLM_CLASSES[family]
    tree = ast.parse((VLLM_DIR / "model_executor" / "models" / module).read_text(encoding="utf-8"))
    cls = next(c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == name)
    assign = next(n for n in cls.body if isinstance(n, ast.Assign) and n.targets[0].id == "hf_to_vllm_mapper")
    kw = {k.arg: k.value for k in assign.value.keywords}
    assert set(kw) == {"orig_to_new_prefix"}, "vLLM's mapper has rules this test does not model"
    return ast.literal_eval(kw["orig_to_new_prefix"])


def _map(name: str, prefixes: dict) -> str:
    """``WeightsMapper._map_name_with_shard``'s prefix loop (vLLM 0.32 ``models/utils.py``): every rule in order,
    each replacing once, no early exit."""
    for prefix, new in prefixes.items():
        if name.startswith(prefix):
            name = name.replace(prefix, new, 1)
    return name


@needs_vllm
@pytest.mark.parametrize("family", sorted(VLLM_CLASSES))
def test_pushed_names_map_onto_vllms_qwen2_vl_modules(family, request):
    """The trainer's names (transformers 5: ``model.language_model.*``, ``model.visual.*``) and the
    checkpoint's (``model.*``, ``visual.*``) land on the same vLLM names, under its ``language_model`` and
    ``visual`` modules; the vision tower's names are the ones ``is_vision_param`` leaves out of a frozen push.
    Qwen2-VL (the toy) and Qwen2.5-VL (a tiny random one), each with its own vLLM class's mapper."""
    import torch
    import transformers
    from safetensors import safe_open

    from chatlearn.models.vision import is_vision_param

    folder_path = _folder(family, request)
    config = transformers.AutoConfig.from_pretrained(folder_path)
    assert config.architectures == [VLLM_CLASSES[family][1]] and config.model_type == family
    prefixes = _mapper_prefixes(family)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    trainer = [n for n, _ in model.named_parameters()]
    with safe_open(os.path.join(folder_path, "model.safetensors"), "pt") as f:
        folder = sorted(f.keys())
    mapped = {_map(n, prefixes) for n in trainer}
    assert mapped == {_map(n, prefixes) for n in folder}
    for name in trainer:
        new = _map(name, prefixes)
        want = "visual." if is_vision_param(name) else ("language_model.model.", "language_model.lm_head.")
        assert new.startswith(want), (name, new)


def test_vllm_refused_only_where_it_cannot_import_its_qwen2_vl_module(monkeypatch):
    from chatlearn.config import vision_keys

    real_find = importlib.util.find_spec
    monkeypatch.setattr(vision_keys.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchvision" else real_find(name, *a))
    if importlib.util.find_spec("torchvision") is None and vision_keys.VLLM_NEEDS not in sys.modules:
        why = vision_keys.vllm_vision_problem(ASSET)
        assert "torchvision" in why and "runtime_args.rollout_backend: hf" in why
    monkeypatch.setattr(vision_keys.importlib, "import_module", lambda name: None)  # e.g. torchvision's there
    assert vision_keys.vllm_vision_problem(ASSET) is None


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", sorted(VLLM_CLASSES))
def test_real_vllm_logprobs_and_weight_pushes_on_image_prompts(family, request):
    """The real engine, about 45 s here (loaded machine), on Qwen2-VL (the toy) and Qwen2.5-VL (a tiny random
    one: vLLM's own Qwen2.5-VL class, its windowed vision attention)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT / "tests" / "support" / "vllm_no_torchvision"), str(ROOT), str(ROOT / "tests" / "support")]))
    script = str(Path(__file__).with_name("vllm_vision_real.py"))
    run = subprocess.run([sys.executable, script, _folder(family, request)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, run.stdout[-3000:] + run.stderr[-5000:]
    out = json.loads(line[len("RESULT "):])
    assert out["same_prompts"] and out["responses"] > 0
    assert out["architectures"] == [VLLM_CLASSES[family][1]]
    assert out["gap_start"] < 1e-4  # float32 on the CPU, as the text path (tests/e2e/test_train_e2e.py)
    assert out["gap_stale"] > 0.1  # the language model moved: the engine's old weights are seen to differ
    assert out["gap_lm_push"] < 1e-4  # ... and the push without the vision tower landed
    assert out["gap_vision_stale"] > 0.01  # the vision tower moved
    assert out["gap_full_push"] < 1e-4  # the full push landed, vision tower and image features included
    assert out["gap_probe"] < 1e-4  # the weight-push landing check's probe, on the VLM


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_vllm_in_a_grpo_run_on_image_prompts(tmp_path):
    """``chatlearn run template/grpo_vlm.yaml`` with the vLLM rollout and LoRA adapters pushed as adapters, 2 short
    episodes (about 60 s here): the FSDP trainer's log-probs of the engine's samples and the weight push's landing
    check, on image prompts. The adapters name the language model ``model.language_model.*``, the base folder
    ``model.*`` and vLLM ``language_model.model.*``: the manifest's renames and vLLM's mapper meet there."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT / "tests" / "support" / "vllm_no_torchvision"), str(ROOT)]))
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_vlm.yaml",
                          "runtime_args.rollout_backend=vllm", "runtime_args.num_episode=2",
                          "runtime_args.sample_per_episode=32", "runtime_args.train_micro_batch_size=32",
                          "runtime_args.train_global_batch_size=32", "runtime_args.enable_eval_before_training=False",
                          "runtime_args.eval_episode_interval=100", "runtime_args.save_episode_interval=100",
                          "models.policy_trainer.lora.rank=8", "models.policy_trainer.optimizer.lr=1e-2",
                          f"runtime_args.output_dir={out}"], env=env, capture_output=True, text=True, timeout=600,
                         cwd=str(ROOT))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/logprob_diff_rollout_vs_trainer_max"] < 1e-4
        assert r["sync/landing_gap_max"] < 1e-4
        assert 0 < r["sync/bytes"] < r["sync/full_bytes"] / 5  # the adapters alone
