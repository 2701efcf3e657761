"""Weight-push benchmark: seconds and GB/s of ``WeightPush.push`` next to a plain memory copy.

For the embedded model (assets/tiny_qwen2) and a random Qwen2 of about 110M parameters (written
to /tmp), with the trainer (FSDP, ``--ranks`` ranks) and one rollout replica as Ray actors on
this machine, every push goes through each CPU transport (``shm``: shared memory, as for
colocated models; ``broadcast``: gloo broadcast, as for disaggregated ones) into each rollout
backend (hf, vllm). Reported: the median over ``--pushes`` pushes (after one warm-up push) of
the seconds and GB/s (1e9 bytes), and the bandwidth of a plain in-process copy of the same
number of bytes (``numpy.copyto`` between two pre-touched buffers, median of 5) with the ratio.

    .venv/bin/python bench/weight_push.py [--pushes 3] [--ranks 1] [--backends hf,vllm]

Prints a markdown table and writes bench/results/weight_push.json. On a shared machine the
numbers are noisy; the push also includes the engine's own load (vLLM's in-place reload
re-runs its CPU weight repacking), which a plain copy does not.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))
from grpo_compare import portable_paths  # noqa: E402


def make_model(path: str) -> str:
    """A random-init fp32 Qwen2 (hidden 768, 14 layers, GQA 12/4 heads, tied embeddings)."""
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    config = Qwen2Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=14,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=True, dtype="float32")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    for name in os.listdir(os.path.join(REPO, "assets", "tiny_qwen2")):  # a tokenizer for vLLM
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(REPO, "assets", "tiny_qwen2", name), path)
    return path


def plain_copy_gbps(nbytes: int, repeats: int = 5) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def specs(path: str) -> tuple:
    """A frozen FSDP trainer (it only exports its weights) and a rollout replica of ``path``, one CPU
    thread each."""
    from bench_specs import backend_specs

    trainer, rollout = backend_specs(path, "models.policy.generation_batch_size=4")
    return trainer.replace(trainable=False), rollout.replace(cpu_threads=1)


def bench_model(label: str, path: str, args, cfg) -> list[dict]:
    import ray

    from chatlearn.runtime.cluster.group import create_group
    from chatlearn.runtime.weight_push.driver import WeightPush

    common = dict(pg=None, bundles=[], gpu_fraction=0, cpus=0, threads=1)
    trainer_spec, rollout_spec = specs(path)
    trainer = create_group("policy_trainer", "chatlearn.models.trainer.fsdp:FSDPTrainer", trainer_spec,
                           num_actors=args.ranks, distributed=True, **common)
    rows = []
    for backend in args.backends.split(","):
        factory = {"hf": "chatlearn.models.rollout.hf:HFRollout",
                   "vllm": "chatlearn.models.rollout.vllm:VLLMRollout"}[backend]
        rollout = create_group("policy", factory, rollout_spec, num_actors=1, distributed=False, **common)
        for transport in ("shm", "broadcast"):
            sync = WeightPush(trainer, rollout, plan=None, cfg=cfg, transport=transport)
            sync.push()  # set-up and warm-up (first touch of the buffers)
            times, nbytes = [], 0
            for _ in range(args.pushes):
                start = time.perf_counter()
                out = sync.push()
                times.append(time.perf_counter() - start)
                nbytes = int(out["sync/bytes"])
            seconds = statistics.median(times)
            copy = plain_copy_gbps(nbytes)
            rows.append({"model": label, "params": nbytes // 4, "backend": backend, "transport": transport,
                         "buckets": len(sync.buckets), "bytes": nbytes, "seconds": seconds,
                         "all_seconds": times, "push_gbps": nbytes / seconds / 1e9, "copy_gbps": copy,
                         "ratio": nbytes / seconds / 1e9 / copy})
            print(f"  {label} {backend} {transport}: {seconds:.3f}s {rows[-1]['push_gbps']:.2f} GB/s "
                  f"(plain copy {copy:.2f} GB/s)", flush=True)
        for actor in rollout.actors:
            ray.kill(actor)
    for actor in trainer.actors:
        ray.kill(actor)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1, help="FSDP trainer ranks")
    parser.add_argument("--backends", default="hf,vllm")
    parser.add_argument("--bucket-mb", type=float, default=100.0)
    parser.add_argument("--big-model", default="/tmp/chatlearn_bench_qwen2_110m")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"runtime_args": {"coalesced_buffer_mb": args.bucket_mb}})
    models = [("tiny_qwen2", os.path.join(REPO, "assets", "tiny_qwen2")), ("qwen2-110M", make_model(args.big_model))]
    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    rows = []
    try:
        for label, path in models:
            rows += bench_model(label, path, args, cfg)
    finally:
        ray.shutdown()
    print("\n| model | params | backend | transport | buckets | MB | push s (median) | push GB/s | plain copy GB/s | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['backend']} | {r['transport']} | {r['buckets']} | "
              f"{r['bytes'] / 1e6:.1f} | {r['seconds']:.3f} | {r['push_gbps']:.2f} | {r['copy_gbps']:.2f} | "
              f"{r['ratio']:.2f} |")
    os.makedirs(os.path.join(REPO, "bench", "results"), exist_ok=True)
    out = os.path.join(REPO, "bench", "results", "weight_push.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(portable_paths({"args": vars(args), "cpus": os.cpu_count(), "rows": rows},
                                 {"tmp": tempfile.gettempdir()}), f, indent=2)
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
