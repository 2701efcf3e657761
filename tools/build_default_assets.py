#!/usr/bin/env python
"""Build ChatLearn's embedded default model and data set.

Writes, under ``--out`` (default ``assets/``):

* ``arith/train.jsonl`` and ``arith/eval.jsonl``: the task ``a + b`` with ``a, b`` in
  0..99, in ChatLearn's data format. The eval split holds 200 pairs that never occur in
  the training split.
* ``tiny_qwen2/``: a complete local Hugging Face model folder (``Qwen2ForCausalLM``,
  about 1M parameters, fp32) with a byte-level BPE tokenizer trained on the task's text
  and a ChatML chat template. Transformers and vLLM load it with ``HF_HUB_OFFLINE=1``.
  Its weights come from a short supervised warm start on the training split, stopped
  once greedy accuracy on held-out training examples reaches ``--target-accuracy``, so
  the model reliably answers in the form ``\\boxed{N}<|im_end|>`` but gets the sum
  right only some of the time: a starting point where GRPO has something to learn.
* ``arith_sft/train.jsonl`` and ``arith_sft/eval.jsonl``: the same splits as conversations for
  ``chatlearn sft`` (``messages``: the question, then the answer in the toy's format
  ``\\boxed{N}``), with the ground truth (``reward_model``): also the prompts with reference responses of
  ``algorithm: gkd`` with ``gkd_lambda`` < 1; ``--sft-data`` writes them alone from an existing ``arith/``.
* ``README.md``: what is in the folder and the numbers measured at build time.

With ``--model tiny_qwen3_moe`` it builds, instead, the mixture-of-experts toy
``tiny_qwen3_moe/`` (``Qwen3MoeForCausalLM``: the same tokenizer, chat template and task,
every layer sparse, 8 experts with top-2 routing) the same way (a supervised warm start on
the same split, with the router's load-balancing loss at the config's coefficient, stopped at
the same target), and its own README section. It reads nothing of ``tiny_qwen2/`` and writes
nothing else, so the dense model's bytes do not change.

Everything is seeded, so running the script twice on the same machine and software
gives byte-identical files. Usage, from the repository root::

    python tools/build_default_assets.py [--out assets] [--check-vllm]
    python tools/build_default_assets.py --model tiny_qwen3_moe [--out assets] [--check-vllm]

``--check-vllm`` also loads the model with vLLM (the CPU build works) and reports its
accuracy on the eval prompts; ``--check-only`` runs the checks on an existing folder
without rebuilding it. The script ends with a report: vocabulary size, parameter count,
warm-start steps and time, and eval accuracy (greedy and sampled at the eval settings)
with the share of responses that end with ``<|im_end|>``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

# Offline by construction: nothing here needs the model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from chatlearn.models.reward.math_reward import last_boxed  # noqa: E402  (the reward's own parser)

# --------------------------------------------------------------------------------------
# Task definition
# --------------------------------------------------------------------------------------

DATA_SOURCE = "arith"
MAX_OPERAND = 99
NUM_EVAL = 200
PROMPT_TEMPLATE = "What is {a} + {b}? Put the final answer in \\boxed{{}}."
RESPONSE_TEMPLATE = "\\boxed{{{answer}}}"

# Special tokens, Qwen2 style.
ENDOFTEXT = "<|endoftext|>"  # padding
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a turn: the eos token for generation
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# ChatML, as used by Qwen2 (without a default system prompt, to keep prompts short).
# Extra keyword arguments such as ``enable_thinking`` are accepted and ignored.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Qwen2's pre-tokenizer pattern: words, single digits (``\p{N}`` without ``{1,3}``),
# punctuation runs, and whitespace.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TOKENIZER_VOCAB_SIZE = 320  # upper bound; the task's text saturates a little below it
VOCAB_MULTIPLE = 64  # the model's embedding table is rounded up to a multiple of this

# Model shape. vLLM's CPU attention needs head_dim >= 32 (128 / 4 heads = 32).
MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

# The mixture-of-experts toy (``--model tiny_qwen3_moe``): attention as the dense model's, every
# layer a sparse MoE block of 8 experts, top-2 routing. Its total parameter count is about the
# dense model's (the same file size); each token goes through 2 of the 8 experts.
MOE_SHAPE = dict(
    hidden_size=128,
    intermediate_size=512,  # unused: no dense MLP layer (mlp_only_layers empty, decoder_sparse_step 1)
    moe_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=0.01,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
MODELS = {"tiny_qwen2": "Qwen2ForCausalLM", "tiny_qwen3_moe": "Qwen3MoeForCausalLM",
          "tiny_qwen2_teacher": "Qwen2ForCausalLM", "tiny_qwen2_vl": "Qwen2VLForConditionalGeneration"}
# --target-accuracy's default per model: the text student toys start weak; the distillation teacher is trained
# on until it is strong; the vision-language toy's target is the share of prompts whose digits it names right
TARGET_ACCURACY = {"tiny_qwen2": 0.3, "tiny_qwen3_moe": 0.3, "tiny_qwen2_teacher": 0.9, "tiny_qwen2_vl": 0.8}

# Evaluation settings (the defaults ChatLearn uses for evaluation).
EVAL_SAMPLING = dict(temperature=0.6, top_p=0.95, top_k=20)
MAX_NEW_TOKENS = 16
MAX_PROMPT_TOKENS = 40  # after the chat template


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


def make_record(a: int, b: int, split: str, index: int) -> dict:
    """One example in ChatLearn's data format."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(a=a, b=b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index},
    }


def make_splits(seed: int) -> tuple[list[dict], list[dict]]:
    """All (a, b) pairs, shuffled; the first NUM_EVAL are held out for evaluation."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    eval_pairs, train_pairs = pairs[:NUM_EVAL], pairs[NUM_EVAL:]
    train = [make_record(a, b, "train", i) for i, (a, b) in enumerate(train_pairs)]
    evals = [make_record(a, b, "eval", i) for i, (a, b) in enumerate(eval_pairs)]
    return train, evals


def sft_record(rec: dict) -> dict:
    """An ``arith`` record as a conversation for ``chatlearn sft``: the question, then its answer; with the ground
    truth kept (``reward_model``), so that the same rows are prompts with reference responses for ``algorithm: gkd``
    with ``gkd_lambda`` < 1 (``runtime_args.prompt_key: messages``)."""
    answer = RESPONSE_TEMPLATE.format(answer=rec["reward_model"]["ground_truth"])
    return {"data_source": rec["data_source"],
            "messages": [*rec["prompt"], {"role": "assistant", "content": answer}],
            "reward_model": rec["reward_model"]}


def write_sft_splits(out: Path, train: list[dict], evals: list[dict]) -> None:
    """``arith_sft/{train,eval}.jsonl``: the task's splits as conversations (:func:`sft_record`)."""
    folder = out / "arith_sft"
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "train.jsonl", [sft_record(r) for r in train])
    write_jsonl(folder / "eval.jsonl", [sft_record(r) for r in evals])


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def tokenizer_corpus(records: list[dict]):
    """Text the tokenizer is trained on: roles, prompts and responses of the task.

    Special tokens are left out: they are added to the vocabulary as whole tokens, and
    their spelling must not produce merges of its own.
    """
    for role in ("system", "user", "assistant"):
        yield role + "\n"
    yield "You are a helpful assistant."
    for rec in records:
        for message in rec["prompt"]:
            yield message["content"]
        yield RESPONSE_TEMPLATE.format(answer=rec["reward_model"]["ground_truth"])


