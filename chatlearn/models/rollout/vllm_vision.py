"""Prompts with images in the vLLM rollout (Qwen2-VL, Qwen2.5-VL): what :class:`~chatlearn.models.rollout.vllm.
VLLMRollout` hands ``LLM.generate`` for a prompt whose sample carries an image dict (chatlearn/models/vision.py).

vLLM 0.32's request format for a multi-modal prompt given as token ids is ``{"prompt_token_ids": [...],
"multi_modal_data": {"image": [image, ...]}}`` (``vllm.inputs.TokensPrompt``). Two facts of vLLM 0.32 shape it:

* **Placeholders: one per image.** vLLM's Qwen2-VL processor (``Qwen2VLMultiModalProcessor._get_prompt_updates``,
  ``vllm/model_executor/models/qwen2_vl.py``) declares a ``PromptReplacement`` of the target ``[<|image_pad|>]``
  by ``grid_thw.prod() // merge_size**2`` copies, and ``BaseMultiModalProcessor._maybe_apply_prompt_updates``
  (``vllm/multimodal/processing/processor.py``) always applies it to a token prompt: it does not detect a
  prompt already expanded. chatlearn's data layer renders prompts expanded (the trainer needs them so), so each
  image's run of placeholders is collapsed back to one token (:func:`collapse_image_tokens`, the inverse of
  ``chatlearn.data.vision.expand_image_tokens``); vLLM re-expands it to the same count, and the sampled tokens'
  positions are those of the expanded prompt the trainer scores.
* **Images, not pixel values.** Its ``Qwen2VLMultiModalDataParser`` takes an image as a PIL image, an array or a
  tensor (which its processor resizes, rescales, normalises and cuts into patches) or, as a dict, precomputed
  ``image_embeds`` with ``image_grid_thw``; it takes no precomputed ``pixel_values``. Embeddings would bypass
  vLLM's vision tower, whose weights a run with ``freeze_vision_tower: false`` pushes, so each image goes as
  pixels: the image the processor made the sample's ``pixel_values`` from (already resized) is recovered from
  them exactly (:func:`images_from_pixels`: un-patchify, un-normalise, round to 8 bits), and vLLM's processor,
  built from the same ``preprocessor_config.json``, makes the same ``pixel_values`` of it (asked not to resize
  it again: ``mm_processor_kwargs={"do_resize": False}``, per request). ``tests/models/rollout/test_vllm_vision.py`` checks that round trip through the
  transformers image processor.

``limit_mm_per_prompt`` is ``models.policy.max_images_per_prompt`` images and no video (:func:`engine_kwargs`).
"""
from __future__ import annotations

import json
import os

import numpy as np

# the image processor's attributes the recovery reads (transformers' Qwen2-VL image processor)
PROCESSOR_FIELDS = ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "image_mean", "image_std",
                    "do_rescale", "do_normalize")


