"""The transformers rollout's decoding loop on the CPU, with what predicts its cost on a GPU.

On a CUDA device a decoding step is cheap for the GPU and what limits it is the host: every read of
a device value (``bool(t)``, ``.item()``, ``nonzero``, a boolean index) waits for the queued kernels
and leaves the GPU idle until the next ones are launched, and every row that leaves the batch used
to copy the whole KV cache. Neither cost shows in CPU time, so this benchmark measures them on the
CPU directly, on the long workload of ``bench/grpo_vs_trl.py`` (the 38M random Qwen2, 4 prompts x 8,
up to 256 new tokens, all 32 rows decoded together):

* **host syncs per decoding step**: ops that need a device value on the host, counted by a
  ``TorchDispatchMode`` around ``generate`` (``_local_scalar_dense``, which ``bool``/``item`` call;
  ``nonzero``; ``masked_select``; ``unique``; boolean indexing), divided by the decoding forward
  passes (the model's forward calls minus one prefill per chunk);
* **KV-cache bytes copied**: bytes the cache layers copy out of their buffers (row compaction and
  growth, counted by wrapping ``ReservedLayer._reserve`` and ``move_rows``), per generated token and as a ratio to the
  KV cache's final size summed over the sequences (prompt + response tokens x bytes per token);
* **CPU speed**: generated tokens per second, median of ``--repeats`` timed calls after one warm-up,
  every call with the same seed (the same samples).

The engine reads which rows still run every step on the CPU (free there) and every 16 steps on a
GPU (``chatlearn.models.rollout.hf.CHECK_EVERY``): each row measures both read policies on the CPU,
the GPU's for its syncs and copies, the CPU's for the speed. Goals (the rollout on CUDA): at most
0.1 syncs per step and copies at most 2x the final KV cache under the GPU's policy, CPU tokens/s
not lower than before. ``--label`` names the row (e.g. ``before``, measured on the previous code
with this script copied there); rows accumulate in ``bench/results/hf_decode.json`` (one per
label, replaced when rerun). ``--prompts 32 --group 1``: 32 different prompts (left padding, so
every step has an attention mask) instead of 4 x 8. ``--against REV``: the speed side by side with
the engine of git revision REV in the same process, called in turn with the same seeds (robust to
a machine that is not idle; the row's ``speed_ratio`` is this / REV).

    .venv/bin/python bench/hf_decode.py [--label after] [--repeats 3] [--prompts 4 --group 8] [--against REV] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

import grpo_compare as gc  # noqa: E402

SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "repeat_interleave")


def sync_counter():
    """A dispatch mode that counts the ops which, on a CUDA device, wait for the device."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class SyncCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count, self.by_op = 0, {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            hit = name in SYNC_OPS
            if name == "index" and len(args) > 1:  # a boolean mask as an index: data-dependent shape
                hit = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
            if hit:
                self.count += 1
                self.by_op[name] = self.by_op.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    return SyncCounter()


class CopyMeter:
    """Bytes the cache layers copy from their buffers: ``ReservedLayer._reserve`` (growth, and the
    compaction of older versions) and ``ReservedLayer.move_rows`` (compaction) wrapped: the places
    the layer moves cached positions."""

    def __init__(self):
        from chatlearn.models.rollout.hf import _reserved_layer_class

        self.cls = _reserved_layer_class()
        self.bytes = 0
        self.calls = 0
        self._orig = self.cls._reserve

    def __enter__(self):
        meter, orig = self, self._orig

        def reserve(layer, like, capacity, rows=None):
            if layer._k is not None and layer.length:
                b = layer._k.shape[0] if rows is None else len(rows)
                per_row = layer._k[0, :, :layer.length].numel() * layer._k.element_size()
                meter.bytes += 2 * b * per_row  # keys and values
                meter.calls += 1
            return orig(layer, like, capacity, rows)

        self.cls._reserve = reserve
        self._orig_move = getattr(self.cls, "move_rows", None)
        if self._orig_move is not None:
            orig_move = self._orig_move

            def move_rows(layer, dst, src, rows):
                if layer.length and len(dst):
                    per_row = layer._k[0, :, :layer.length].numel() * layer._k.element_size()
                    meter.bytes += 2 * len(dst) * per_row
                    meter.calls += 1
                return orig_move(layer, dst, src, rows)

            self.cls.move_rows = move_rows
        return self

    def __exit__(self, *exc):
        self.cls._reserve = self._orig
        if self._orig_move is not None:
            self.cls.move_rows = self._orig_move