def build_tokenizer(records: list[dict]):
    """Train a byte-level BPE tokenizer and wrap it for transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # The same pipeline as Qwen2's tokenizer class, which is what AutoTokenizer rebuilds
    # from this folder (config.json says qwen2): NFC, then the split, then byte level.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # Split first (every digit on its own), then map bytes to printable symbols.
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte can be encoded
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(records), trainer)

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------------------
# Model and supervised warm start
# --------------------------------------------------------------------------------------


def _causal_lm(tokenizer, seed: int, config_cls, model_cls, shape: dict):
    """``model_cls`` of ``shape`` over ``tokenizer``'s vocabulary (rounded up to ``VOCAB_MULTIPLE``), float32,
    random init from ``seed``. Only the end-of-turn / padding ids in its generation config: no sampling
    defaults, so that engines that read generation_config.json (vLLM does) keep the caller's sampling
    parameters."""
    from transformers import GenerationConfig

    vocab_size = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = config_cls(
        vocab_size=vocab_size,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        dtype="float32",
        architectures=[model_cls.__name__],
        **shape,
    )
    torch.manual_seed(seed)
    model = model_cls(config).float()
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None
    )
    return model


def build_model(tokenizer, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _causal_lm(tokenizer, seed, Qwen2Config, Qwen2ForCausalLM, MODEL_SHAPE)


def build_moe_model(tokenizer, seed: int):
    """The mixture-of-experts toy: ``Qwen3MoeForCausalLM`` of ``MOE_SHAPE``, random init from ``seed``.
    ``output_router_logits`` is on while it is built (the warm start's loss then includes the router's
    load-balancing loss at ``router_aux_loss_coef``, transformers' own) and off in the saved config."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = _causal_lm(tokenizer, seed, Qwen3MoeConfig, Qwen3MoeForCausalLM, MOE_SHAPE)
    model.config.output_router_logits = True
    return model


def encode_examples(tokenizer, records: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) per example; the response ends with <|im_end|>."""
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    out = []
    for rec in records:
        prompt_ids = tokenizer.apply_chat_template(
            rec["prompt"], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        answer = RESPONSE_TEMPLATE.format(answer=rec["reward_model"]["ground_truth"])
        response_ids = tokenizer.encode(answer, add_special_tokens=False) + [eos_id]
        out.append((list(prompt_ids), response_ids))
    return out


def collate(examples, pad_id: int):
    """Right-padded batch; the loss covers the response tokens only."""
    length = max(len(p) + len(r) for p, r in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for i, (p, r) in enumerate(examples):
        n = len(p) + len(r)
        input_ids[i, :n] = torch.tensor(p + r)
        labels[i, len(p) : n] = torch.tensor(r)
        attention_mask[i, :n] = 1
    return input_ids, attention_mask, labels


def sft_step(model, optimizer, step: int, args, batch_loss) -> torch.Tensor:
    """One warm-start step of every toy: train mode, the learning rate of a linear warm-up then constant, the loss
    of a batch (``batch_loss()`` draws the batch), gradients clipped to norm 1, the optimizer's step."""
    model.train()
    for group in optimizer.param_groups:
        group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
    loss = batch_loss()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def supervised_warm_start(model, tokenizer, train_records, val_records, args) -> dict:
    """Next-token loss on the response tokens of random training examples.

    Supervised accuracy on this task stays near zero for a while and then rises steeply
    once the model picks up carrying; where exactly that happens moves with small
    numerical differences. Rather than a fixed step count, training therefore stops at the
    first check where greedy accuracy on a validation set (examples the warm start never
    trains on) reaches ``args.target_accuracy``: the model then starts weak but not
    hopeless, near the point where learning speeds up, which suits RL.
    """
    examples = encode_examples(tokenizer, train_records)
    pad_id = tokenizer.pad_token_id
    gen = torch.Generator().manual_seed(args.seed + 1)  # batch order, independent of checks
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    start = time.perf_counter()
    step, val_acc = 0, 0.0
    def batch_loss() -> torch.Tensor:
        idx = torch.randint(len(examples), (args.batch_size,), generator=gen).tolist()
        input_ids, attention_mask, labels = collate([examples[i] for i in idx], pad_id)
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    while step < args.max_sft_steps:
        loss = sft_step(model, optimizer, step, args, batch_loss)
        step += 1
        if step >= args.min_sft_steps and step % args.check_every == 0:
            model.eval()
            responses, ended = hf_generate(
                model, tokenizer, val_records, greedy=True, samples=1, seed=0
            )
            val_acc = summarize(responses, ended, val_records, 1)["accuracy"]
            print(
                f"  sft step {step:4d}  loss {loss.item():.4f}  "
                f"validation greedy accuracy {val_acc:.3f}",
                flush=True,
            )
            if val_acc >= args.target_accuracy:
                break
        elif step % 50 == 0:
            print(f"  sft step {step:4d}  loss {loss.item():.4f}", flush=True)
    model.eval()
    return {"steps": step, "seconds": time.perf_counter() - start, "val_accuracy": val_acc}


# --------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------


def score(response: str, ground_truth: str) -> tuple[bool, bool]:
    """(math_verify verdict, exact match) on the last boxed answer of ``response``."""
    from math_verify import parse, verify

    boxed = last_boxed(response)
    if boxed is None:
        return False, False
    exact = boxed.strip() == ground_truth
    try:
        mv = bool(verify(parse(f"\\boxed{{{ground_truth}}}"), parse(f"\\boxed{{{boxed}}}")))
    except Exception:  # a malformed answer counts as wrong
        mv = False
    return mv, exact


def summarize(responses, ended, records, samples_per_prompt: int) -> dict:
    """Accuracy (math_verify and exact match) and share of responses ending with eos."""
    n = len(responses)
    mv_ok = exact_ok = agree = 0
    for k, text in enumerate(responses):
        rec = records[k // samples_per_prompt]
        mv, exact = score(text, rec["reward_model"]["ground_truth"])
        mv_ok += mv
        exact_ok += exact
        agree += mv == exact
    return {
        "accuracy": mv_ok / n,
        "exact_accuracy": exact_ok / n,
        "verifier_agreement": agree / n,
        "eos_rate": sum(ended) / n,
        "responses": n,
    }


@torch.no_grad()
def hf_generate(model, tokenizer, records, *, greedy: bool, samples: int, seed: int):
    """Responses and whether each ended with <|im_end|> within MAX_NEW_TOKENS."""
    prompts = [
        tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in records
        for _ in range(samples)
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, **EVAL_SAMPLING)
    if getattr(model.config, "output_router_logits", False):  # the MoE warm start's: not while decoding
        kwargs["output_router_logits"] = False  # (transformers' aux loss fails on a KV-cache step's mask)
    torch.manual_seed(seed)
    out = model.generate(
        **batch,
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **kwargs,
    )
    new = out[:, batch["input_ids"].shape[1] :]
    responses, ended = [], []
    for row in new.tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id)]
            ended.append(True)
        else:
            ended.append(False)
        responses.append(tokenizer.decode(row, skip_special_tokens=True))
    return responses, ended


