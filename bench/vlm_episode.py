"""One GRPO episode with images against the same episode on text of the same token count.

The model is the embedded VLM toy (``assets/tiny_qwen2_vl``: Qwen2-VL, 1.2M parameters, 16 vision tokens an
image) on ``--prompts`` eval prompts of ``assets/vlm_digits``, ``--group`` samples each, through ChatLearn's
own backends in one process (fp32, CPU): the transformers rollout (``HFRollout.generate``), the FSDP trainer's
log-prob pass (``compute_logprobs``) and one optimizer step (``train``), the vision tower frozen (the default).
The text episode is the same: the same prompt token ids with each image placeholder replaced by a text token
(so every prompt has the same length), no images. The driver's stage of the image episode (decoding the PNGs
and the image processor, once per prompt) is timed too.

Per stage: the median wall time over ``--repeats`` runs after one warm-up, and the peak resident memory above
the stage's start (sampled every 2 ms). Per sample: the bytes of pixel values its prompt carries (one copy per
prompt, shared by the group's samples: the per-sample cost is that over the group). Usage::

    .venv/bin/python bench/vlm_episode.py [--prompts 32] [--group 8] [--repeats 3] [--threads 1]

Prints a markdown table and writes ``bench/results/vlm_episode.json``. On a shared machine the times are noisy:
compare the ratios, measured in one process one after another.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "support"))
ASSET = os.path.join(REPO, "assets", "tiny_qwen2_vl")
DIGITS = os.path.join(REPO, "assets", "vlm_digits")
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 16, "seed": 1}


class PeakRSS:
    """The peak resident set size above the start, sampled every 2 ms while open."""

    def __enter__(self):
        self.start = self.peak = self._rss()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, self._rss())


def load_prompts(n: int):
    """The first ``n`` eval rows: their prompt ids and image references."""
    from chatlearn.data.dataset import VisionData, load_prompts as load, load_tokenizer

    tok = load_tokenizer(ASSET, trust_remote_code=False, key="bench")
    ps = load([os.path.join(DIGITS, "eval.jsonl")], tok, max_prompt_tokens=64, enable_thinking=False,
              prompt_key="prompt", ground_truth_key="reward_model.ground_truth", vision=VisionData(ASSET, 1))
    return ps.prompt_ids[:n], ps.images[:n]


def vision_stage(images: list, group: int):
    """The driver's image stage of an episode (decode + image processor once per prompt, shared per group)."""
    from chatlearn.runtime.driver.sampling import Sampling

    s = Sampling.__new__(Sampling)
    s.cfg = type("C", (), {"models": type("M", (), {"policy": type("P", (), {"load": ASSET})})})
    s._processor = None
    per_sample = [refs for refs in images for _ in range(group)]
    return s.vision_inputs(per_sample)


def episode(rollout, trainer, prompts: list, vision: list | None, group: int) -> tuple[dict, dict]:
    """One episode's stages: ``(seconds, peak bytes)`` by stage."""
    rows = [p for p in prompts for _ in range(group)]
    times, peaks = {}, {}
    with PeakRSS() as m:
        t = time.perf_counter()
        batch = rollout.generate(rows, SAMPLING, vision)
        times["generate"] = time.perf_counter() - t
    peaks["generate"] = m.peak - m.start
    if vision is not None:
        batch["images"] = vision
    n = len(batch["prompt_lens"])
    batch["advantages"] = np.linspace(-1, 1, n).astype(np.float32)
    with PeakRSS() as m:
        t = time.perf_counter()
        batch["old_logprobs"] = trainer.compute_logprobs(batch, temperature=1.0)
        times["logprobs"] = time.perf_counter() - t
    peaks["logprobs"] = m.peak - m.start
    with PeakRSS() as m:
        t = time.perf_counter()
        trainer.train(batch)
        times["train"] = time.perf_counter() - t
    peaks["train"] = m.peak - m.start
    return times, peaks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29561"))
    import backend_specs
    import torch

    from chatlearn.models.rollout.hf import HFRollout
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    torch.set_num_threads(args.threads)
    prompts, images = load_prompts(args.prompts)
    image_id = json.load(open(os.path.join(ASSET, "config.json")))["image_token_id"]
    filler = prompts[0][-2]  # a text token of the prompt, in place of each image placeholder
    text_prompts = [[filler if t == image_id else t for t in p] for p in prompts]
    n = args.prompts * args.group
    rollout = HFRollout(backend_specs.rollout_spec(ASSET, max_prompt_tokens_length=64, max_response_tokens_length=16,
                                                   generation_batch_size=n))
    trainer = FSDPTrainer(backend_specs.trainer_spec(ASSET, train_micro_batch_size=64, logprob_micro_batch_size=64,
                                                     train_global_batch_size=n, kl_coef=0.0, entropy_coef=0.0))
    results = {}
    for name in ("text", "images"):
        runs = []
        for r in range(args.repeats + 1):
            times, peaks = {}, {}
            vision = None
            if name == "images":
                with PeakRSS() as m:
                    t = time.perf_counter()
                    vision = vision_stage(images, args.group)
                    times["images (driver)"] = time.perf_counter() - t
                peaks["images (driver)"] = m.peak - m.start
            t2, p2 = episode(rollout, trainer, prompts if name == "images" else text_prompts, vision, args.group)
            times.update(t2)
            peaks.update(p2)
            if r:  # the first run warms up
                runs.append((times, peaks))
        stages = list(runs[0][0])
        results[name] = {s: {"seconds": statistics.median(t[s] for t, _ in runs),
                             "peak_mb": max(p[s] for _, p in runs) / 2 ** 20} for s in stages}
        if name == "images":
            per_prompt = int(vision[0]["pixel_values"].nbytes + vision[0]["image_grid_thw"].nbytes)
            results["pixel_bytes"] = {"per_prompt": per_prompt, "per_sample": per_prompt / args.group,
                                      "shared_copies": len({id(v) for v in vision})}
    results["setup"] = {"prompts": args.prompts, "group": args.group, "repeats": args.repeats,
                        "threads": args.threads, "prompt_tokens": len(prompts[0])}
    print("| stage | text s | images s | ratio | text peak MB | images peak MB |")
    print("|---|---|---|---|---|---|")
    for s in results["images"]:
        t = results["text"].get(s, {"seconds": 0.0, "peak_mb": 0.0})
        i = results["images"][s]
        ratio = f"{i['seconds'] / t['seconds']:.2f}" if t["seconds"] else "-"
        print(f"| {s} | {t['seconds']:.3f} | {i['seconds']:.3f} | {ratio} | {t['peak_mb']:.1f} | {i['peak_mb']:.1f} |")
    pb = results["pixel_bytes"]
    print(f"pixel values: {pb['per_prompt']:,} bytes a prompt, {pb['per_sample']:,.0f} a sample "
          f"({pb['shared_copies']} copies for {n} samples)")
    os.makedirs(os.path.join(REPO, "bench", "results"), exist_ok=True)
    with open(os.path.join(REPO, "bench", "results", "vlm_episode.json"), "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
