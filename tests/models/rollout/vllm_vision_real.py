"""Run by tests/models/rollout/test_vllm_vision.py in a process of its own, with the real vLLM 0.32 and
tests/support/vllm_no_torchvision first on PYTHONPATH: chatlearn's VLLMRollout on a Qwen2-VL or Qwen2.5-VL
folder (the first argument: the toy ``assets/tiny_qwen2_vl`` or a tiny random Qwen2.5-VL) with image prompts, against transformers' forward of the same model (what the FSDP
trainer computes, tests/models/test_vlm.py), before and after weight pushes under the trainer's names. Prints
one line ``RESULT {json}``."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from vlm_reference import batch_gap  # tests/support/ (on PYTHONPATH)

ASSET = sys.argv[1]
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": 3}


def image_prompts(proc):
    """Three prompts with one or two images (random pixels, two sizes) and a text prompt."""
    from PIL import Image

    rng = np.random.default_rng(0)

    def img(h, w):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")

    convs = [([img(64, 64)], "What is drawn?"), ([img(40, 90)], "Add the digits."),
             ([img(64, 64), img(70, 50)], "Compare them.")]
    prompts, images = [], []
    for pics, text in convs:
        msg = [{"role": "user", "content": [{"type": "image"}] * len(pics) + [{"type": "text", "text": text}]}]
        ex = proc.render(msg, pics)
        prompts.append(ex["input_ids"])
        images.append({"pixel_values": ex["pixel_values"].numpy(), "image_grid_thw": ex["image_grid_thw"].numpy()})
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": "Add 3 and 4."}], tokenize=True,
                                              add_generation_prompt=True, return_dict=False)
    return prompts + [list(text)], images + [None]


def reference(model, batch, images, image_id):
    """The largest |rollout - transformers| log-prob over the sampled tokens of every sample."""
    return batch_gap(model, batch, batch["rollout_logprobs"], images, image_id)


def push(ro, model, names):
    ro.begin_weight_update()
    params = dict(model.named_parameters())
    ro.load_weight_bucket([(n, params[n].detach()) for n in names])
    ro.finish_weight_update()


def main() -> None:
    import backend_specs
    import transformers

    from chatlearn.data.vision import VisionProcessor
    from chatlearn.models.rollout.vllm import VLLMRollout
    from chatlearn.models.vision import is_vision_param

    proc = VisionProcessor(ASSET)
    prompts, images = image_prompts(proc)
    model = transformers.AutoModelForImageTextToText.from_pretrained(ASSET, dtype=torch.float32).eval()
    ro = VLLMRollout(backend_specs.rollout_spec(ASSET, max_prompt_tokens_length=128, max_response_tokens_length=8,
                                                max_images_per_prompt=2))
    out = {"prompt_lens": [len(p) for p in prompts],
           "architectures": list(ro.llm.llm_engine.model_config.architectures)}  # the class vLLM built
    batch = ro.generate(prompts, SAMPLING, images)
    out["gap_start"] = reference(model, batch, images, proc.image_token_id)
    out["responses"] = int(len(batch["tokens"]) - sum(out["prompt_lens"]))
    out["same_prompts"] = all(list(batch["tokens"][o:o + n]) == p for o, n, p in
                              zip(batch["offsets"], out["prompt_lens"], prompts))
    names = [n for n, _ in model.named_parameters()]
    out["names"] = names
    torch.manual_seed(0)
    with torch.no_grad():  # the language model moves, the vision tower is frozen: its push leaves it out
        for n, p in model.named_parameters():
            if not is_vision_param(n):
                p.add_(torch.randn_like(p) * 0.05)
    before = ro.generate(prompts, SAMPLING, images)
    out["gap_stale"] = reference(model, before, images, proc.image_token_id)
    push(ro, model, [n for n in names if not is_vision_param(n)])
    out["gap_lm_push"] = reference(model, ro.generate(prompts, SAMPLING, images), images, proc.image_token_id)
    with torch.no_grad():  # now the vision tower trains too: a full push
        for n, p in model.named_parameters():
            if is_vision_param(n):
                p.add_(torch.randn_like(p) * 0.05)
    out["gap_vision_stale"] = reference(model, ro.generate(prompts, SAMPLING, images), images, proc.image_token_id)
    push(ro, model, names)
    out["gap_full_push"] = reference(model, ro.generate(prompts, SAMPLING, images), images, proc.image_token_id)
    probe = ro.probe_logprobs(prompts[-1])["logprobs"]
    ids = torch.tensor([prompts[-1]])
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    out["gap_probe"] = float(np.abs(probe - ref.numpy()).max())
    print("RESULT " + json.dumps(out))
    ro.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