def workload_prompts(model: str, prompts: int, group: int) -> list[list[int]]:
    """The first ``prompts`` prompts of the arithmetic data (chat template applied), ``group`` times each."""
    from chatlearn.data.dataset import load_prompts, load_tokenizer

    tok = load_tokenizer(model, trust_remote_code=False, key="models.policy.load")
    data = load_prompts([gc.ARITH_TRAIN], tok, max_prompt_tokens=64, enable_thinking=False,
                        prompt_key="prompt", ground_truth_key=None)
    return [list(data.prompt_ids[i]) for i in range(prompts) for _ in range(group)]


def workload(args):
    """``(model folder, RolloutSpec, prompts)`` of the benchmark's workload, torch threads set."""
    import torch

    from bench_specs import backend_specs
    from grpo_vs_trl import model_dir

    torch.set_num_threads(os.cpu_count() or 1)
    model = model_dir(gc.LONG_SPEC, args.cache)
    # validated with the embedded model (256 positions), then given this model's response budget
    _, spec = backend_specs(model, "models.policy.max_prompt_tokens_length=64",
                            "models.policy.max_response_tokens_length=128",
                            f"models.policy.generation_batch_size={args.prompts * args.group}")
    return model, spec.replace(max_response_tokens_length=args.max_new), workload_prompts(model, args.prompts,
                                                                                          args.group)


def measure(args) -> dict:
    from chatlearn.models.rollout.hf import HFRollout

    model, spec, prompts = workload(args)
    engine = HFRollout(spec)
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": args.max_new, "seed": 1234}

    row = {"label": args.label, "commit": _commit(), "prompts": args.prompts, "group": args.group,
           "rows": len(prompts), "max_new_tokens": args.max_new}
    policies = {"default": None}
    if hasattr(engine, "read_every"):  # the GPU's read policy, run on the CPU for its counts
        from chatlearn.models.rollout.hf import CHECK_EVERY

        policies = {f"cpu (read every {engine.read_every})": engine.read_every,
                    f"cuda (read every {CHECK_EVERY['cuda']})": CHECK_EVERY["cuda"]}
    row["policies"] = {}
    for name, every in policies.items():
        if every is not None:
            engine.read_every = every
        row["policies"][name] = _one_policy(engine, prompts, sampling, model, args.repeats)
    first = next(iter(row["policies"].values()))
    row["tokens_per_s"] = first["tokens_per_s"]  # the engine as it runs on this device
    return row


