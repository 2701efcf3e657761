"""Prompts with images: what a vision-language model's prompt is made of, and how it is checked and rendered.

A prompt's messages may hold images as Hugging Face chat content lists::

    {"role": "user", "content": [{"type": "image", "image": "images/0001.png"},
                                 {"type": "text", "text": "Add the digits."}]}

An image is a file path (relative to the data file that holds the row), base64 text (``data:image/...;base64,``
or bare), a ``datasets`` Image feature (``{"bytes": ..., "path": ...}``, or a decoded ``PIL.Image``); a URL is
refused (runs are offline). :func:`message_images` finds them, :func:`decode_image` decodes one to RGB, and
:class:`VisionProcessor` renders a conversation and its images into the model's token ids (each image's
placeholder expanded to its number of vision tokens) with the pixel values and the ``image_grid_thw`` the
model's forward takes. The processor is ``transformers.AutoProcessor`` where that loads (the Qwen2-VL
processor needs torchvision for its video half); otherwise the folder's image processor and tokenizer, with
the same placeholder expansion as ``Qwen2VLProcessor`` (``grid.prod() // merge_size**2`` tokens per image).
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import os

from chatlearn.errors import UserError

IMAGE_TYPES = ("image", "image_url")
# the placeholder of one image in the rendered text (Qwen2-VL / Qwen2.5-VL)
IMAGE_PAD = "<|image_pad|>"


def message_images(messages: list[dict]) -> list:
    """The image references of ``messages`` in order (the ``image`` of each ``{"type": "image"}`` part)."""
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") in IMAGE_TYPES:
                ref = part.get("image", part.get("image_url"))
                if isinstance(ref, dict) and "url" in ref and "bytes" not in ref:
                    ref = ref["url"]
                out.append(ref)
    return out


def _fix(where: str, what: str) -> str:
    return (f"{where}: {what}. An image is a path relative to the data file, base64 text, or a datasets Image "
            "feature; fix or drop the row.")


def decode_image(ref, base_dir: str, where: str):
    """The image ``ref`` (see the module docstring) as an RGB ``PIL.Image``, fully loaded; UserError naming
    ``where`` for a URL, a missing file or bytes that do not decode."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    data = None
    if isinstance(ref, dict):
        data, ref = ref.get("bytes"), ref.get("path")
    if data is None:
        if not isinstance(ref, str) or not ref:
            raise UserError(_fix(where, f"an image part holds {type(ref).__name__}, not an image"))
        if ref.startswith(("http://", "https://")):
            raise UserError(_fix(where, f"the image {ref[:80]!r} is a URL; runs are offline, so images must be "
                                        "local files or base64"))
        data = _read_ref(ref, base_dir, where)
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise UserError(_fix(where, f"the image does not decode ({exc})")) from None


def _read_ref(ref: str, base_dir: str, where: str) -> bytes:
    if ref.startswith("data:"):
        return _b64(ref.partition(",")[2], where)
    path = ref[len("file://"):] if ref.startswith("file://") else ref
    path = path if os.path.isabs(path) else os.path.join(base_dir, path)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read()
    try:  # no such file: bare base64 text (a path has a character base64 has not, e.g. its "." or a space)
        return base64.b64decode(ref, validate=True)
    except (binascii.Error, ValueError):
        pass
    raise UserError(_fix(where, f"the image file {path} does not exist"))


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise UserError(_fix(where, "the image's base64 text does not decode")) from None


def image_limit(config: dict) -> int | None:
    """How many images one prompt may hold for the model of ``config`` (config.json as a dict): None when
    the model takes no images, else its limit (Qwen2-VL has none of its own: a large number)."""
    if "vision_config" not in config:
        return None
    return int(config.get("max_images_per_prompt", 64))


