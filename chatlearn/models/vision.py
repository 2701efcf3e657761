"""Vision-language models (Qwen2-VL, Qwen2.5-VL) in the backends: what the transformers rollout and the FSDP
trainer share.

A prompt's images travel as one dict per sample, ``{"pixel_values": float32 [patches, C*T*P*P],
"image_grid_thw": int64 [images, 3]}`` (None for a sample without images; the samples of one prompt hold the
same dict: made once per prompt by the driver). The model is called with ``inputs_embeds`` (the token
embeddings with each image's features put in place of its placeholder tokens, :func:`embed_with_images`) and
multimodal rotary positions made per sample by the model's own ``get_rope_index`` (:func:`sample_positions`):
so samples can be laid out padded or packed in one row alike, and each sample's positions are those the model
computes for it alone.
"""
from __future__ import annotations

import numpy as np
import torch

# where the vision tower sits in transformers' Qwen2-VL / Qwen2.5-VL classes (5.x: model.visual)
VISION_PREFIXES = ("model.visual.", "visual.")


def is_vlm(model) -> bool:
    """Whether ``model`` is a vision-language model this module drives (multimodal rotary positions)."""
    inner = getattr(model, "model", None)
    return getattr(model.config, "vision_config", None) is not None and hasattr(inner, "get_rope_index")


def vision_tower(model) -> torch.nn.Module:
    return model.model.visual


def is_vision_param(name: str) -> bool:
    """Whether the parameter ``name`` (as ``named_parameters`` of the whole model gives it) is the vision
    tower's (its merger included)."""
    return name.startswith(VISION_PREFIXES)


def image_token_id(model) -> int:
    return int(model.config.image_token_id)


def stack_images(items: list) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The ``pixel_values`` and ``image_grid_thw`` of the samples' image dicts ``items`` (None entries
    skipped), concatenated in order; (None, None) when none has images."""
    items = [x for x in items if x is not None and len(x["image_grid_thw"])]
    if not items:
        return None, None
    pixels = torch.from_numpy(np.concatenate([np.asarray(x["pixel_values"], dtype=np.float32) for x in items]))
    grid = torch.from_numpy(np.concatenate([np.asarray(x["image_grid_thw"], dtype=np.int64) for x in items]))
    return pixels, grid


def sample_positions(model, ids: torch.Tensor, grid: torch.Tensor | None, prompt_len: int | None = None) -> torch.Tensor:
    """``[3, len(ids)]`` multimodal rotary positions of one sample's tokens ``ids`` (1-D, no padding) with the
    images of grid rows ``grid`` (None: text, every row the token index). Only the first ``prompt_len`` tokens
    (None: all) can be an image's: a response that samples the placeholder token has text there."""
    n = ids.shape[0]
    if grid is None or not len(grid):
        return torch.arange(n, device=ids.device).expand(3, n)
    types = (ids == image_token_id(model)).int()
    if prompt_len is not None:
        types[prompt_len:] = 0
    positions, _ = model.model.get_rope_index(ids[None], types[None], image_grid_thw=grid.to(ids.device))
    return positions[:, 0]


def embed_with_images(model, ids: torch.Tensor, pixels: torch.Tensor | None,
                      grid: torch.Tensor | None, where: torch.Tensor | None = None) -> torch.Tensor:
    """The input embeddings of ``ids`` with the vision tower's features of the images (``pixels``, ``grid``; in
    the order their placeholders occur in ``ids``, row after row) in place of the placeholder tokens, as the
    model's own forward does (``get_image_features`` then ``masked_scatter``). ``where`` (bool, ``ids``' shape):
    the placeholders that are images' (the prompts'; a response may sample the token); None: every one."""
    embeds = model.get_input_embeddings()(ids)
    if pixels is None:
        return embeds
    features = model.model.get_image_features(pixels.to(ids.device), grid.to(ids.device), return_dict=True)
    features = torch.cat(features.pooler_output, dim=0).to(embeds.dtype)
    mask = (ids == image_token_id(model)) if where is None else where
    if not bool(mask.any()):  # a blank image (blank_image): its features count for nothing, its gradients are 0
        return embeds + 0.0 * features.sum()
    mask = mask[..., None].expand_as(embeds)
    if int(mask[..., 0].sum()) != features.shape[0]:
        raise ValueError(f"{int(mask[..., 0].sum())} image tokens for {features.shape[0]} image features: the "
                         "prompts' image placeholders and their images do not match")
    return embeds.masked_scatter(mask, features)


def blank_image(model) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values, image_grid_thw)`` of the smallest image the vision tower takes (one merged token, all
    zeros): what a sharded rank whose micro-batch has no image runs the tower on, so that every rank runs the
    tower's all-gathers (and, when it trains, reduce-scatters) in the same forwards; its features are
    multiplied by 0 (:func:`embed_with_images`)."""
    v = model.config.vision_config
    merge = int(v.spatial_merge_size)
    width = int(v.in_channels) * int(v.temporal_patch_size) * int(v.patch_size) ** 2
    return torch.zeros((merge * merge, width)), torch.tensor([[1, merge, merge]])


def sample_grids(items: list) -> list[torch.Tensor | None]:
    """Each sample's ``image_grid_thw`` as a tensor (None without images)."""
    return [None if x is None or not len(x["image_grid_thw"])
            else torch.from_numpy(np.asarray(x["image_grid_thw"], dtype=np.int64)) for x in items]


def model_class(path: str, causal_lm_class, trust_remote_code: bool = False):
    """The transformers auto class that loads the folder at ``path``: ``AutoModelForImageTextToText`` for a
    vision-language model (its config has a ``vision_config``), else ``causal_lm_class``."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if getattr(config, "vision_config", None) is not None:
        return transformers.AutoModelForImageTextToText
    return causal_lm_class