def hf_evaluate(model, tokenizer, records, samples: int, seed: int) -> dict:
    """Greedy (one response per prompt) and sampled (``samples`` per prompt) accuracy."""
    responses, ended = hf_generate(model, tokenizer, records, greedy=True, samples=1, seed=seed)
    greedy = summarize(responses, ended, records, 1)
    greedy["texts"] = responses
    sampled = summarize(
        *hf_generate(model, tokenizer, records, greedy=False, samples=samples, seed=seed),
        records,
        samples,
    )
    return {"greedy": greedy, "sampled": sampled}


def vllm_evaluate(model_dir: Path, records, samples: int, seed: int) -> dict:
    """Load the folder with vLLM; greedy and sampled accuracy at the eval settings."""
    # In-process engine, no thread pinning (both matter on small CPU machines), and a
    # small KV cache: the default reserves most of the memory.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    start = time.perf_counter()
    llm = LLM(
        model=str(model_dir), dtype="float32", max_model_len=128, enforce_eager=True, seed=seed
    )
    load_s = time.perf_counter() - start
    prompts = [
        {
            "prompt_token_ids": list(
                tokenizer.apply_chat_template(
                    r["prompt"], tokenize=True, add_generation_prompt=True, return_dict=False
                )
            )
        }
        for r in records
    ]
    result = {"load_s": load_s, "eos_token_id": tokenizer.eos_token_id}
    for name, params in (
        ("greedy", SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)),
        # No per-request seed: on vLLM's CPU backend it fails ("CPU Generator does not use
        # offset"); the engine-wide seed given to LLM(...) makes sampling reproducible.
        ("sampled", SamplingParams(max_tokens=MAX_NEW_TOKENS, n=samples, **EVAL_SAMPLING)),
    ):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        responses, ended, stop_ids = [], [], set()
        for out in outputs:
            for comp in out.outputs:
                responses.append(comp.text)
                stopped = comp.finish_reason == "stop"
                ended.append(stopped)
                if stopped and comp.token_ids:
                    stop_ids.add(comp.token_ids[-1])
        summary = summarize(responses, ended, records, len(responses) // len(records))
        summary.update(seconds=elapsed, stop_token_ids=sorted(stop_ids), texts=responses)
        result[name] = summary
    return result


# --------------------------------------------------------------------------------------
# Checks on the written folder
# --------------------------------------------------------------------------------------


def check_tokenizer(model_dir: Path) -> None:
    """Chat template, exact round trips, single-digit tokens, special tokens."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "hi"}]
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    got = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got == expected, f"chat template gives {got!r}"
    got = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert got == expected, f"chat template with enable_thinking gives {got!r}"
    for text in ("\\boxed{182}", "The sum is 37 + 45 = 82, so \\boxed{82}.", "héllo ✓\n\tx"):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, f"round trip of {text!r} gives {tok.decode(ids)!r}"
    # AutoTokenizer must tokenize exactly as the trained tokenizer.json does.
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in (expected + "\\boxed{182}<|im_end|>", "e\u0301 ①  x\n\n y", "I'm 12"):
        assert raw.encode(text).ids == tok.encode(text, add_special_tokens=False), text
    digits = tok.tokenize(" 12345")
    assert digits[-5:] == list("12345"), f"digits are not single tokens: {digits}"
    assert tok.eos_token == IM_END and tok.pad_token == ENDOFTEXT and tok.padding_side == "left"
    print(f"  tokenizer checks passed: chat template {got!r}, exact round trips, single digits")


# --------------------------------------------------------------------------------------
# README
# --------------------------------------------------------------------------------------


def write_readme(path: Path, info: dict) -> None:
    """Describe the folder. Only deterministic numbers go here, so that rebuilds match."""
    g, s = info["eval"]["greedy"], info["eval"]["sampled"]
    samples = s["responses"] // info["num_eval"]
    settings = ", ".join(f"{k} {v}" for k, v in EVAL_SAMPLING.items())
    shape = MODEL_SHAPE
    text = f"""# Default assets

The small model and task that ChatLearn uses by default, for examples and tests that run
on a CPU. Everything here is generated, seeded, by `tools/build_default_assets.py`.
Rebuild from the repository root with

    python tools/build_default_assets.py --out assets

It takes one to two minutes on a CPU; `--check-vllm` also loads the model with vLLM
and reports its accuracy.

## `arith/`: the task

`a + b` with `a` and `b` in 0..{MAX_OPERAND}, answered as `\\boxed{{N}}`.
`eval.jsonl`: {info["num_eval"]} held-out pairs; `train.jsonl`: the other {info["num_train"]}.
One JSON object a line, in ChatLearn's data format:

    {info["example"]}

## `tiny_qwen2/`: the model

A Hugging Face `Qwen2ForCausalLM` folder that transformers and vLLM load offline.

- Shape: {info["num_params"]:,} parameters in fp32; hidden {shape["hidden_size"]}, \
{shape["num_hidden_layers"]} layers, {shape["num_attention_heads"]} heads of size \
{shape["hidden_size"] // shape["num_attention_heads"]}, {shape["num_key_value_heads"]} KV heads, \
MLP {shape["intermediate_size"]}, tied embeddings, vocabulary {info["model_vocab"]}.
- Tokenizer: byte-level BPE with {info["tokenizer_vocab"]} tokens trained on the task's text;
  every digit is a token of its own. ChatML chat template
  (`<|im_start|>role\\ncontent<|im_end|>\\n`); eos `<|im_end|>`; padding `<|endoftext|>`,
  on the left.
- Weights: random init, then a supervised warm start on the training split (loss on the
  response tokens only, batch {info["batch_size"]}, lr {info["lr"]}). It stops as soon as
  greedy accuracy on {info["num_val"]} training examples it does not train on reaches
  {info["target"]}; here after {info["sft"]["steps"]} steps. The model answers in the right
  format but often gets the sum wrong, so RL has room to improve it.

Measured at build time on the eval split ({info["num_eval"]} prompts, at most
{MAX_NEW_TOKENS} new tokens, Hugging Face `generate`):

| decoding | accuracy | ends with eos |
|---|---|---|
| greedy | {g["accuracy"]:.3f} | {g["eos_rate"]:.3f} |
| sampled ({settings}; {samples} per prompt) | {s["accuracy"]:.3f} | {s["eos_rate"]:.3f} |
"""
    path.write_text(text + others_sections(path, text), encoding="utf-8")


@torch.no_grad()
def expert_load(model, tokenizer, records) -> list[float]:
    """Per MoE layer: the most tokens any expert gets over the mean an expert gets, over the
    chat-templated eval prompts (1.0: perfectly even; top-k choices each count once)."""
    prompts = [
        tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in records
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model(**batch, output_router_logits=True)
    mask = batch["attention_mask"].reshape(-1).bool()
    k, n = model.config.num_experts_per_tok, model.config.num_experts
    loads = []
    for logits in out.router_logits:
        top = logits[mask].topk(k, dim=-1).indices.reshape(-1)
        counts = torch.bincount(top, minlength=n).float()
        loads.append(round(float(counts.max() / counts.mean()), 3))
    return loads


def write_teacher_readme(path: Path, info: dict) -> None:
    """The README's section on ``tiny_qwen2_teacher/``, in place of the one there (the other sections kept)."""
    g, s = info["eval"]["greedy"], info["eval"]["sampled"]
    samples = s["responses"] // info["num_eval"]
    settings = ", ".join(f"{k} {v}" for k, v in EVAL_SAMPLING.items())
    section = f"""## `tiny_qwen2_teacher/`: the distillation teacher

The teacher of `template/distill.yaml` (distillation, `algorithm: gkd` or `opd`): `tiny_qwen2/`'s
shape, tokenizer and chat template (the same files), trained on where the student stops. Rebuild it
(and this section) from the repository root, after the dense model, with

    python tools/build_default_assets.py --model tiny_qwen2_teacher --out assets

- Shape: {info["num_params"]:,} parameters in fp32, as `tiny_qwen2/`.
- Weights: random init, then the same supervised warm start as `tiny_qwen2/` (the same seed, batch
  {info["batch_size"]}, lr {info["lr"]}), stopped once greedy accuracy on {info["num_val"]} held-out training
  examples reaches {info["target"]}; here after {info["sft"]["steps"]} steps.

Measured at build time on the eval split ({info["num_eval"]} prompts, at most
{MAX_NEW_TOKENS} new tokens, Hugging Face `generate`):

| decoding | accuracy | ends with eos |
|---|---|---|
| greedy | {g["accuracy"]:.3f} | {g["eos_rate"]:.3f} |
| sampled ({settings}; {samples} per prompt) | {s["accuracy"]:.3f} | {s["eos_rate"]:.3f} |

"""
    replace_section(path, section)


def replace_section(path: Path, section: str) -> None:
    """``section`` (a ``## `` heading and its text) in place of the README's section of that heading (from the
    heading to the next ``## ``), or at its end; the rest of the file kept, sections a blank line apart. The
    one README writer of all the asset builders."""
    heading = section.splitlines()[0]
    text = path.read_text(encoding="utf-8") if path.exists() else "# Default assets\n\n"
    lines = text.splitlines(keepends=True)
    body = section.rstrip("\n") + "\n"
    start = next((i for i, line in enumerate(lines) if line.rstrip("\n") == heading), None)
    if start is None:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        rest = "".join(lines[end:])
        text = "".join(lines[:start]) + body + ("\n" + rest if rest else "")
    path.write_text(text.rstrip("\n") + "\n", encoding="utf-8")


def write_moe_readme(path: Path, info: dict) -> None:
    """The README's section on ``tiny_qwen3_moe/``, in place of the one there (the other sections kept)."""
    g, s = info["eval"]["greedy"], info["eval"]["sampled"]
    samples = s["responses"] // info["num_eval"]
    settings = ", ".join(f"{k} {v}" for k, v in EVAL_SAMPLING.items())
    shape = MOE_SHAPE
    active = info["num_params"] - info["num_expert_params"] * (
        1 - shape["num_experts_per_tok"] / shape["num_experts"]
    )
    section = f"""## `tiny_qwen3_moe/`: the mixture-of-experts model

A Hugging Face `Qwen3MoeForCausalLM` folder that transformers and vLLM load offline: the
mixture-of-experts toy of `template/grpo_moe.yaml`, on the `arith/` task. Rebuild it (and this
section) from the repository root, after the dense model, with

    python tools/build_default_assets.py --model tiny_qwen3_moe --out assets

- Shape: {info["num_params"]:,} parameters in fp32, of which {info["num_expert_params"]:,} in experts; about {active:,.0f} active per token. Hidden {shape["hidden_size"]}, {shape["num_hidden_layers"]} layers, {shape["num_attention_heads"]} heads of size {shape["head_dim"]}, {shape["num_key_value_heads"]} KV heads; every layer a sparse MoE block of {shape["num_experts"]} experts (SwiGLU, intermediate size {shape["moe_intermediate_size"]}), top-{shape["num_experts_per_tok"]} routing with the top-k weights renormalised; no shared expert; tied embeddings, vocabulary {info["model_vocab"]}.
- Tokenizer and chat template: those of `tiny_qwen2/` (the same files).
- Weights: random init, then the same supervised warm start as `tiny_qwen2/` (batch
  {info["batch_size"]}, lr {info["lr"]}) with the router's load-balancing loss (transformers'
  `load_balancing_loss_func`) at `router_aux_loss_coef` {shape["router_aux_loss_coef"]}, stopped as
  soon as greedy accuracy on {info["num_val"]} held-out training examples reaches {info["target"]};
  here after {info["sft"]["steps"]} steps.
- Expert load on the eval prompts (the most tokens an expert gets over the mean, per layer; 1.0 is
  even): {", ".join(f"{x:.2f}" for x in info["expert_load"])}.

Measured at build time on the eval split ({info["num_eval"]} prompts, at most
{MAX_NEW_TOKENS} new tokens, Hugging Face `generate`):

| decoding | accuracy | ends with eos |
|---|---|---|
| greedy | {g["accuracy"]:.3f} | {g["eos_rate"]:.3f} |
| sampled ({settings}; {samples} per prompt) | {s["accuracy"]:.3f} | {s["eos_rate"]:.3f} |

"""
    replace_section(path, section)


def others_sections(path: Path, ours: str) -> str:
    """The sections of the README at ``path`` that this script does not write (``## `` headings not
    in ``ours``, each to the next such heading: e.g. tools/build_multiturn_assets.py's), kept as they are."""
    if not path.exists():
        return ""
    mine = {line for line in ours.splitlines() if line.startswith("## ")}
    kept, keep = [], False
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("## "):
            keep = line.rstrip("\n") not in mine
        if keep:
            kept.append(line)
    return ("\n" + "".join(kept)) if kept else ""


# --------------------------------------------------------------------------------------
# The vision-language toy (``--model tiny_qwen2_vl``) and its data (``vlm_digits/``)
# --------------------------------------------------------------------------------------

VLM_DATA = "vlm_digits"
VLM_QUESTION = "Add the two digits in the image. Put the final answer in \\boxed{}."
# the warm start's answers name the digits, then box their sum: each digit is supervised on its own
VLM_RESPONSE = "{a}+{b}=\\boxed{{{s}}}"
VLM_IMAGE = 64  # pixels a side: (64 / 8)^2 = 64 patches, merged 2x2 into 16 vision tokens
VLM_NUM_TRAIN, VLM_NUM_EVAL = 2000, 200
# The warm start teaches perception well and the sum weakly: its targets always name the right digits, but box
# the right sum with probability VLM_SUM_TRUE only, otherwise the sum moved by one of VLM_SUM_OFFSETS (drawn
# afresh at each step). It stops when the digits are read (greedy, both right) on TARGET_ACCURACY of the
# held-out prompts, so the model reads the image but is often wrong on the sum: RL sharpens the sum.
VLM_SUM_TRUE = 0.2
VLM_SUM_OFFSETS = (-3, -2, -1, 1, 2, 3)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# ChatML with content lists: an image part renders as its placeholder (the processor expands it)
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Text as tiny_qwen2 (head_dim 32 for vLLM's CPU attention); multimodal rotary sections summing to 16.
VLM_TEXT_SHAPE = dict(
    hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
)
# A two-block vision tower on 8x8 patches (2 heads of 32), merging 2x2 patches into one token.
VLM_VISION_SHAPE = dict(depth=2, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=8,
                        spatial_merge_size=2, temporal_patch_size=2, in_channels=3)


def draw_digits(rng: random.Random):
    """A VLM_IMAGE-pixel square with two digits, one in each half, at slightly varied places, sizes and
    colours: (image, a, b). Big bold dark digits on a light ground, so that a two-block vision tower trained
    from scratch learns to read them in a short warm start."""
    from PIL import Image, ImageDraw, ImageFont

    bg = tuple(rng.randint(190, 255) for _ in range(3))  # a light background, dark digits: high contrast
    img = Image.new("RGB", (VLM_IMAGE, VLM_IMAGE), bg)
    draw = ImageDraw.Draw(img)
    digits = (rng.randint(0, 9), rng.randint(0, 9))
    for k, d in enumerate(digits):  # the first in the left half, the second in the right half
        size = rng.randint(34, 40)  # about 24 to 30 pixels high, most of its half
        font = ImageFont.load_default(size=size)
        fg = tuple(rng.randint(0, 70) for _ in range(3))
        left, top, right, bottom = draw.textbbox((0, 0), str(d), font=font, stroke_width=1)
        half, jitter = VLM_IMAGE // 2, 3  # about the middle of its half, moved by up to 3 pixels
        x = k * half + (half - (right - left)) // 2 + rng.randint(-jitter, jitter) - left
        y = (VLM_IMAGE - (bottom - top)) // 2 + rng.randint(-jitter, jitter) - top
        draw.text((x, y), str(d), fill=fg, font=font, stroke_width=1, stroke_fill=fg)  # bold strokes
    return img, digits[0], digits[1]


def vlm_record(image: str, a: int, b: int, split: str, index: int) -> dict:
    return {
        "data_source": VLM_DATA,
        "prompt": [{"role": "user", "content": [{"type": "image", "image": image},
                                                {"type": "text", "text": VLM_QUESTION}]}],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "digits": [a, b]},
        "answer": VLM_RESPONSE.format(a=a, b=b, s=a + b),
    }


def write_vlm_data(out: Path, seed: int) -> tuple[list[dict], list[dict]]:
    """``vlm_digits/{train,eval}.jsonl`` and their PNG files under ``vlm_digits/images/``."""
    folder = out / VLM_DATA
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "images").mkdir(parents=True)
    rng = random.Random(seed)
    splits = {}
    for split, n in (("train", VLM_NUM_TRAIN), ("eval", VLM_NUM_EVAL)):
        records = []
        for i in range(n):
            img, a, b = draw_digits(rng)
            name = f"images/{split}_{i:04d}.png"
            img.save(folder / name, optimize=True)
            records.append(vlm_record(name, a, b, split, i))
        write_jsonl(folder / f"{split}.jsonl", records)
        splits[split] = records
    return splits["train"], splits["eval"]


def build_vlm_tokenizer():
    """A byte-level BPE tokenizer over the task's text, with the vision tokens as special tokens."""
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer([{"prompt": [{"role": "user", "content": VLM_QUESTION},
                                        {"role": "user", "content": VLM_RESPONSE.format(a=a, b=b, s=a + b)}],
                             "reward_model": {"ground_truth": str(a + b)}} for a in range(10) for b in range(10)])
    tok = base.backend_tokenizer
    tok.add_special_tokens(VISION_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=None,
        padding_side="left", chat_template=VLM_CHAT_TEMPLATE,
        model_max_length=VLM_TEXT_SHAPE["max_position_embeddings"], clean_up_tokenization_spaces=False,
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
    )


def build_vlm_model(tokenizer, seed: int):
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vocab_size = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(VISION_TOKENS), strict=True))
    eos_id, pad_id = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    text = dict(VLM_TEXT_SHAPE, vocab_size=vocab_size, eos_token_id=eos_id, pad_token_id=pad_id,
                bos_token_id=None)
    config = Qwen2VLConfig(text_config=text, vision_config=dict(VLM_VISION_SHAPE), dtype="float32",
                           architectures=["Qwen2VLForConditionalGeneration"],
                           tie_word_embeddings=True, **ids)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).float()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    return model


