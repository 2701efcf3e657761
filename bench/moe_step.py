"""MoE step benchmark: the MoE toy against a dense model of the same active parameter count.

The MoE model is the embedded toy (``assets/tiny_qwen3_moe``: Qwen3-MoE, 4 layers, 8 experts of
intermediate size 64, top-2). The dense model is a random Qwen3 of the same attention, embeddings and
depth whose MLP has intermediate size 2 x 64 = 128, so that a token goes through as many MLP weights
as through the MoE's two experts (active parameters: the MoE's 439,680 with its routers, the dense
model's 435,584). Both in fp32 on the CPU, one trainer rank, through ChatLearn's own backends built
from the template's config (``bench/bench_specs.py``):

* training step: ``FSDPTrainer.train`` on a GRPO batch of ``--samples`` samples (prompts of 25 tokens,
  responses of 5 to 8), at two ``train_micro_batch_size`` values; the MoE with the router's aux loss at
  its config's coefficient, with its experts as one grouped GEMM (``groupgemm: true``) and as a loop
  of one matmul per expert (``false``);
* rollout: ``HFRollout.generate`` of ``--samples`` samples (the arith eval prompts, up to 16 new tokens,
  temperature 1, the same seed) at two ``generation_batch_size`` values; reported per generated token too
  (the two models stop at different lengths).

The median over ``--repeats`` timed runs after one warm-up; ratios are MoE / dense. Usage::

    .venv/bin/python bench/moe_step.py [--samples 128] [--repeats 3] [--threads 1]

Prints a markdown table and writes ``bench/results/moe_step.json`` (no absolute paths). On a shared
machine the numbers are noisy: compare the ratios, measured in one process one after another.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))
MOE = os.path.join(REPO, "assets", "tiny_qwen3_moe")


def make_dense(path: str) -> str:
    """A random Qwen3 with the MoE toy's shape and a dense MLP of 2 x its expert size."""
    import torch
    from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

    moe = AutoConfig.from_pretrained(MOE)
    config = Qwen3Config(vocab_size=moe.vocab_size, hidden_size=moe.hidden_size,
                         intermediate_size=moe.num_experts_per_tok * moe.moe_intermediate_size,
                         num_hidden_layers=moe.num_hidden_layers, num_attention_heads=moe.num_attention_heads,
                         num_key_value_heads=moe.num_key_value_heads, head_dim=moe.head_dim,
                         max_position_embeddings=moe.max_position_embeddings, rope_parameters=moe.rope_parameters,
                         rms_norm_eps=moe.rms_norm_eps, tie_word_embeddings=True, eos_token_id=moe.eos_token_id,
                         pad_token_id=moe.pad_token_id, bos_token_id=None, dtype="float32")
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).float().save_pretrained(path)
    for name in os.listdir(MOE):
        if name.startswith("tokenizer") or name.endswith(".jinja") or name == "generation_config.json":
            shutil.copy(os.path.join(MOE, name), path)
    return path


def active_params(path: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    k, e = getattr(model.config, "num_experts_per_tok", 1), getattr(model.config, "num_experts", 1)
    return {"total": total, "active": int(total - experts + experts * k / e)}


def grpo_batch(samples: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    plen = np.full(samples, 25)
    rlen = rng.integers(5, 9, samples)
    off = np.zeros(samples + 1, np.int64)
    np.cumsum(plen + rlen, out=off[1:])
    return {"tokens": rng.integers(3, 300, int(off[-1])).astype(np.int64), "offsets": off,
            "prompt_lens": plen.astype(np.int64), "advantages": rng.normal(size=samples).astype(np.float32)}


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def prompts(samples: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MOE)
    with open(os.path.join(REPO, "assets", "arith", "eval.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f][:samples]
    return [list(tok.apply_chat_template(r["prompt"], tokenize=True, add_generation_prompt=True, return_dict=False))
            for r in records]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--micro", default="8,64", help="two micro-batch sizes (train and generation)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "moe_step.json"))
    args = p.parse_args(argv)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), HF_HUB_OFFLINE="1")
    import torch

    from bench_specs import backend_specs
    from chatlearn.models.rollout.hf import HFRollout
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    torch.set_num_threads(args.threads)
    micro = [int(m) for m in args.micro.split(",")]
    tmp = tempfile.mkdtemp(prefix="moe_step_")
    dense = make_dense(os.path.join(tmp, "dense"))
    models = {"moe": MOE, "dense": dense}
    params = {name: active_params(path) for name, path in models.items()}
    batch = grpo_batch(args.samples)
    ps = prompts(args.samples)
    rows = []
    for size in micro:
        for name, path, groupgemm in (("dense", dense, False), ("moe", MOE, True), ("moe", MOE, False)):
            trainer_spec, rollout_spec = backend_specs(path, f"models.policy_trainer.train_micro_batch_size={size}")
            trainer_spec = trainer_spec.replace(moe=trainer_spec.moe.replace(groupgemm=groupgemm))
            trainer = FSDPTrainer(trainer_spec)
            step, step_all = timed(lambda: trainer.train(batch), args.repeats)
            del trainer
            row = {"model": name, "groupgemm": groupgemm if name == "moe" else None, "micro_batch": size,
                   "train_step_s": step, "train_step_all_s": step_all}
            if not (name == "moe" and not groupgemm):  # the hf rollout uses transformers' default experts
                rollout = HFRollout(rollout_spec.replace(generation_batch_size=size))
                out = {}

                def generate():
                    out["batch"] = rollout.generate(ps, {"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                                         "max_tokens": 16, "seed": 1})
                gen, gen_all = timed(generate, args.repeats)
                b = out["batch"]
                tokens = int(sum(len(b["tokens"][b["offsets"][i] + b["prompt_lens"][i]:b["offsets"][i + 1]])
                                 for i in range(len(b["prompt_lens"]))))
                row.update(rollout_s=gen, rollout_all_s=gen_all, generated_tokens=tokens,
                           rollout_s_per_1k_tokens=1000 * gen / max(tokens, 1))
                del rollout
            rows.append(row)
            print(json.dumps(row), flush=True)
    ratios = []
    for size in micro:
        d = next(r for r in rows if r["model"] == "dense" and r["micro_batch"] == size)
        for r in rows:
            if r["model"] == "moe" and r["micro_batch"] == size:
                entry = {"micro_batch": size, "groupgemm": r["groupgemm"],
                         "train_step": r["train_step_s"] / d["train_step_s"]}
                if "rollout_s" in r:
                    entry["rollout"] = r["rollout_s"] / d["rollout_s"]
                    entry["rollout_per_token"] = r["rollout_s_per_1k_tokens"] / d["rollout_s_per_1k_tokens"]
                ratios.append(entry)
    result = {"samples": args.samples, "repeats": args.repeats, "threads": args.threads,
              "models": {"moe": "assets/tiny_qwen3_moe", "dense": "random Qwen3, MLP 128 (generated)"},
              "params": params, "rows": rows, "ratios_moe_over_dense": ratios,
              "torch": torch.__version__}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print("\n| micro-batch | groupgemm | train step MoE/dense | rollout MoE/dense | rollout per token MoE/dense |")
    print("|---|---|---|---|---|")
    for e in ratios:
        print(f"| {e['micro_batch']} | {e['groupgemm']} | {e['train_step']:.2f} | "
              f"{e.get('rollout', float('nan')):.2f} | {e.get('rollout_per_token', float('nan')):.2f} |")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
