"""Peak memory of the offline merge (``chatlearn merge``) next to the model size.

Builds a random Qwen2 model from a config (about 153M parameters by default, no download),
trains it one step with FSDPTrainer on 2 ranks (so the checkpoint holds the Adam state the
merge must skip) and saves a 2-rank checkpoint, then runs the merge in a subprocess that
reports its own peak RSS (``VmHWM`` of /proc/self/status: ``ru_maxrss`` would also count the
parent's memory at fork time, which Linux carries across exec) and its RSS after imports.
For comparison, another subprocess loads every model tensor at once (what a merge that
materialises the whole model needs).

    .venv/bin/python bench/merge_memory.py [--layers 12] [--hidden 768] [--vocab 32000]
        [--dtype float32|bfloat16] [--max-shard-size 5GB] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def make_model(path: str, args) -> dict:
    """A random fp32 Qwen2 folder at ``path``; returns its parameter count and sizes."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 192),
        intermediate_size=4 * args.hidden, max_position_embeddings=2048,
        tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    sizes = [p.numel() * 4 for p in model.parameters()]
    return {"params": sum(p.numel() for p in model.parameters()),
            "model_mb": sum(sizes) / 1e6, "largest_tensor_mb": max(sizes) / 1e6}


def _rank(rank: int, world: int, port: int, model: str, ckpt: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import numpy as np
    import torch
    import torch.distributed as dist

    from bench_specs import backend_specs
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    torch.set_num_threads(1)
    spec, _ = backend_specs(model, "models.policy_trainer.optimizer.lr=1e-5", "models.policy_trainer.share_prompt=false")
    trainer = FSDPTrainer(spec)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 1000, 16).astype(np.int64),
             "offsets": np.array([0, 8, 16], np.int64), "prompt_lens": np.array([4, 4], np.int64),
             "advantages": np.array([1.0, -1.0], np.float32)}
    batch["old_logprobs"] = trainer.compute_logprobs(batch)
    trainer.train(batch)
    t0 = time.monotonic()
    trainer.save_checkpoint(ckpt)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"save_s": time.monotonic() - t0}, f)
    dist.destroy_process_group()


def save_checkpoint(model: str, ckpt: str, workdir: str) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(workdir, "save.json")
    mp.start_processes(_rank, args=(2, port, model, ckpt, out), nprocs=2, start_method="spawn")
    with open(out) as f:
        return json.load(f)


# Runs in a fresh interpreter: imports, then the merge; prints the RSS numbers as JSON.
_PEAK = """
def peak_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
"""

_MERGE = _PEAK + """
import json, sys, time
import torch, transformers
from chatlearn.checkpoint.merge import merge_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM  # what the merge imports
base = peak_kb()
t0 = time.monotonic()
out = merge_checkpoint(sys.argv[1], sys.argv[2], dtype=sys.argv[3], max_shard_size=sys.argv[4])
print(json.dumps({"seconds": time.monotonic() - t0, "shards": len(out["shards"]),
                  "written_mb": out["total_bytes"] / 1e6, "base_kb": base,
                  "peak_kb": peak_kb()}))
"""

# For comparison: every model tensor of the checkpoint loaded at once.
_FULL = _PEAK + """
import json, sys, time, warnings
import torch, transformers
import torch.distributed.checkpoint as dcp
from chatlearn.checkpoint import sharded
base = peak_kb()
md = sharded.read_dcp_metadata(sys.argv[1])
state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
         for k, m in md.state_dict_metadata.items() if k.startswith("model.")}
warnings.simplefilter("ignore")
t0 = time.monotonic()
dcp.load(state, storage_reader=sharded.SafeFileSystemReader(sys.argv[1]),
         planner=sharded.SafeLoadPlanner(), no_dist=True)
print(json.dumps({"seconds": time.monotonic() - t0, "base_kb": base, "peak_kb": peak_kb()}))
"""


def run_child(code: str, *argv: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env=env, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"child failed ({proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--workdir", help="where to build (default: a temporary folder)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        model, ckpt = os.path.join(work, "model"), os.path.join(work, "ckpt")
        t0 = time.monotonic()
        info = make_model(model, args)
        info["build_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        info.update(save_checkpoint(model, ckpt, work))
        info["train_and_save_s"] = time.monotonic() - t0
        info["checkpoint_mb"] = sum(
            os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs) / 1e6
        merge = run_child(_MERGE, ckpt, os.path.join(work, "hf"), args.dtype, args.max_shard_size)
        full = run_child(_FULL, ckpt)

    mb = 1024 / 1e6  # /proc reports KiB
    rows = [
        ("parameters", f"{info['params'] / 1e6:.1f} M"),
        ("model size (fp32)", f"{info['model_mb']:.0f} MB"),
        ("largest tensor (fp32)", f"{info['largest_tensor_mb']:.0f} MB"),
        ("checkpoint on disk (2 ranks, with Adam)", f"{info['checkpoint_mb']:.0f} MB"),
        ("save_checkpoint (2 ranks)", f"{info['save_s']:.1f} s"),
        (f"merge: written ({args.dtype}, {merge['shards']} shard(s))",
         f"{merge['written_mb']:.0f} MB in {merge['seconds']:.1f} s"),
        ("merge: RSS after imports", f"{merge['base_kb'] * mb:.0f} MB"),
        ("merge: peak RSS", f"{merge['peak_kb'] * mb:.0f} MB"),
        ("merge: peak - after imports", f"{(merge['peak_kb'] - merge['base_kb']) * mb:.0f} MB"),
        ("whole-model load: peak - after imports",
         f"{(full['peak_kb'] - full['base_kb']) * mb:.0f} MB"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(json.dumps({"model": info, "merge": merge, "whole_model_load": full}))


if __name__ == "__main__":
    main()