def save_vlm_processor(tokenizer, folder: Path) -> None:
    """The tokenizer and the image processor, with the files ``AutoProcessor`` reads to make a
    ``Qwen2VLProcessor`` (where torchvision is installed: its video half needs it)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer.save_pretrained(folder)
    side = VLM_IMAGE * VLM_IMAGE
    ip = Qwen2VLImageProcessorPil(patch_size=VLM_VISION_SHAPE["patch_size"], temporal_patch_size=2,
                                  merge_size=VLM_VISION_SHAPE["spatial_merge_size"],
                                  size={"shortest_edge": side, "longest_edge": side})
    ip.save_pretrained(folder)
    cfg_path = folder / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2VLProcessor",
               min_pixels=side, max_pixels=side)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}) + "\n")


def vlm_examples(processor, records: list[dict], data_dir: Path, *, answers: bool = True) -> list[dict]:
    """Rendered prompts (``input_ids``, ``pixel_values``, ``image_grid_thw``) and, with ``answers``, the
    response ids (the boxed sum, then the end of turn)."""
    from chatlearn.data.vision import decode_image, message_images

    eos_id = processor.tokenizer.convert_tokens_to_ids(IM_END)
    out = []
    for rec in records:
        images = [decode_image(ref, str(data_dir), "build") for ref in message_images(rec["prompt"])]
        ex = processor.render(rec["prompt"], images)
        if answers:
            text = rec["answer"]
            ex["response"] = processor.tokenizer.encode(text, add_special_tokens=False) + [eos_id]
        ex["digits"] = tuple(rec["extra_info"]["digits"])
        out.append(ex)
    return out


def vlm_noisy_sum(a: int, b: int, rng: random.Random) -> int:
    """The warm start's boxed sum: a + b with probability VLM_SUM_TRUE, else moved by a VLM_SUM_OFFSETS
    (reflected to stay non-negative)."""
    s = a + b
    if rng.random() < VLM_SUM_TRUE:
        return s
    off = rng.choice(VLM_SUM_OFFSETS)
    return s + off if s + off >= 0 else s - off


def vlm_noisy_examples(processor, examples: list[dict], rng: random.Random) -> list[dict]:
    """The examples with their responses' sums drawn afresh (:func:`vlm_noisy_sum`); the digits stay right."""
    tok, eos_id = processor.tokenizer, processor.tokenizer.convert_tokens_to_ids(IM_END)
    out = []
    for ex in examples:
        a, b = ex["digits"]
        text = VLM_RESPONSE.format(a=a, b=b, s=vlm_noisy_sum(a, b, rng))
        out.append(dict(ex, response=tok.encode(text, add_special_tokens=False) + [eos_id]))
    return out