def model_vision_settings(path: str) -> dict | None:
    """The vision settings of the model folder ``path`` the recovery and the placeholders need: ``image_token_id``
    (config.json) and :data:`PROCESSOR_FIELDS` of the folder's image processor as transformers loads it (the
    processor the data layer made the pixel values with, ``chatlearn.data.vision.VisionProcessor``); None for a
    model without a ``vision_config``."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if not isinstance(config.get("vision_config"), dict):
        return None
    import transformers

    processor = transformers.AutoImageProcessor.from_pretrained(path)
    settings = {k: getattr(processor, k) for k in PROCESSOR_FIELDS}
    settings["image_token_id"] = int(config["image_token_id"])
    return settings


def collapse_image_tokens(ids: list[int], counts: list[int], image_token_id: int) -> list[int]:
    """``ids`` with each image's run of ``counts[k]`` placeholders ``image_token_id`` made one token (the
    inverse of ``chatlearn.data.vision.expand_image_tokens``). A run of another length, or placeholders left
    over, is a ValueError: the prompt and its images would not match in vLLM."""
    out, k, i = [], 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out.append(ids[i])
            i += 1
            continue
        if k >= len(counts):
            raise ValueError(f"more image placeholders than the prompt's {len(counts)} images")
        run = ids[i:i + counts[k]]
        if len(run) != counts[k] or any(t != image_token_id for t in run):
            raise ValueError(f"image {k}: fewer than its {counts[k]} placeholder tokens in a row")
        out.append(image_token_id)
        i += counts[k]
        k += 1
    if k != len(counts):
        raise ValueError(f"{k} image placeholders for {len(counts)} images")
    return out


def images_from_pixels(pixel_values: np.ndarray, grid_thw: np.ndarray, settings: dict) -> list[np.ndarray]:
    """The images (uint8 ``[height, width, 3]``) whose Qwen2-VL ``pixel_values`` (``[patches, C * T * P * P]``,
    every image's patches in order) and ``image_grid_thw`` (``[images, 3]``) are given: the inverse of the
    image processor's rescale, normalise and ``patchify`` (transformers' ``Qwen2VLImageProcessor``; its
    temporal copies of a still image are equal, the first is read)."""
    p, t, m = int(settings["patch_size"]), int(settings["temporal_patch_size"]), int(settings["merge_size"])
    mean = np.asarray(settings["image_mean"], dtype=np.float64).reshape(3, 1, 1)
    std = np.asarray(settings["image_std"], dtype=np.float64).reshape(3, 1, 1)
    pixels = np.asarray(pixel_values, dtype=np.float64)
    grids = np.asarray(grid_thw, dtype=np.int64).tolist()
    if pixels.ndim != 2 or pixels.shape[1] != 3 * t * p * p:
        raise ValueError(f"pixel values of shape {pixels.shape}: patches of 3 x {t} x {p} x {p} values expected")
    if sum(t_ * h * w for t_, h, w in grids) != len(pixels):
        raise ValueError(f"{len(pixels)} patches for image grids that hold {sum(t_ * h * w for t_, h, w in grids)}")
    out, start = [], 0
    for frames, gh, gw in grids:
        if frames != 1:
            raise ValueError(f"an image with {frames} temporal patches (a video?): images have 1")
        n = gh * gw
        patches = pixels[start:start + n].reshape(gh // m, gw // m, m, m, 3, t, p, p)[:, :, :, :, :, 0]
        start += n
        # (gh/m, gw/m, mh, mw, C, ph, pw) -> (C, gh/m, mh, ph, gw/m, mw, pw) -> (C, H, W)
        image = patches.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * p, gw * p)
        if settings["do_normalize"]:
            image = image * std + mean
        if settings["do_rescale"]:
            image = image / float(settings["rescale_factor"])
        out.append(np.clip(np.rint(image), 0, 255).astype(np.uint8).transpose(1, 2, 0))
    return out


def token_counts(grid_thw: np.ndarray, merge_size: int) -> list[int]:
    """The placeholder tokens of each image of ``grid_thw`` (Qwen2-VL: ``t * h * w // merge_size**2``)."""
    return [int(np.prod(g)) // int(merge_size) ** 2 for g in np.asarray(grid_thw, dtype=np.int64)]


def prompt_input(ids: list[int], images: dict | None, settings: dict | None) -> dict:
    """The ``LLM.generate`` input of one prompt ``ids`` (placeholders expanded) with its image dict ``images``
    (``{"pixel_values", "image_grid_thw"}``, or None: a text prompt, ``{"prompt_token_ids": ids}``)."""
    if images is None or not len(images["image_grid_thw"]):
        return {"prompt_token_ids": list(ids)}
    if settings is None:
        raise ValueError("a prompt with images for a rollout model without a vision tower")
    from PIL import Image

    counts = token_counts(images["image_grid_thw"], settings["merge_size"])
    recovered = images_from_pixels(images["pixel_values"], images["image_grid_thw"], settings)
    return {"prompt_token_ids": collapse_image_tokens(list(ids), counts, settings["image_token_id"]),
            "multi_modal_data": {"image": [Image.fromarray(x, "RGB") for x in recovered]}}


def engine_kwargs(settings: dict | None, max_images: int) -> dict:
    """``vllm.LLM`` arguments for a vision-language model: at most ``max_images`` images a prompt, no video
    (``limit_mm_per_prompt``, which also sizes vLLM's encoder cache and its start-up profiling); none for a
    text model."""
    if settings is None:
        return {}
    return {"limit_mm_per_prompt": {"image": int(max_images), "video": 0},
            # the images come at the size the processor resized them to: no second resize
            "mm_processor_kwargs": {"do_resize": False}}