class VisionProcessor:
    """A model folder's processor for prompts with images (see the module docstring)."""

    def __init__(self, path: str):
        import transformers

        self.path = path
        try:
            processor = transformers.AutoProcessor.from_pretrained(path)
        except (ImportError, AttributeError, ValueError, TypeError, OSError):
            processor = None  # e.g. Qwen2-VL without torchvision: its video processor does not load
        if processor is not None and hasattr(processor, "image_processor"):
            self.image_processor, self.tokenizer = processor.image_processor, processor.tokenizer
        else:
            self.image_processor = transformers.AutoImageProcessor.from_pretrained(path)
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.merge_size = int(getattr(self.image_processor, "merge_size", 1))
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)

    def images(self, images: list, tensors: str = "np") -> dict:
        """``pixel_values`` (all images' patches, float) and ``image_grid_thw`` (one row an image), as numpy
        arrays (``tensors`` "np") or torch tensors ("pt")."""
        return dict(self.image_processor(images=images, return_tensors=tensors))

    def render(self, messages: list[dict], images: list, *, enable_thinking: bool = False) -> dict:
        """``input_ids`` (a list, each image's placeholder expanded), ``pixel_values`` and ``image_grid_thw``
        (None without images) for a conversation ending with the generation prompt."""
        ids = list(self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                      return_dict=False, enable_thinking=enable_thinking))
        if not images:
            return {"input_ids": ids, "pixel_values": None, "image_grid_thw": None}
        vision = self.images(images, "pt")
        counts = [int(g.prod()) // self.merge_size ** 2 for g in vision["image_grid_thw"]]
        try:
            out = expand_image_tokens(ids, counts, self.image_token_id)
        except ValueError as err:
            raise UserError(f"the chat template of {self.path} wrote {err} ({IMAGE_PAD}): it must render every "
                            "image part of a message") from None
        return {"input_ids": out, "pixel_values": vision["pixel_values"],
                "image_grid_thw": vision["image_grid_thw"]}


def resolve_image(ref, base_dir: str):
    """``ref`` in a form that no longer depends on the data file's folder: the path of an image file made
    absolute; anything else (base64 text, bytes, a decoded image) as it is."""
    if isinstance(ref, str) and not ref.startswith(("data:", "http://", "https://")) and len(ref) <= 4096:
        path = ref[len("file://"):] if ref.startswith("file://") else ref
        path = path if os.path.isabs(path) else os.path.abspath(os.path.join(base_dir, path))
        return path if os.path.isfile(path) else ref
    return ref


def model_vision(path: str | None) -> dict | None:
    """The vision settings of the model folder at ``path`` (its config.json and preprocessor_config.json):
    ``{"image_token_id", "merge_size", "patch_size"}``; None for a model without a vision tower (or no
    local folder)."""
    config_file = os.path.join(path or "", "config.json")
    if not path or not os.path.isfile(config_file):
        return None
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    vision = config.get("vision_config")
    if not isinstance(vision, dict) or "image_token_id" not in config:
        return None
    return {"image_token_id": int(config["image_token_id"]),
            "merge_size": int(vision.get("spatial_merge_size", 1)), "patch_size": int(vision.get("patch_size", 14))}


def image_token_counts(images: list, processor) -> list[int]:
    """The vision tokens of each decoded image for ``processor`` (an image processor with ``merge_size``
    and ``get_number_of_image_patches``, as Qwen2-VL's)."""
    merge = int(getattr(processor, "merge_size", 1))
    return [int(processor.get_number_of_image_patches(img.height, img.width, {})) // merge ** 2 for img in images]


def expand_image_tokens(ids: list[int], counts: list[int], image_token_id: int) -> list[int]:
    """``ids`` with its k-th ``image_token_id`` repeated ``counts[k]`` times (the processor's expansion)."""
    out, k = [], 0
    for token in ids:
        if token == image_token_id and k < len(counts):
            out.extend([token] * counts[k])
            k += 1
        else:
            out.append(token)
    if k != len(counts):
        raise ValueError(f"{k} image placeholders for {len(counts)} images")
    return out


def check_image_prompts(images: list[list], base_dirs: list[str], wheres: list[str], *, model_path: str | None,
                        max_images: int, key: str = "models.policy.load") -> tuple[list[list], list[list[int]]]:
    """Every prompt's images decoded once (a missing file, bytes that do not decode, a URL: a UserError naming
    the row), counted against ``max_images`` (models.policy.max_images_per_prompt) and the model (a model
    without a vision tower refuses images). Returns each prompt's images resolved
    (:func:`resolve_image`) and the vision tokens of each image."""
    first = next((i for i, refs in enumerate(images) if refs), None)
    if first is None:
        return images, [[] for _ in images]
    vision = model_vision(model_path)
    if vision is None:
        raise UserError(f"{wheres[first]}: the prompt holds an image, but the model at {model_path!r} takes text only "
                        f"(its config.json has no vision_config). Use a vision-language model (e.g. Qwen2-VL, "
                        f"Qwen2.5-VL) or data without images.", key=key)
    import transformers

    processor = transformers.AutoImageProcessor.from_pretrained(model_path)
    resolved, counts = [], []
    for refs, base, where in zip(images, base_dirs, wheres, strict=True):
        if len(refs) > max_images:
            raise UserError(f"{where}: the prompt holds {len(refs)} images, more than models.policy."
                            f"max_images_per_prompt ({max_images}). Raise that key, or split the row.",
                            key="models.policy.max_images_per_prompt")
        decoded = [decode_image(ref, base, where) for ref in refs]
        counts.append(image_token_counts(decoded, processor) if decoded else [])
        resolved.append([resolve_image(ref, base) for ref in refs])
    return resolved, counts


def image_names(refs: list) -> list[str]:
    """How a sample log names each image of ``refs``: its path, else what it is (base64 text, bytes, a decoded
    image) and its size."""
    out = []
    for ref in refs or ():
        if isinstance(ref, dict) and ref.get("path"):
            ref = ref["path"]
        if isinstance(ref, str):
            out.append(ref if os.path.isfile(ref) or len(ref) < 512 and not ref.startswith("data:")
                       else f"<base64 image, {len(ref)} characters>")
        elif isinstance(ref, dict):
            out.append(f"<image bytes, {len(ref.get('bytes') or b'')} bytes>")
        else:
            out.append(f"<decoded image {getattr(ref, 'width', '?')}x{getattr(ref, 'height', '?')}>")
    return out