def _one_policy(engine, prompts, sampling, model, repeats) -> dict:
    """Speed (median of ``repeats`` timed calls after a warm-up), then host syncs and KV copies of
    one more call (same seed, same samples) for ``engine`` as it is set."""
    from chatlearn.models.rollout.kv_cache import bytes_per_token, text_config

    engine.generate(prompts, sampling)  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        batch = engine.generate(prompts, sampling)
        seconds.append(time.perf_counter() - start)
    timed_lengths = _response_lengths(batch)
    forwards = []
    handle = engine.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    counter = sync_counter()
    try:
        with CopyMeter() as meter, counter:
            counted = engine.generate(prompts, sampling)
    finally:
        handle.remove()
    chunks = -(-len(prompts) // engine.batch_size)
    steps = len(forwards) - chunks  # one prefill forward per chunk
    lengths = _response_lengths(counted)
    per_token = bytes_per_token(text_config(model), "float32")
    final_kv = sum((len(p) + n) * per_token for p, n in zip(prompts, lengths))
    generated = int(sum(lengths))
    med = statistics.median(seconds)
    return {"generated_tokens": generated, "mean_response_tokens": generated / len(prompts),
            "same_samples_as_timed": timed_lengths == lengths,
            "seconds": med, "all_seconds": seconds, "tokens_per_s": generated / med,
            "decode_steps": steps, "host_syncs": counter.count, "host_syncs_by_op": counter.by_op,
            "syncs_per_step": counter.count / max(steps, 1),
            "kv_copies": meter.calls, "kv_bytes_copied": meter.bytes,
            "kv_bytes_copied_per_generated_token": meter.bytes / max(generated, 1),
            "kv_final_bytes": final_kv, "kv_copy_ratio": meter.bytes / final_kv}


def interleaved(args) -> dict:
    """The engine of revision ``args.against`` (its ``chatlearn/models/rollout/hf.py``, loaded from
    git beside this one) and this one, called in turn ``args.repeats`` x 2 times with a new seed each
    round (both engines get the same seeds; the order alternates): total generated tokens over total
    seconds for each, and their ratio. A busy machine slows both alike."""
    import importlib.util
    import tempfile

    from chatlearn.models.rollout import hf

    source = subprocess.run(["git", "-C", REPO, "show", f"{args.against}:chatlearn/models/rollout/hf.py"],
                            capture_output=True, text=True, check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec_ = importlib.util.spec_from_file_location("hf_against", f.name)
    old = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(old)
    os.unlink(f.name)
    _, spec, prompts = workload(args)
    engines = {args.against: old.HFRollout(spec), "this": hf.HFRollout(spec)}
    done = {k: [0, 0.0] for k in engines}
    for name, e in engines.items():  # warm-up
        e.generate(prompts, {"temperature": 1.0, "max_tokens": args.max_new, "seed": 1})
    for r in range(2 * args.repeats):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            start = time.perf_counter()
            batch = engines[name].generate(prompts, {"temperature": 1.0, "max_tokens": args.max_new, "seed": 100 + r})
            done[name][1] += time.perf_counter() - start
            done[name][0] += sum(_response_lengths(batch))
    rates = {k: tokens / seconds for k, (tokens, seconds) in done.items()}
    return {"label": f"interleaved vs {args.against}", "commit": _commit(), "prompts": args.prompts,
            "group": args.group, "rows": len(prompts), "max_new_tokens": args.max_new, "calls_each": 2 * args.repeats,
            "tokens_per_s": rates, "generated_tokens": {k: v[0] for k, v in done.items()},
            "speed_ratio": rates["this"] / rates[args.against]}


def _response_lengths(batch) -> list[int]:
    """Generated tokens per sample of a rollout batch (``chatlearn.batch``: offsets, prompt_lens)."""
    import numpy as np

    return (np.diff(batch["offsets"]) - batch["prompt_lens"]).astype(int).tolist()


def _commit() -> str:
    """The commit measured, ``+changes`` when the package's files differ from it."""
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "chatlearn"], capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="one timed call, 64 new tokens (a smoke test)")
    parser.add_argument("--against", default=None,
                        help="a git revision: its engine and this one in turn, in one process (the CPU speed ratio)")
    parser.add_argument("--results", default=os.path.join(REPO, "bench", "results"))
    parser.add_argument("--cache", default=os.path.join("/tmp", "chatlearn_bench"))
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.max_new = 1, 64
    row = interleaved(args) if args.against else measure(args)
    print(json.dumps(row, indent=2))
    if args.quick:
        return
    path = os.path.join(args.results, "hf_decode.json")
    doc = {"rows": []}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    doc.update({"workload": "long: 38M random Qwen2 (bench/grpo_compare.py LONG_SPEC), the first `prompts` "
                            "prompts of the arithmetic data x `group`, up to 256 new tokens, temperature 1, "
                            "float32, all rows in one batch",
                "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                "goals": {"syncs_per_step": "<= 0.1", "kv_copy_ratio": "<= 2.0",
                          "tokens_per_s": ">= the 'before' row"}})
    key = ("label", "prompts", "group")
    doc["rows"] = [r for r in doc["rows"] if any(r[k] != row[k] for k in key)] + [row]
    os.makedirs(args.results, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.relpath(path, REPO)}")


if __name__ == "__main__":
    main()
