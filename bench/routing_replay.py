"""The cost of routing replay (``models.policy_trainer.routing_replay: rollout``) on the CPU.

On a random tiny Qwen3-MoE built here (``--layers`` decoder layers of ``--experts`` experts, top-``--top-k``,
hidden 128; or ``--model`` a folder), with the transformers rollout and the FSDP2 trainer (one rank, gloo):

* **bytes per token** of the ``routed_experts`` column (``chatlearn/models/moe/layout.py``: MoE layers x
  top-k x 1 byte below 255 experts, else 2), measured on the rollout's batch, and as declared for the MoE
  configurations people train (Qwen3-30B-A3B: 48 layers, 128 experts, top-8; Qwen3-235B-A22B: 94, 128, 8;
  Qwen2-57B-A14B: 28, 64, 8), beside the bytes of the batch's other per-token columns (token id int64,
  rollout log-prob float32);
* **capture**: the rollout's ``generate`` with routing replay on over off (same prompts and seed; the
  routers record each call's top-k, the batch carries the column);
* **replayed forward**: the trainer's log-prob pass and its training forward + backward (``compute_grads``)
  on the batch with the column over the same batch without it (the routers' own top-k);
* **what it buys**: a bfloat16 rollout against the float32 trainer (the usual split: the routers' near ties
  fall differently in the two precisions), the mean and largest |rollout log-prob - trainer log-prob| of the
  response tokens with replay off and on, and the routing agreement.

Times are medians of ``--repeats`` calls, on and off taken in turn (robust to a machine that is not idle),
as wall time and as the process's CPU time (``cpu_ratio``: the steadier of the two where other processes
share the cores); the results are ratios (on / off) with the medians beside them, and the machine's load
average when the row was measured. One row per ``--label`` in
``bench/results/routing_replay.json`` (replaced when rerun); no absolute path is written.

    .venv/bin/python bench/routing_replay.py [--label cpu] [--repeats 5] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "support"))

RESULTS = os.path.join(REPO, "bench", "results", "routing_replay.json")
# the configurations of MoE models people post-train (their config.json's MoE keys)
KNOWN = {
    "Qwen3-30B-A3B": {"num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48},
    "Qwen3-235B-A22B": {"num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 94},
    "Qwen2-57B-A14B": {"num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 28},
}
OTHER_TOKEN_BYTES = 8 + 4  # tokens (int64) and rollout_logprobs (float32) per token


def timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of ``fn()``."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def in_turn(off, on, repeats: int) -> dict:
    """Medians of ``repeats`` calls of ``off`` and ``on`` taken in turn (after one warm-up of each), wall time
    and the process's CPU time (less sensitive to other processes on a shared machine)."""
    off(), on()
    a, b = [], []
    for _ in range(repeats):
        a.append(timed(off))
        b.append(timed(on))
    med = {f"{name}_{kind}": statistics.median(x[i] for x in runs)
           for name, runs in (("off", a), ("on", b)) for i, kind in enumerate(("s", "cpu_s"))}
    return {**med, "ratio": med["on_s"] / med["off_s"], "cpu_ratio": med["on_cpu_s"] / med["off_cpu_s"]}


def precision_gap(path: str, prompts: list, sampling: dict, spec: dict, rng) -> dict:
    """A bfloat16 rollout's samples (routes recorded) through the float32 trainer, replay off and on: the
    rollout-vs-trainer log-prob gap over the response tokens, and the routing agreement."""
    import numpy as np

    import backend_specs
    from chatlearn.models.base import response_mask
    from chatlearn.models.rollout.hf import HFRollout
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    rollout = HFRollout(backend_specs.rollout_spec(path, routing_replay="rollout", dtype="bfloat16", **spec))
    batch = rollout.generate(prompts, sampling)
    del rollout
    batch["advantages"] = rng.normal(size=len(prompts)).astype(np.float32)
    mask = response_mask(batch)
    out = {}
    for replay in ("off", "rollout"):
        trainer = FSDPTrainer(backend_specs.trainer_spec(path, routing_replay=replay, train_micro_batch_size=8,
                                                         train_global_batch_size=len(prompts)))
        logp = trainer.compute_logprobs(batch)
        gap = np.abs(logp[mask] - batch["rollout_logprobs"][mask])
        metrics = trainer.compute_grads(dict(batch, old_logprobs=logp))
        out[f"replay_{replay}"] = {"gap_mean": float(gap.mean()), "gap_max": float(gap.max()),
                                   "routing_agreement": metrics.get("moe/routing_agreement")}
    return out