def vlm_collate(examples: list[dict], pad_id: int, *, left: bool, image_id: int) -> dict:
    """A padded batch of rendered examples (left-padded prompts for generation; right-padded prompt +
    response with response labels for training)."""
    seqs = [ex["input_ids"] + ex.get("response", []) for ex in examples]
    length = max(map(len, seqs))
    input_ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, (ex, seq) in enumerate(zip(examples, seqs, strict=True)):
        start = length - len(seq) if left else 0
        input_ids[i, start:start + len(seq)] = torch.tensor(seq)
        attention_mask[i, start:start + len(seq)] = 1
        labels[i, start + len(ex["input_ids"]):start + len(seq)] = torch.tensor(seq[len(ex["input_ids"]):])
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                mm_token_type_ids=(input_ids == image_id).int(),  # the image's tokens (M-RoPE reads them)
                pixel_values=torch.cat([ex["pixel_values"] for ex in examples]),
                image_grid_thw=torch.cat([ex["image_grid_thw"] for ex in examples]))


@torch.no_grad()
def vlm_generate(model, processor, examples: list[dict], *, greedy: bool, seed: int) -> list[str]:
    tok = processor.tokenizer
    texts = []
    for start in range(0, len(examples), 50):
        batch = vlm_collate(examples[start:start + 50], tok.pad_token_id, left=True, image_id=processor.image_token_id)
        batch.pop("labels")
        kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, **EVAL_SAMPLING)
        torch.manual_seed(seed)
        out = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, **kwargs)
        for row in out[:, batch["input_ids"].shape[1]:].tolist():
            ended = tok.eos_token_id in row
            texts.append((tok.decode(row[: row.index(tok.eos_token_id)] if ended else row,
                                     skip_special_tokens=True), ended))
    return texts


