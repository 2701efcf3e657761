"""A tiny random Qwen2.5-VL folder for tests (no hub here): the language model, tokenizer and image processor of
the toy ``assets/tiny_qwen2_vl``, and a two-block Qwen2.5-VL vision tower with its windowed attention (one
windowed block, one full-attention block; windows of 2 x 2 merged tokens, so a 64 x 64 image has four).

``python tests/support/tiny_qwen2_5_vl.py FOLDER`` writes it; in a test, :func:`build` (seeded: the same
weights every time).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TOY = Path(__file__).resolve().parents[2] / "assets" / "tiny_qwen2_vl"
# everything but the weights and the model's config: the tokenizer, chat template and image processor
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json")
VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3, patch_size=8,
              spatial_merge_size=2, temporal_patch_size=2, window_size=32, fullatt_block_indexes=[1],
              tokens_per_second=4)


def build(folder: str | Path, seed: int = 0) -> str:
    """The tiny Qwen2.5-VL in ``folder`` (created); returns its path."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    toy = json.loads((TOY / "config.json").read_text())
    text = dict(toy["text_config"])
    for key in ("architectures", "model_type", "transformers_version", "dtype"):
        text.pop(key, None)
    ids = {k: toy[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(VISION, out_hidden_size=text["hidden_size"]),
                              architectures=["Qwen2_5_VLForConditionalGeneration"], dtype="float32",
                              tie_word_embeddings=toy.get("tie_word_embeddings", True), **ids)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).float()
    model.generation_config = GenerationConfig.from_pretrained(TOY)
    model.save_pretrained(folder)
    for name in PROCESSOR_FILES:
        shutil.copy(TOY / name, folder / name)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}) + "\n")
    return str(folder)


if __name__ == "__main__":
    print(build(sys.argv[1]))