def join_process_group() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="cpu")
    ap.add_argument("--model", default=None, help="a Qwen3-MoE / Qwen2-MoE folder (default: a random one built here)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="4 prompts, 8 new tokens, 2 repeats")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.repeats = 4, 8, 2

    import numpy as np
    import torch

    import backend_specs
    from chatlearn.models.moe import layout
    from chatlearn.models.rollout.hf import HFRollout
    from chatlearn.models.trainer.fsdp import FSDPTrainer
    from tiny_moe import make_tiny_moe

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    tmp = tempfile.mkdtemp(prefix="routing_replay_")
    path = args.model or make_tiny_moe(os.path.join(tmp, "moe"), seed=0, layers=args.layers, experts=args.experts,
                                       top_k=args.top_k)
    lay = layout.layout_of_folder(path)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 300, int(n))) for n in rng.integers(8, 24, args.prompts)]
    sampling = {"temperature": 1.0, "max_tokens": args.new_tokens, "seed": 7}
    spec = dict(generation_batch_size=args.prompts, max_prompt_tokens_length=32, max_response_tokens_length=64)
    plain = HFRollout(backend_specs.rollout_spec(path, **spec))
    capture = HFRollout(backend_specs.rollout_spec(path, routing_replay="rollout", **spec))
    batch = capture.generate(prompts, sampling)
    col = batch["routed_experts"]
    tokens = len(batch["tokens"])
    row = {"label": args.label, "commit": subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                                         capture_output=True, text=True).stdout.strip(),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
           "model": {"layers": lay.layers, "experts": lay.num_experts, "top_k": lay.top_k,
                     "source": "given folder" if args.model else "random tiny Qwen3-MoE (tests/support/tiny_moe.py)"},
           "prompts": args.prompts, "max_new_tokens": args.new_tokens, "repeats": args.repeats,
           "batch_tokens": tokens, "load_average_1min_at_start": os.getloadavg()[0]}
    row["bytes_per_token"] = {"measured": col.nbytes / tokens, "declared": lay.bytes_per_token(),
                              "dtype": str(col.dtype),
                              "vs_tokens_and_logprobs": col.nbytes / tokens / OTHER_TOKEN_BYTES}
    row["bytes_per_token_known_models"] = {
        name: {"bytes": layout.layout_of_config(c).bytes_per_token(),
               "vs_tokens_and_logprobs": layout.layout_of_config(c).bytes_per_token() / OTHER_TOKEN_BYTES}
        for name, c in KNOWN.items()}
    row["capture"] = in_turn(lambda: plain.generate(prompts, sampling), lambda: capture.generate(prompts, sampling),
                             args.repeats)
    del plain, capture

    join_process_group()
    batch["advantages"] = rng.normal(size=len(prompts)).astype(np.float32)
    without = {k: v for k, v in batch.items() if k != "routed_experts"}
    trainer = FSDPTrainer(backend_specs.trainer_spec(path, routing_replay="rollout", logprob_micro_batch_size=8,
                                                     train_micro_batch_size=8, train_global_batch_size=len(prompts),
                                                     max_response_tokens_length=args.new_tokens))
    logp = trainer.compute_logprobs(without)
    row["replayed_logprob_pass"] = in_turn(lambda: trainer.compute_logprobs(without),
                                           lambda: trainer.compute_logprobs(batch), args.repeats)

    def grads(b):
        trainer.compute_grads(dict(b, old_logprobs=logp))
        trainer.zero_grad()

    row["replayed_training_forward_backward"] = in_turn(lambda: grads(without), lambda: grads(batch), args.repeats)
    trainer.compute_grads(dict(batch, old_logprobs=logp))
    row["routing_agreement"] = trainer.compute_grads(dict(batch, old_logprobs=logp))["moe/routing_agreement"]
    row["gap_bf16_rollout_vs_fp32_trainer"] = precision_gap(path, prompts, sampling, spec, rng)

    rows = []
    if os.path.exists(RESULTS):
        with open(RESULTS, encoding="utf-8") as f:
            rows = [r for r in json.load(f)["rows"] if r["label"] != args.label]
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as f:
        json.dump({"rows": rows + [row]}, f, indent=2)
        f.write("\n")
    print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