def vlm_accuracy(model, processor, examples, records, *, greedy: bool, seed: int) -> dict:
    """:func:`summarize`'s accuracy of the boxed sum, and ``digits``: the share naming both digits right."""
    model.eval()
    texts = vlm_generate(model, processor, examples, greedy=greedy, seed=seed)
    result = summarize([t for t, _ in texts], [e for _, e in texts], records, 1)
    named = [t.split("=")[0].strip() for t, _ in texts]
    result["digits"] = sum(n == "{}+{}".format(*r["extra_info"]["digits"])
                           for n, r in zip(named, records, strict=True)) / len(records)
    return result


def vlm_warm_start(model, processor, train: list[dict], val: list[dict], val_records, args) -> dict:
    """Supervised steps on the training prompts (vision tower included; noisy sums, :func:`vlm_noisy_examples`)
    until greedy reading of both digits on held-out training prompts reaches ``args.target_accuracy``."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    rng = random.Random(args.seed + 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, step, acc = time.perf_counter(), 0, 0.0
    pad_id = processor.tokenizer.pad_token_id
    def batch_loss() -> torch.Tensor:
        idx = torch.randint(len(train), (args.batch_size,), generator=gen).tolist()
        batch = vlm_noisy_examples(processor, [train[i] for i in idx], rng)
        return model(**vlm_collate(batch, pad_id, left=False, image_id=processor.image_token_id)).loss

    while step < args.max_sft_steps:
        loss = sft_step(model, optimizer, step, args, batch_loss)
        step += 1
        if step >= args.min_sft_steps and step % args.check_every == 0:
            res = vlm_accuracy(model, processor, val, val_records, greedy=True, seed=0)
            acc = res["digits"]
            print(f"  sft step {step:4d}  loss {loss.item():.4f}  validation greedy: digits read {acc:.3f}, "
                  f"sum {res['accuracy']:.3f}", flush=True)
            if acc >= args.target_accuracy:
                break
        elif step % 10 == 0:
            print(f"  sft step {step:4d}  loss {loss.item():.4f}", flush=True)
    model.eval()
    return {"steps": step, "seconds": time.perf_counter() - start, "val_accuracy": acc}


def build_vlm(args) -> int:
    """``--model tiny_qwen2_vl``: ``vlm_digits/`` (images and splits) and the model folder, warm-started."""
    from chatlearn.data.vision import VisionProcessor

    out, t0 = Path(args.out), time.perf_counter()
    model_dir, data_dir = out / "tiny_qwen2_vl", out / VLM_DATA
    if not args.check_only:
        train, evals = write_vlm_data(out, args.seed)
        shutil.rmtree(model_dir, ignore_errors=True)
        model_dir.mkdir(parents=True)
        tokenizer = build_vlm_tokenizer()
        save_vlm_processor(tokenizer, model_dir)
        processor = VisionProcessor(str(model_dir))
        model = build_vlm_model(tokenizer, args.seed)
        sft_train, val_records = train[: -args.num_val], train[-args.num_val:]
        examples = vlm_examples(processor, sft_train, data_dir)
        val = vlm_examples(processor, val_records, data_dir, answers=False)
        print(f"tokenizer {len(tokenizer)} tokens; prompt {len(val[0]['input_ids'])} tokens; "
              f"model {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
        sft = vlm_warm_start(model, processor, examples, val, val_records, args)
        model.save_pretrained(model_dir)
        del model
    else:
        evals, sft = read_jsonl(data_dir / "eval.jsonl"), None
    from transformers import Qwen2VLForConditionalGeneration

    processor = VisionProcessor(str(model_dir))
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    ev = vlm_examples(processor, evals, data_dir, answers=False)
    result = {"greedy": vlm_accuracy(model, processor, ev, evals, greedy=True, seed=args.seed),
              "sampled": vlm_accuracy(model, processor, ev, evals, greedy=False, seed=args.seed)}
    info = dict(num_params=sum(p.numel() for p in model.parameters()),
                num_vision=sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}"),
                sft=sft, eval=result, num_eval=len(evals), prompt_tokens=len(ev[0]["input_ids"]),
                batch_size=args.batch_size, lr=args.lr, num_val=args.num_val, target=args.target_accuracy,
                pixel_bytes=ev[0]["pixel_values"].numel() * ev[0]["pixel_values"].element_size())
    if not args.check_only:
        write_vlm_readme(out / "README.md", info)
    files = sorted(p for p in model_dir.rglob("*") if p.is_file())
    images = sum(p.stat().st_size for p in (data_dir / "images").iterdir())
    print(f"\n=== {model_dir} ===\nparameters {info['num_params']:,} ({info['num_vision']:,} in the vision tower)")
    for name, r in result.items():
        print(f"  {name:8s} accuracy {r['accuracy']:.3f}, ends with eos {r['eos_rate']:.3f}")
    for f in files:
        print(f"  {f.relative_to(out)!s:44s} {f.stat().st_size:>10,d} bytes")
    print(f"  {VLM_DATA}/images: {images:,} bytes; total {time.perf_counter() - t0:.1f} s")
    return 0


def write_vlm_readme(path: Path, info: dict) -> None:
    """The README's section on ``tiny_qwen2_vl/`` and ``vlm_digits/`` (the other sections kept)."""
    g, s, v = info["eval"]["greedy"], info["eval"]["sampled"], VLM_VISION_SHAPE
    sft = info["sft"] or {"steps": 0, "val_accuracy": 0.0}
    stopped = (f"after {sft['steps']} steps" if sft["val_accuracy"] >= info["target"] else
               f"at the step limit, {sft['steps']} steps (validation accuracy {sft['val_accuracy']:.3f})")
    settings = ", ".join(f"{k} {x}" for k, x in EVAL_SAMPLING.items())
    section = f"""## `tiny_qwen2_vl/` and `vlm_digits/`: the vision-language model and its task

`vlm_digits/`: {VLM_NUM_TRAIN} train and {VLM_NUM_EVAL} eval prompts, each a {VLM_IMAGE}x{VLM_IMAGE} PNG
(`images/`, paths relative to the JSONL) with two digits drawn with PIL, one in each half, big and bold,
dark on a light ground, their places (3 pixels), sizes and colours varied a little, the question "{VLM_QUESTION}" and the sum as ground truth. `tiny_qwen2_vl/`: a Hugging Face
`Qwen2VLForConditionalGeneration` folder (processor files included) that transformers loads offline.
Rebuild both (and this section) from the repository root with

    python tools/build_default_assets.py --model tiny_qwen2_vl --out assets

- Shape: {info["num_params"]:,} parameters in fp32, {info["num_vision"]:,} of them in the vision tower
  ({v["depth"]} blocks, width {v["embed_dim"]}, {v["num_heads"]} heads, {v["patch_size"]}x{v["patch_size"]}
  patches merged {v["spatial_merge_size"]}x{v["spatial_merge_size"]}); the language model is `tiny_qwen2/`'s
  shape with multimodal rotary sections {VLM_TEXT_SHAPE["rope_parameters"]["mrope_section"]}. A prompt is
  {info["prompt_tokens"]} tokens, 16 of them the image's; {info["pixel_bytes"]:,} bytes of pixel values an image.
- Tokenizer: byte-level BPE on the task's text plus `{"`, `".join(VISION_TOKENS)}`; a ChatML template that
  renders an image part as `<|vision_start|><|image_pad|><|vision_end|>`.
- Weights: random init, then supervised steps on the train prompts (vision tower included, batch
  {info["batch_size"]}, lr {info["lr"]}). The answers name the digits, then box a sum, `3+9=\\boxed{{12}}`:
  the digits are always the right ones, the boxed sum is the right one with probability {VLM_SUM_TRUE} only and
  otherwise off by one of {", ".join(f"{o:+d}" for o in VLM_SUM_OFFSETS)} (drawn afresh at every step). So the
  warm start teaches the model to read the image and only roughly to add: it stops when greedy decoding names
  both digits right on {info["target"]} of {info["num_val"]} held-out train prompts, or at the step limit;
  here {stopped}. RL (`template/grpo_vlm.yaml`) then teaches it to add the digits it reads.

Measured at build time on the eval split ({info["num_eval"]} prompts, Hugging Face `generate`; "digits
named": both digits right before the `=`):

| decoding | accuracy (the boxed sum) | digits named | ends with eos |
|---|---|---|---|
| greedy | {g["accuracy"]:.3f} | {g["digits"]:.3f} | {g["eos_rate"]:.3f} |
| sampled ({settings}) | {s["accuracy"]:.3f} | {s["digits"]:.3f} | {s["eos_rate"]:.3f} |

"""
    replace_section(path, section)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="assets", help="output folder (default: assets)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=None, help="default 1.5e-3; 2e-3 for tiny_qwen2_vl")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    p.add_argument(
        "--target-accuracy",
        type=float,
        default=None,
        help="stop the warm start once greedy validation accuracy reaches this (default: 0.3; "
        "0.9 for tiny_qwen2_teacher; for tiny_qwen2_vl, 0.8 of the prompts with both digits named right)",
    )
    p.add_argument("--min-sft-steps", type=int, default=100)
    p.add_argument("--max-sft-steps", type=int, default=None, help="default 1500; 4000 for the teacher")
    p.add_argument("--check-every", type=int, default=None, help="steps between validation checks (default 5; "
                   "25 for tiny_qwen2_vl)")
    p.add_argument(
        "--num-val", type=int, default=200, help="validation examples held out of the warm start"
    )
    p.add_argument("--eval-samples", type=int, default=4, help="samples per eval prompt")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the least hurt when other processes share the cores)",
    )
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="tiny_qwen2",
        help="the model folder to build: tiny_qwen2 (and the arith task; the default), "
        "tiny_qwen3_moe (the mixture-of-experts toy, on the task's existing files) or "
        "tiny_qwen2_teacher (the distillation teacher: tiny_qwen2's tokenizer, trained on)",
    )
    p.add_argument("--check-vllm", action="store_true", help="also load and sample with vLLM")
    p.add_argument(
        "--check-only", action="store_true", help="check an existing folder; build nothing"
    )
    p.add_argument(
        "--sft-data",
        action="store_true",
        help="write arith_sft/ (the conversations of chatlearn sft) from the existing arith/; build nothing else",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    moe = args.model == "tiny_qwen3_moe"
    teacher = args.model == "tiny_qwen2_teacher"
    if args.target_accuracy is None:
        args.target_accuracy = TARGET_ACCURACY[args.model]
    if args.max_sft_steps is None:
        args.max_sft_steps = 4000 if teacher else 1500
    if args.lr is None:  # the VLM's vision tower starts from scratch: a higher rate
        args.lr = 2e-3 if args.model == "tiny_qwen2_vl" else 1.5e-3
    if args.check_every is None:
        args.check_every = 25 if args.model == "tiny_qwen2_vl" else 5
    if args.model == "tiny_qwen2_vl":  # its own data (images) and model class
        return build_vlm(args)
    model_dir, data_dir = out / args.model, out / "arith"
    t0 = time.perf_counter()
    if args.sft_data:
        write_sft_splits(out, read_jsonl(data_dir / "train.jsonl"), read_jsonl(data_dir / "eval.jsonl"))
        print(f"wrote {out / 'arith_sft'}", flush=True)
        return 0

    if not args.check_only:
        train, evals = make_splits(args.seed)
        # The warm start holds out the last examples of the training split to decide when
        # to stop; they stay in train.jsonl for RL.
        sft_train, val = train[: -args.num_val], train[-args.num_val :]
        train_keys = {r["prompt"][0]["content"] for r in train}
        assert not any(r["prompt"][0]["content"] in train_keys for r in evals)

        if moe or teacher:  # the task's files are the dense build's (the same seed gives the same split)
            shutil.rmtree(model_dir, ignore_errors=True)
            model_dir.mkdir(parents=True)
            if (data_dir / "eval.jsonl").exists():
                assert read_jsonl(data_dir / "eval.jsonl") == evals, "arith/ was built with another seed"
            else:
                data_dir.mkdir(parents=True, exist_ok=True)
                write_jsonl(data_dir / "train.jsonl", train)
                write_jsonl(data_dir / "eval.jsonl", evals)
        else:
            for d in (model_dir, data_dir):
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir(parents=True)
            write_jsonl(data_dir / "train.jsonl", train)
            write_jsonl(data_dir / "eval.jsonl", evals)
            write_sft_splits(out, train, evals)

        if teacher:  # the student's own tokenizer files: a teacher scores the student's token ids
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(out / "tiny_qwen2")
        else:
            tokenizer = build_tokenizer(train + evals)
        model = (build_moe_model if moe else build_model)(tokenizer, args.seed)
        num_params = sum(p.numel() for p in model.parameters())
        prompt_lens = [len(p) for p, _ in encode_examples(tokenizer, evals)]
        assert max(prompt_lens) <= MAX_PROMPT_TOKENS, f"prompts too long: {max(prompt_lens)}"
        print(
            f"tokenizer: {len(tokenizer)} tokens (model vocabulary {model.config.vocab_size}); "
            f"prompt length {min(prompt_lens)}..{max(prompt_lens)} tokens; "
            f"model: {num_params:,} parameters",
            flush=True,
        )

        sft = supervised_warm_start(model, tokenizer, sft_train, val, args)
        if moe:
            model.config.output_router_logits = False  # the saved config: transformers' default
        tokenizer.save_pretrained(model_dir)
        if teacher:  # byte for byte the student's tokenizer files
            for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                shutil.copyfile(out / "tiny_qwen2" / name, model_dir / name)
        model.save_pretrained(model_dir)
        del model
    else:
        evals = read_jsonl(data_dir / "eval.jsonl")
        train = read_jsonl(data_dir / "train.jsonl")
        sft = None

    # Everything below reads the folder back, as users of the assets will.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print("checking the written folder", flush=True)
    check_tokenizer(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    num_params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    result = hf_evaluate(model, tokenizer, evals, samples=args.eval_samples, seed=args.seed)
    eval_s = time.perf_counter() - start

    info = dict(
        num_train=len(train),
        num_eval=len(evals),
        num_params=num_params,
        model_vocab=model.config.vocab_size,
        tokenizer_vocab=len(tokenizer),
        sft=sft,
        batch_size=args.batch_size,
        lr=args.lr,
        num_val=args.num_val,
        target=args.target_accuracy,
        example=json.dumps(evals[0], ensure_ascii=False),
        eval=result,
        num_expert_params=sum(
            p.numel() for n, p in model.named_parameters() if ".experts." in n
        ),
    )
    if moe:
        info["expert_load"] = expert_load(model, tokenizer, evals)
    if not args.check_only:
        (write_moe_readme if moe else write_teacher_readme if teacher else write_readme)(out / "README.md", info)

    vllm_result = None
    if args.check_vllm:
        vllm_result = vllm_evaluate(model_dir, evals, args.eval_samples, args.seed)

    # Report.
    def describe(r: dict) -> str:
        return (
            f"accuracy {r['accuracy']:.3f} (exact match {r['exact_accuracy']:.3f}), "
            f"ends with eos {r['eos_rate']:.3f}"
        )

    settings = ", ".join(f"{k}={v}" for k, v in EVAL_SAMPLING.items())
    g, s = result["greedy"], result["sampled"]
    print("\n=== default assets ===")
    print(f"output folder        {out}")
    print(f"data                 {len(train)} train / {len(evals)} eval examples")
    print(f"tokenizer vocabulary {len(tokenizer)} (model vocabulary {model.config.vocab_size})")
    print(f"parameters           {num_params:,}")
    if moe:
        print(f"expert load          max / mean per layer on the eval prompts: {info['expert_load']}")
    if sft is not None:
        print(
            f"warm start           {sft['steps']} steps, batch {args.batch_size}, lr {args.lr}: "
            f"{sft['seconds']:.1f} s; validation greedy accuracy {sft['val_accuracy']:.3f}"
        )
    print(f"eval (HF generate, {eval_s:.1f} s)")
    print(f"  greedy             {describe(g)}")
    print(f"  sampled            {describe(s)}  [{s['responses']} responses, {settings}]")
    if vllm_result is not None:
        vg, vs = vllm_result["greedy"], vllm_result["sampled"]
        same = sum(a == b for a, b in zip(vg["texts"], g["texts"], strict=True)) / len(g["texts"])
        stop_ids = sorted(set(vg["stop_token_ids"]) | set(vs["stop_token_ids"]))
        print(f"eval (vLLM, engine start {vllm_result['load_s']:.1f} s)")
        print(
            f"  greedy             {describe(vg)}; same response as HF for {same:.3f} "
            f"of prompts  [{vg['seconds']:.2f} s]"
        )
        print(
            f"  sampled            {describe(vs)}  [{vs['responses']} responses, "
            f"{vs['seconds']:.2f} s]"
        )
        print(
            f"  stopped on ids     {stop_ids} (eos {vllm_result['eos_token_id']}); "
            f"e.g. {vs['texts'][0]!r}"
        )
    # The intended operating point: right format, sum right only some of the time.
    if teacher and g["accuracy"] < 0.8:
        print("WARNING: the teacher's greedy accuracy is below 0.8; raise --target-accuracy or --max-sft-steps")
    elif not teacher and (min(g["eos_rate"], s["eos_rate"]) < 0.95 or not 0.1 <= s["accuracy"] <= 0.45):
        print(
            "WARNING: the model is outside its intended range (eos rate >= 0.95, sampled "
            "accuracy about 0.15 to 0.35); adjust --target-accuracy or --lr"
        )
    for f in sorted(p for p in (model_dir.rglob("*") if moe or teacher else out.rglob("*")) if p.is_file()):
        print(f"  {f.relative_to(out)!s:34s} {f.stat().st_size:>10,d} bytes")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
