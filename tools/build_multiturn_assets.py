#!/usr/bin/env python
"""Build the small model and task of ChatLearn's multi-turn (tool-calling) example.

Writes, under ``--out`` (default ``assets/``):

* ``calc/train.jsonl`` and ``calc/eval.jsonl``: the task ``a * b`` with ``a`` in 100..999 and
  ``b`` in 10..99, in ChatLearn's data format. The eval split holds 200 pairs that never occur
  in the training split (20000 pairs).
* ``tiny_qwen2_tools/``: a complete local Hugging Face model folder (``Qwen2ForCausalLM``, about
  1M parameters, fp32; the shape of ``tiny_qwen2``) with a byte-level BPE tokenizer trained on
  the task's text, the tool calls, the tool's description and the chat template's text, the
  non-special tokens ``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and
  ``</tool_response>``, and a ChatML chat template that renders the tools and ``tool`` messages
  the way Qwen2.5 does. Transformers, vLLM and ChatLearn's driver tokenizer load it offline.
* a section of ``README.md``: what is in the two folders and the numbers measured at build
  time (the rest of the file is left as it is).

The model's weights come from a supervised warm start on trajectories of two kinds, built
token for token as ChatLearn's multi-turn rollout builds them (``template/grpo_multiturn.yaml``:
the ``calculator`` tool, ``builtin:calculator``, through :class:`chatlearn.env.ToolEnvironment`
and the chat template as :class:`chatlearn.data.turns.TurnTemplate` renders it):

* tool (a share ``--tool-fraction`` of the examples): the model calls
  ``calculator`` with the expression ``"a * b"``, the tool's answer is appended (no loss on it),
  and the model writes the result as ``\\boxed{N}``;
* direct (the rest): the model answers ``\\boxed{a*b}`` at once;

and, for a share ``--copy-share`` of each batch, tool-path examples with no loss on the choice
to call the tool (its first token), which teach copying without changing how often the model
calls the tool.

A 1M-parameter model cannot multiply, so its direct answers are nearly always wrong, but it
learns to copy the expression into the call and the tool's result into the answer. The warm
start keeps its learning rate constant until greedy copying on training examples it does not
train on is exact for a share ``--target-copy-accuracy`` of them, then decays it to 0 over
``--cooldown-steps`` more. The result is a starting point for RL where calling the tool is the
way to reward, and the model calls it only some of the time.

At the end the folder is evaluated with the real rollout: ChatLearn's
:class:`~chatlearn.runtime.driver.multiturn.MultiTurnLoop` over the transformers engine
(:class:`~chatlearn.models.rollout.hf.HFRollout`), the eval prompts at the config's eval
settings, scored with the math reward.

Everything is seeded, so running the script twice on the same machine and software gives
byte-identical files. Usage, from the repository root::

    python tools/build_multiturn_assets.py [--out assets] [--check-vllm]

``--check-vllm`` also runs the evaluation with vLLM (the CPU build works) as the rollout
engine; ``--check-only`` runs the checks on an existing folder without rebuilding it. The
script ends with a report: vocabulary size, parameter count, warm-start steps and time, and,
on the eval split, the accuracy, the tool-call rate, the accuracy of the trajectories that call
the tool and of those that answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

TOOLS_DIR = Path(__file__).resolve().parent
REPO_DIR = TOOLS_DIR.parent
sys.path.insert(0, str(TOOLS_DIR))

# The default assets' builder: environment defaults (offline), the tokenizer pipeline and model
# shape, the data helpers. Importing it sets HF_HUB_OFFLINE and TOKENIZERS_PARALLELISM.
import build_default_assets as base  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()  # no bars for loading and saving a 4 MB model

# --------------------------------------------------------------------------------------
# Task definition
# --------------------------------------------------------------------------------------

DATA_SOURCE = "calc"
A_RANGE = (100, 999)  # three digits
B_RANGE = (10, 99)  # two digits
NUM_EVAL = 200
NUM_TRAIN = 20000
PROMPT_TEMPLATE = "What is {a} * {b}? Put the final answer in \\boxed{{}}."
ANSWER_TEMPLATE = "\\boxed{{{answer}}}"
EXPRESSION_TEMPLATE = "{a} * {b}"

# The config whose multi-turn settings the trajectories and the evaluation follow.
CONFIG = "template/grpo_multiturn.yaml"
TOOL_NAME = "calculator"  # models.policy.multi_turn.tools[0].name in CONFIG

# Tool-call markup (Hermes / Qwen2.5). Added as whole, NON-special tokens: the rollout decodes a
# model turn with skip_special_tokens=True before the environment parses it, and they must stay.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ChatML with tools, Qwen2.5 style: a system message lists the tools; consecutive tool messages
# go into one user turn, each wrapped in <tool_response>.
CHAT_TEMPLATE = """\
{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for tool in tools %}{{- tool.function.name + ': ' + tool.function.description + '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Upper bound; with the tool's description and the JSON of the calls, the corpus saturates
# below it. Plus the four tool tokens; the embedding table is rounded up to a multiple of 64.
TOKENIZER_VOCAB_SIZE = 400
MODEL_SHAPE = base.MODEL_SHAPE  # hidden 128, 4 layers, 4 heads of 32, 2 KV heads, MLP 512, tied


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


def make_record(a: int, b: int, split: str, index: int) -> dict:
    """One example in ChatLearn's data format."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(a=a, b=b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a * b)},
        "extra_info": {"split": split, "index": index},
    }


def make_splits(seed: int, num_train: int) -> tuple[list[dict], list[dict]]:
    """All (a, b) pairs, shuffled; the first NUM_EVAL are the eval split, the next ``num_train``
    the training split."""
    pairs = [(a, b) for a in range(A_RANGE[0], A_RANGE[1] + 1) for b in range(B_RANGE[0], B_RANGE[1] + 1)]
    random.Random(seed).shuffle(pairs)
    eval_pairs, train_pairs = pairs[:NUM_EVAL], pairs[NUM_EVAL : NUM_EVAL + num_train]
    train = [make_record(a, b, "train", i) for i, (a, b) in enumerate(train_pairs)]
    evals = [make_record(a, b, "eval", i) for i, (a, b) in enumerate(eval_pairs)]
    return train, evals


def operands(record: dict) -> tuple[int, int]:
    """(a, b) of a record, read back from its prompt."""
    a, b = re.match(r"What is (\d+) \* (\d+)\?", record["prompt"][0]["content"]).groups()
    return int(a), int(b)


def tool_call_text(a: int, b: int) -> str:
    """The model's tool call for ``a * b``, as the hermes parser reads it."""
    call = {"name": TOOL_NAME, "arguments": {"expression": EXPRESSION_TEMPLATE.format(a=a, b=b)}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def tool_schema() -> dict:
    """The calculator's schema as the rollout passes it to the chat template."""
    from chatlearn.config.env_entries import function_schema
    from chatlearn.env.calculator import calculator
    from chatlearn.env.tools import Tool

    return Tool(TOOL_NAME, calculator, *function_schema(calculator)).schema()


def tokenizer_corpus(records: list[dict]):
    """Text the tokenizer is trained on: every example rendered by the chat template as a tool-path
    conversation (system message with the tool, prompt, call, tool response, answer), cut at the
    special and tool tokens, which enter the vocabulary whole and must not produce merges of their
    own. The direct path's answer is the same ``\\boxed{N}`` text."""
    from chatlearn.data.tokenizer import compile_chat_template
    from chatlearn.env.calculator import calculator

    template = compile_chat_template(CHAT_TEMPLATE)
    tools = [tool_schema()]
    cut = re.compile("|".join(re.escape(t) for t in base.SPECIAL_TOKENS + TOOL_TOKENS))
    for rec in records:
        a, b = operands(rec)
        messages = rec["prompt"] + [
            {"role": "assistant", "content": tool_call_text(a, b)},
            {"role": "tool", "name": TOOL_NAME, "content": calculator(EXPRESSION_TEMPLATE.format(a=a, b=b))},
            {"role": "assistant", "content": ANSWER_TEMPLATE.format(answer=rec["reward_model"]["ground_truth"])},
        ]
        text = template.render(messages=messages, tools=tools, add_generation_prompt=False)
        yield from (piece for piece in cut.split(text) if piece)


def build_tokenizer(records: list[dict]):
    """Train a byte-level BPE tokenizer (the default assets' pipeline) and wrap it for transformers."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(base.PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=base.SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(records), trainer)
    # Whole tokens, matched before the pre-tokenizer, kept by skip_special_tokens=True.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=base.IM_END,
        pad_token=base.ENDOFTEXT,
        unk_token=None,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def check_tokenizer(model_dir: Path, tok) -> None:
    """The folder's tokenizer: ChatLearn's driver tokenizer (``tok``) is the fast path and agrees
    with transformers; tool tokens are whole, non-special and survive skip_special_tokens; exact
    round trips; single-digit tokens; the chat template renders tools and tool messages."""
    from chatlearn.data.tokenizer import FastChatTokenizer
    from transformers import AutoTokenizer

    reference = json.loads((REPO_DIR / "assets" / "tiny_qwen2" / "tokenizer_config.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config.get("tokenizer_class") == reference.get("tokenizer_class"), config.get("tokenizer_class")
    assert isinstance(tok, FastChatTokenizer), f"the driver loads {type(tok).__name__}, not FastChatTokenizer"
    hf = AutoTokenizer.from_pretrained(model_dir)
    tools = [tool_schema()]
    messages = [
        {"role": "user", "content": "What is 123 * 45? Put the final answer in \\boxed{}."},
        {"role": "assistant", "content": tool_call_text(123, 45)},
        {"role": "tool", "name": TOOL_NAME, "content": "5535"},
        {"role": "tool", "name": TOOL_NAME, "content": "error: x"},
        {"role": "assistant", "content": "\\boxed{5535}"},
    ]
    expected = (
        "<|im_start|>system\n# Tools\ncalculator: " + tools[0]["function"]["description"] + "\n<|im_end|>\n"
        "<|im_start|>user\nWhat is 123 * 45? Put the final answer in \\boxed{}.<|im_end|>\n"
        "<|im_start|>assistant\n" + tool_call_text(123, 45) + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n5535\n</tool_response>\n<tool_response>\nerror: x\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n\\boxed{5535}<|im_end|>\n<|im_start|>assistant\n"
    )
    for kwargs in ({}, {"enable_thinking": False}):
        got = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
        assert got == expected, f"chat template gives {got!r}"
        got_hf = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
        assert got_hf == expected, f"transformers' chat template gives {got_hf!r}"
    plain = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>user\n" + messages[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n", plain
    texts = (expected, "\\boxed{98901}", tool_call_text(999, 99) + "\n<tool_call>x", "héllo ✓\n\tx", "I'm 12")
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), f"driver and transformers differ on {text!r}"
        assert tok.decode(ids) == text, f"round trip of {text!r} gives {tok.decode(ids)!r}"
    for t in TOOL_TOKENS:
        ids = tok.encode(t)
        assert len(ids) == 1, f"{t} is not a single token: {ids}"
        assert tok.decode(ids, skip_special_tokens=True) == t, f"{t} is dropped by skip_special_tokens"
    call = tool_call_text(123, 45) + base.IM_END
    assert tok.decode(tok.encode(call), skip_special_tokens=True) == tool_call_text(123, 45)
    digits = hf.tokenize(" 12345")
    assert digits[-5:] == list("12345"), f"digits are not single tokens: {digits}"
    assert hf.eos_token == base.IM_END and hf.pad_token == base.ENDOFTEXT and hf.padding_side == "left"
    print("  tokenizer checks passed: driver fast path agrees with transformers, tool tokens kept, "
          "exact round trips, single digits", flush=True)


# --------------------------------------------------------------------------------------
# Trajectories, token for token as the rollout builds them
# --------------------------------------------------------------------------------------


def load_run_config(out: Path, model_dir: Path):
    """The multi-turn config, pointed at the folders under ``out``, on the transformers engine."""
    from chatlearn.config.load import load_config

    calc = out / "calc"
    return load_config(str(REPO_DIR / CONFIG), [
        "runtime_args.rollout_backend=hf",
        f"runtime_args.data_path={calc / 'train.jsonl'}",
        f"runtime_args.eval_data_path={calc / 'eval.jsonl'}",
        f"models.policy_trainer.load={model_dir}",
    ])


class Trajectories:
    """Supervised examples ``(ids, loss mask)`` of both paths, made with the multi-turn rollout's
    own pieces: its chat template (:class:`~chatlearn.data.turns.TurnTemplate`), its environment
    (the tool is called on the decoded model turn, as in a rollout) and its observation tokens."""

    def __init__(self, mt, tokenizer):
        self.mt, self.tok = mt, tokenizer
        self.eos = tokenizer.backend_tokenizer.token_to_id(base.IM_END)

    def paths(self, record: dict) -> tuple[tuple[list, list], tuple[list, list]]:
        """(tool path, direct path) of ``record``: each (ids, loss mask), the prompt included."""
        a, b = operands(record)
        prompt = self.mt.template.prompt_ids(record["prompt"])
        answer = self.mt.template.encode(ANSWER_TEMPLATE.format(answer=record["reward_model"]["ground_truth"]))
        answer.append(self.eos)
        call = self.mt.template.encode(tool_call_text(a, b)) + [self.eos]
        observation = self.observation(call)
        tool = (prompt + call + observation + answer,
                [0] * len(prompt) + [1] * len(call) + [0] * len(observation) + [1] * len(answer))
        direct = (prompt + answer, [0] * len(prompt) + [1] * len(answer))
        return tool, direct

    def observation(self, call: list[int]) -> list[int]:
        """What the rollout appends after the model turn ``call``: the environment steps on its
        text, and the tool message it returns is rendered by the chat template."""
        env = self.mt.env_cls(**self.mt.env_kwargs)
        env.reset({})
        messages, _, done, info = env.step(self.tok.decode(call, skip_special_tokens=True))
        assert not done and info["tool_calls"] == 1 and not info["tool_errors"], (messages, info)
        ids = self.mt.observation_ids(messages, call[-1])
        assert ids is not None, f"the observation {messages} does not fit max_observation_tokens"
        return ids

    def check_limits(self, examples: list[tuple]) -> dict:
        """The trajectories fit the config's token limits (prompt, turn, observation, response)."""
        mt = self.mt
        lens = {"prompt": [], "call": [], "observation": [], "answer": [], "response": []}
        for ids, mask in examples:
            plen = mask.index(1)
            runs, start = [], plen
            for i in range(plen + 1, len(mask) + 1):
                if i == len(mask) or mask[i] != mask[start]:
                    runs.append((mask[start], i - start))
                    start = i
            lens["prompt"].append(plen)
            lens["call"].append(runs[0][1])
            lens["observation"].append(runs[1][1])
            lens["answer"].append(runs[2][1])
            lens["response"].append(len(ids) - plen)
        assert max(lens["prompt"]) <= mt.max_prompt, f"prompts of {max(lens['prompt'])} tokens"
        assert max(lens["call"] + lens["answer"]) <= mt.max_turn_tokens, "a model turn is too long"
        assert max(lens["observation"]) <= mt.max_observation_tokens, "an observation is too long"
        assert max(lens["response"]) <= mt.max_response, f"responses of {max(lens['response'])} tokens"
        return {k: (min(v), max(v)) for k, v in lens.items()}


# --------------------------------------------------------------------------------------
# Supervised warm start
# --------------------------------------------------------------------------------------


def collate(examples, pad_id: int):
    """Right-padded batch; the loss covers the tokens whose mask is 1 (the model's turns)."""
    length = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for i, (ids, mask) in enumerate(examples):
        row = torch.tensor(ids)
        input_ids[i, : len(ids)] = row
        labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), row, -100)
        attention_mask[i, : len(ids)] = 1
    return input_ids, attention_mask, labels


@torch.no_grad()
def copy_check(model, examples, pad_id: int, tool_id: int) -> dict:
    """On tool-path examples, teacher forced: the share whose every model token after the first
    (the choice to call the tool) is the model's greedy choice, i.e. greedy decoding, once the
    call is started, writes exactly the call and the boxed result; and the mean probability of
    starting with ``<tool_call>``."""
    model.eval()
    input_ids, attention_mask, labels = collate(examples, pad_id)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    target = labels[:, 1:]
    first = (target != -100).int().argmax(dim=1)  # the first model token: the choice
    rows = torch.arange(len(examples))
    p_tool = torch.softmax(logits[rows, first], dim=-1)[:, tool_id]
    scored = target != -100
    scored[rows, first] = False
    exact = ((logits.argmax(-1) == target) | ~scored).all(dim=1)
    return {"copy_accuracy": exact.float().mean().item(), "p_tool": p_tool.mean().item()}


def without_choice(example: tuple[list, list]) -> tuple[list, list]:
    """``example`` with no loss on its first model token (the choice between the paths)."""
    ids, mask = example
    mask = list(mask)
    mask[mask.index(1)] = 0
    return ids, mask


def supervised_warm_start(model, tool_examples, direct_examples, val_examples, pad_id, tool_id, args) -> dict:
    """Next-token loss on the model's tokens of random training examples.

    Each example of a batch is, with probability ``args.copy_share``, a tool-path example without
    loss on its first token (it teaches what follows the choice to call the tool: copying, not
    the choice); otherwise it is drawn on the tool path with probability ``args.tool_fraction``,
    else on the direct path, with loss on every model token. The choice is thus learned from the
    two paths in the ratio ``tool_fraction`` : ``1 - tool_fraction`` alone, so that the model
    calls the tool about that often at temperature 1, while most of each batch teaches copying
    (the direct answers, products the model cannot compute, teach it little).

    Copying (the operands into the call, the tool's result into the answer) is learned in a jump
    whose place moves with small numerical differences, so the constant learning rate phase ends at
    the first check where the greedy copy accuracy on the validation examples reaches
    ``args.target_copy_accuracy`` rather than after a fixed step count. At that learning rate the
    probability of the choice still swings from batch to batch, so ``args.cooldown_steps`` more
    steps follow with the learning rate decaying linearly to 0: it settles near
    ``args.tool_fraction``.
    """
    gen = torch.Generator().manual_seed(args.seed + 1)  # batch order, independent of the checks
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start = time.perf_counter()

    def train_step(lr: float) -> float:
        model.train()
        for group in optimizer.param_groups:
            group["lr"] = lr
        idx = torch.randint(len(tool_examples), (args.batch_size,), generator=gen).tolist()
        copy = (torch.rand(args.batch_size, generator=gen) < args.copy_share).tolist()
        tool = (torch.rand(args.batch_size, generator=gen) < args.tool_fraction).tolist()
        batch = [without_choice(tool_examples[i]) if c else tool_examples[i] if t else direct_examples[i]
                 for i, c, t in zip(idx, copy, tool)]
        input_ids, attention_mask, labels = collate(batch, pad_id)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    def report(step: int, loss: float, check: dict) -> None:
        print(f"  sft step {step:4d}  loss {loss:.4f}  validation copy accuracy {check['copy_accuracy']:.3f}  "
              f"P(tool call) {check['p_tool']:.3f}", flush=True)

    step, check = 0, {"copy_accuracy": 0.0, "p_tool": 0.0}
    while step < args.max_sft_steps:
        loss = train_step(args.lr * min(1.0, (step + 1) / args.warmup))  # linear warm-up, then constant
        step += 1
        if step >= args.min_sft_steps and step % args.check_every == 0:
            check = copy_check(model, val_examples, pad_id, tool_id)
            report(step, loss, check)
            if check["copy_accuracy"] >= args.target_copy_accuracy:
                break
        elif step % 50 == 0:
            print(f"  sft step {step:4d}  loss {loss:.4f}", flush=True)
    target_step = step
    for k in range(args.cooldown_steps):
        loss = train_step(args.lr * (1 - (k + 1) / (args.cooldown_steps + 1)))
        step += 1
    if args.cooldown_steps:
        check = copy_check(model, val_examples, pad_id, tool_id)
        report(step, loss, check)
    model.eval()
    return {"steps": step, "target_step": target_step, "seconds": time.perf_counter() - start, **check}


# --------------------------------------------------------------------------------------
# Evaluation with the real rollout
# --------------------------------------------------------------------------------------


def rollout_spec(cfg, threads: int):
    """The rollout engine's settings, from the config as the run derives them (on the CPU)."""
    from chatlearn.models.specs import RolloutSpec, resolve_for_device

    spec = resolve_for_device(RolloutSpec.from_config(cfg), "cpu")
    return dataclasses.replace(spec, cpu_threads=threads)


def sampling_settings(cfg, eval_mode: bool) -> dict:
    """The sampling settings of the run's rollouts (eval or training), as ``Sampling.params``
    gives them, seeded with the policy's seed as the run's evaluation is."""
    p = cfg.models.policy
    pre = "eval_" if eval_mode else ""
    keys = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty")
    return {**{k: p[pre + k] for k in keys}, "max_tokens": p.max_response_tokens_length, "seed": p.seed}


def rollout_evaluate(cfg, mt, tokenizer, engine, samples: int, eval_mode: bool) -> dict:
    """Trajectories of the eval prompts (``samples`` each) by ``mt`` over ``engine``'s generate,
    scored with the math reward on the decoded response (model turns and tool results, without
    special tokens), as the run scores them. Accuracy overall, among the trajectories that called
    the tool and among those that did not; the tool-call rate; how the trajectories ended."""
    import numpy as np
    from chatlearn.data.dataset import load_prompts
    from chatlearn.models.reward.math_reward import math_reward
    from chatlearn.runtime.driver.multiturn import STATUSES
    from chatlearn.runtime.driver.sampling import Prompts

    rt, p = cfg.runtime_args, cfg.models.policy
    prompt_set = load_prompts(rt.eval_data_path.split(","), tokenizer, max_prompt_tokens=p.max_prompt_tokens_length,
                              enable_thinking=p.enable_thinking, prompt_key=rt.prompt_key,
                              ground_truth_key=rt.ground_truth_key, what="runtime_args.eval_data_path",
                              tools=mt.tool_schemas)
    assert len(prompt_set) == NUM_EVAL and not prompt_set.dropped_too_long
    prompts = Prompts.of(prompt_set, range(len(prompt_set)), samples)
    sampling = sampling_settings(cfg, eval_mode)

    def generate(ids, sp):  # one rollout replica: its seed as Sampling.generate derives it
        return engine.generate(ids, {**sp, "seed": sp["seed"] * 1000})

    start = time.perf_counter()
    batch = mt.run(generate, prompts, sampling, "the evaluation set")
    seconds = time.perf_counter() - start
    off, plen, tokens = batch["offsets"], batch["prompt_lens"], batch["tokens"]
    texts = tokenizer.batch_decode([tokens[off[i] + plen[i] : off[i + 1]] for i in range(len(plen))],
                                   skip_special_tokens=True)
    n = len(texts)
    correct = np.array(math_reward(prompts=[""] * n, responses=texts, ground_truths=prompts.truths,
                                   data_sources=prompts.sources, extra=prompts.extra, correct_score=1.0,
                                   incorrect_score=0.0)) > 0
    info = [json.loads(str(s)) for s in batch["env/info"]]
    called = np.array([x.get("tool_calls", 0.0) > 0 for x in info])
    status = np.asarray(batch["env/status"])
    model_tokens = np.asarray(batch["loss_mask"]).sum() / n

    def share(mask):
        return float(mask.mean()) if len(mask) else float("nan")

    return {
        "accuracy": share(correct),
        "tool_call_rate": share(called),
        "accuracy_with_tool": share(correct[called]),
        "accuracy_direct": share(correct[~called]),
        "tool_errors": float(np.mean([x.get("tool_errors", 0.0) + x.get("tool_parse_errors", 0.0) for x in info])),
        "status": {name: float(np.mean(status == k)) for k, name in enumerate(STATUSES)},
        "turns_mean": float(np.mean(batch["env/turns"])),
        "model_tokens_mean": float(model_tokens),
        "trajectories": n,
        "samples": samples,
        "sampling": {k: sampling[k] for k in ("temperature", "top_p", "top_k")},
        "seconds": seconds,
        "example": next((t for t, c in zip(texts, called) if c), texts[0]),
    }


def describe(r: dict) -> str:
    return (f"accuracy {r['accuracy']:.3f}; tool-call rate {r['tool_call_rate']:.3f}; accuracy with the tool "
            f"{r['accuracy_with_tool']:.3f}, answering at once {r['accuracy_direct']:.3f}; done "
            f"{r['status']['done']:.3f}; tool errors {r['tool_errors']:.3f}  "
            f"[{r['trajectories']} trajectories, {r['seconds']:.1f} s]")


# --------------------------------------------------------------------------------------
# README
# --------------------------------------------------------------------------------------

README_HEADING = "## Multi-turn assets: `calc/` and `tiny_qwen2_tools/`"


def readme_section(info: dict) -> str:
    """The README's section on these folders. Only deterministic numbers go here, so that
    rebuilds match."""
    e, t, s = info["eval"], info["train_sampling"], info["sft"]
    shape = MODEL_SHAPE

    def settings(r):
        return ", ".join(f"{k} {v}" for k, v in r["sampling"].items()) + f"; {r['samples']} per prompt"

    def row(name, r):
        return (f"| {name} ({settings(r)}) | {r['accuracy']:.3f} | {r['tool_call_rate']:.3f} | "
                f"{r['accuracy_with_tool']:.3f} | {r['accuracy_direct']:.3f} |")

    return f"""{README_HEADING}

The task and model of the multi-turn example (`template/grpo_multiturn.yaml`: GRPO where the
model may call a calculator tool between its turns). Generated, seeded, by
`tools/build_multiturn_assets.py`; rebuild them (and this section) from the repository root with

    python tools/build_multiturn_assets.py --out assets

It takes a few minutes on a CPU; `--check-vllm` also evaluates the model with vLLM as the
rollout engine.

### `calc/`: the task

`a * b` with `a` in {A_RANGE[0]}..{A_RANGE[1]} and `b` in {B_RANGE[0]}..{B_RANGE[1]}, answered as `\\boxed{{N}}`.
`eval.jsonl`: {info["num_eval"]} pairs; `train.jsonl`: {info["num_train"]} others, shuffled. One JSON object a line:

    {info["example"]}

### `tiny_qwen2_tools/`: the model

A Hugging Face `Qwen2ForCausalLM` folder that transformers, vLLM and ChatLearn's driver
tokenizer load offline.

- Shape: {info["num_params"]:,} parameters in fp32; hidden {shape["hidden_size"]}, \
{shape["num_hidden_layers"]} layers, {shape["num_attention_heads"]} heads of size \
{shape["hidden_size"] // shape["num_attention_heads"]}, {shape["num_key_value_heads"]} KV heads, \
MLP {shape["intermediate_size"]}, tied embeddings, vocabulary {info["model_vocab"]}.
- Tokenizer: byte-level BPE with {info["tokenizer_vocab"]} tokens trained on the task's text, the tool
  calls, the tool's description and the chat template's text; every digit is a token of its own.
  `<tool_call>`, `</tool_call>`, `<tool_response>` and `</tool_response>` are whole tokens and not
  special ones, so that the text the environment parses (decoded with
  `skip_special_tokens=True`) keeps them. eos `<|im_end|>`; padding `<|endoftext|>`, on the left.
- Chat template: ChatML; with `tools`, a system message lists each tool as `name: description`,
  and `tool` messages go into a user turn, each wrapped in `<tool_response>` (as Qwen2.5 does).
- Weights: random init, then a supervised warm start on trajectories built as the multi-turn
  rollout builds them (the config's environment, tool and chat template), loss on the model's
  tokens only (batch {info["batch_size"]}, lr {info["lr"]}). In a share {info["tool_fraction"]} of the examples the model
  calls the tool and copies its result:

      <tool_call>
      {{"name": "calculator", "arguments": {{"expression": "A * B"}}}}
      </tool_call>          (then the tool's answer, then)          \\boxed{{A*B}}

  in the others it answers `\\boxed{{A*B}}` at once, which it cannot compute. A further share
  {info["copy_share"]} of each batch are tool-path examples with no loss on their first token (the choice
  to call the tool): they teach copying without changing how often the model calls the tool
  (at temperature 1, about {info["tool_fraction"]} of the time). The learning rate stays constant until
  greedy copying (teacher forced, after the choice to call the tool) is exact on a share {info["target"]}
  of {info["num_val"]} training examples it does not train on, here after {s["target_step"]} steps, then decays
  linearly to 0 over {info["cooldown"]} more. At the end copying is exact on a share {s["copy_accuracy"]:.3f} of
  them, and the probability of calling the tool is {s["p_tool"]:.3f}. The model calls the tool only
  some of the time and is then nearly always right; its direct answers are nearly always wrong,
  so RL has a clear way to more reward.

Measured at build time on the eval split ({info["num_eval"]} prompts) with ChatLearn's multi-turn rollout
(the config's `multi_turn` settings, the transformers engine), scored with the math reward:

| sampling | accuracy | tool-call rate | accuracy with the tool | accuracy answering at once |
|---|---|---|---|---|
{row("eval", e)}
{row("training", t)}
"""


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="assets", help="output folder (default: assets)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-train", type=int, default=NUM_TRAIN, help="training pairs")
    p.add_argument("--tool-fraction", type=float, default=0.3,
                   help="share of warm-start examples that call the tool, the rest answering at once (the model "
                        "calls the tool about this often at temperature 1)")
    p.add_argument("--copy-share", type=float, default=0.5,
                   help="share of warm-start examples that teach the tool path without the choice to take it")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    p.add_argument("--target-copy-accuracy", type=float, default=0.97,
                   help="keep the learning rate constant until greedy copy accuracy on validation examples "
                        "reaches this")
    p.add_argument("--cooldown-steps", type=int, default=100,
                   help="steps after the target, the learning rate decaying linearly to 0")
    p.add_argument("--min-sft-steps", type=int, default=100)
    p.add_argument("--max-sft-steps", type=int, default=3000)
    p.add_argument("--check-every", type=int, default=25, help="steps between validation checks")
    p.add_argument("--num-val", type=int, default=200, help="validation examples held out of the warm start")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--check-vllm", action="store_true", help="also evaluate with vLLM as the rollout engine")
    p.add_argument("--check-only", action="store_true", help="check an existing folder; build nothing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out).resolve()
    model_dir, data_dir = out / "tiny_qwen2_tools", out / "calc"
    t0 = time.perf_counter()
    from chatlearn.data.dataset import load_tokenizer
    from chatlearn.runtime.driver.multiturn import MultiTurnLoop

    sft = None
    if not args.check_only:
        train, evals = make_splits(args.seed, args.num_train)
        # The warm start holds out the last examples of the training split to decide when to stop;
        # they stay in train.jsonl for RL.
        sft_train, val = train[: -args.num_val], train[-args.num_val :]
        train_keys = {r["prompt"][0]["content"] for r in train}
        assert not any(r["prompt"][0]["content"] in train_keys for r in evals)

        for d in (model_dir, data_dir):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        base.write_jsonl(data_dir / "train.jsonl", train)
        base.write_jsonl(data_dir / "eval.jsonl", evals)

        hf_tokenizer = build_tokenizer(train + evals)
        model = base.build_model(hf_tokenizer, args.seed)
        # The folder is complete from here on (random weights until the warm start is saved), so
        # that the config validates and the tokenizer loads from it as a run loads it.
        hf_tokenizer.save_pretrained(model_dir)
        model.save_pretrained(model_dir)
        num_params = sum(p.numel() for p in model.parameters())

        cfg = load_run_config(out, model_dir)
        tok = load_tokenizer(str(model_dir), trust_remote_code=False, key="models.policy.load")
        check_tokenizer(model_dir, tok)
        mt = MultiTurnLoop(cfg, tok)
        assert mt.tool_schemas == [tool_schema()], mt.tool_schemas

        traj = Trajectories(mt, tok)
        tool_examples, direct_examples = zip(*(traj.paths(r) for r in sft_train))
        val_examples = [traj.paths(r)[0] for r in val]
        lens = traj.check_limits(list(tool_examples) + val_examples)
        print(f"tokenizer: {len(tok)} tokens (model vocabulary {model.config.vocab_size}); "
              f"model: {num_params:,} parameters; tool-path token counts (min, max): "
              + ", ".join(f"{k} {v}" for k, v in lens.items()), flush=True)
        print(f"  e.g. {tok.decode(tool_examples[0][0])!r}", flush=True)

        pad_id = tok.backend_tokenizer.token_to_id(base.ENDOFTEXT)
        tool_id = tok.backend_tokenizer.token_to_id(TOOL_TOKENS[0])
        sft = supervised_warm_start(model, tool_examples, direct_examples, val_examples, pad_id, tool_id, args)
        model.save_pretrained(model_dir)
        del model
    else:
        train = base.read_jsonl(data_dir / "train.jsonl")
        evals = base.read_jsonl(data_dir / "eval.jsonl")
        cfg = load_run_config(out, model_dir)
        tok = load_tokenizer(str(model_dir), trust_remote_code=False, key="models.policy.load")
        check_tokenizer(model_dir, tok)
        mt = MultiTurnLoop(cfg, tok)

    # Everything below reads the folder back, as a run does.
    from chatlearn.models.rollout.hf import HFRollout

    print("evaluating the written folder with the multi-turn rollout", flush=True)
    engine = HFRollout(rollout_spec(cfg, args.threads))
    num_params = sum(p.numel() for p in engine.model.parameters())
    p = cfg.models.policy
    result = rollout_evaluate(cfg, mt, tok, engine, p.eval_num_inference_per_prompt, eval_mode=True)
    train_result = rollout_evaluate(cfg, mt, tok, engine, p.eval_num_inference_per_prompt, eval_mode=False)

    info = dict(
        num_train=len(train),
        num_eval=len(evals),
        num_params=num_params,
        model_vocab=engine.model.config.vocab_size,
        tokenizer_vocab=len(tok),
        sft=sft,
        batch_size=args.batch_size,
        lr=args.lr,
        tool_fraction=args.tool_fraction,
        copy_share=args.copy_share,
        cooldown=args.cooldown_steps,
        num_val=args.num_val,
        target=args.target_copy_accuracy,
        example=json.dumps(evals[0], ensure_ascii=False),
        eval=result,
        train_sampling=train_result,
    )
    del engine
    if not args.check_only:
        base.replace_section(out / "README.md", readme_section(info))

    vllm_result = None
    if args.check_vllm:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # as a run's rollout workers have it
        from chatlearn.models.rollout.vllm import VLLMRollout

        start = time.perf_counter()
        engine = VLLMRollout(rollout_spec(cfg, args.threads))
        load_s = time.perf_counter() - start
        vllm_result = rollout_evaluate(cfg, mt, tok, engine, p.eval_num_inference_per_prompt, eval_mode=True)
        vllm_result["load_s"] = load_s

    # Report.
    print("\n=== multi-turn assets ===")
    print(f"output folder        {out}")
    print(f"data                 {len(train)} train / {len(evals)} eval examples")
    print(f"tokenizer vocabulary {len(tok)} (model vocabulary {info['model_vocab']})")
    print(f"parameters           {num_params:,}")
    if sft is not None:
        print(f"warm start           {sft['steps']} steps ({sft['target_step']} to the copy target), batch "
              f"{args.batch_size}, lr {args.lr}, tool fraction {args.tool_fraction}, copy share {args.copy_share}: "
              f"{sft['seconds']:.1f} s; validation copy accuracy {sft['copy_accuracy']:.3f}, "
              f"P(tool call) {sft['p_tool']:.3f}")
    print("eval split, multi-turn rollout on HF generate")
    print(f"  eval sampling      {describe(result)}")
    print(f"  training sampling  {describe(train_result)}")
    print(f"  e.g.               {result['example']!r}")
    if vllm_result is not None:
        print(f"eval split, multi-turn rollout on vLLM (engine start {vllm_result['load_s']:.1f} s)")
        print(f"  eval sampling      {describe(vllm_result)}")
    # The intended operating point: some reward, from the tool; none without it.
    if not (0.1 <= result["accuracy"] <= 0.35 and result["accuracy_with_tool"] >= 0.85
            and result["accuracy_direct"] <= 0.02):
        print("WARNING: the model is outside its intended range (accuracy 0.1 to 0.35, with the tool >= 0.85, "
              "answering at once about 0); adjust --tool-fraction, --target-copy-accuracy or --lr")
    for f in sorted(q for d in (data_dir, model_dir) for q in d.rglob("*") if q.is_file()):
        print(f"  {f.relative_to(out)!s:40s} {f.stat().st_size:>10,d} bytes")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
