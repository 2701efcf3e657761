#!/usr/bin/env python
"""Build ``tiny_rm/``: a tiny reward model for the arith task of ChatLearn's default assets.

A Hugging Face ``Qwen2ForSequenceClassification`` (one label) with the shape of ``tiny_qwen2/``,
its backbone started from ``tiny_qwen2``'s weights (which already know the task) and its score
head from a seeded random init, and ``tiny_qwen2``'s tokenizer and ChatML chat template. The whole
model is trained, on the training split only, to score a conversation (the prompt, then the
assistant's response) higher when the response's ``\\boxed{}`` answer is the sum:

* each training pair is a prompt with its correct response ``\\boxed{a+b}`` (the format
  ``tiny_qwen2`` answers in) and a wrong one: a near miss (the sum +-1, +-2, +-9, +-10, +-11,
  +-20, +-100), the sum with one digit changed, its digits swapped, a digit added or dropped, a
  random number, an answer ``tiny_qwen2`` sampled itself (temperature 1) that is wrong, or a
  malformed answer (no ``\\boxed``, an empty or unclosed box, text in the box);
* the loss is the pairwise Bradley-Terry loss ``-log sigmoid(r_correct - r_wrong)`` plus a binary
  cross-entropy term on each score (correct: 1, wrong: 0), so that the scores rank the
  responses of a prompt and ``r > 0`` also reads as "correct", plus the next-token loss of the
  correct response through the tied embeddings (``tiny_qwen2``'s language-model head, which the
  reward model does not keep): it goes on teaching the backbone to compute the sum, which is what
  the score head compares the answer with (without it the same steps end far less accurate);
* conversations are rendered exactly as ``chatlearn.models.reward.model.RewardModel`` renders
  them (the chat template, no special tokens added), and scored at the last token.

Measured at the end, reading the written folder back with ``RewardModel`` (the backend a run
uses), on the eval split: pairwise accuracy (correct above wrong) for each kind of wrong answer,
and the reward model as a judge of ``tiny_qwen2``'s own sampled answers (temperature 1):
agreement of ``r > 0`` with the rule (correct iff the boxed number is ``a + b``), the ROC AUC, and
the share of (correct, wrong) pairs of answers to the same prompt that it ranks right (what GRPO's
group-normalised advantages use).

Everything is seeded: running it twice on the same machine and software (and ``--threads``) gives
byte-identical weights. Usage, from the repository root (after ``build_default_assets.py``)::

    python tools/build_reward_model_assets.py [--out assets]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from chatlearn.models.reward.math_reward import MathReward  # noqa: E402  (the rule the runs use)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_default_assets import replace_section  # noqa: E402  (the asset builders' one README writer)

RESPONSE_TEMPLATE = "\\boxed{{{answer}}}"  # tiny_qwen2's answer format (tools/build_default_assets.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MAX_NEW_TOKENS = 16
RULE = MathReward({"correct_score": 1.0, "incorrect_score": 0.0})

# The kinds of wrong answers a training pair draws from, with their weights.
NEGATIVE_KINDS = {"near": 0.25, "digit": 0.15, "swap": 0.03, "length": 0.05, "random": 0.1,
                  "policy": 0.32, "malformed": 0.1}
NEAR_OFFSETS = (1, -1, 2, -2, 9, -9, 10, -10, 11, -11, 20, -20, 100, -100)


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def answer_of(record: dict) -> int:
    return int(record["reward_model"]["ground_truth"])


def boxed(n) -> str:
    return RESPONSE_TEMPLATE.format(answer=n)


def wrong_number(s: int, kind: str, rng: random.Random) -> int:
    """A non-negative integer other than ``s``, of the given kind of mistake."""
    digits = str(s)
    for _ in range(100):
        if kind == "near":
            n = s + rng.choice(NEAR_OFFSETS)
        elif kind == "digit":
            i = rng.randrange(len(digits))
            n = int(digits[:i] + rng.choice("0123456789".replace(digits[i], "")) + digits[i + 1:])
        elif kind == "swap" and len(digits) > 1:
            i = rng.randrange(len(digits) - 1)
            n = int(digits[:i] + digits[i + 1] + digits[i] + digits[i + 2:])
        elif kind == "length":
            i = rng.randrange(len(digits) + 1)
            n = (int(digits[:i] + rng.choice("0123456789") + digits[i:]) if rng.random() < 0.5 or len(digits) == 1
                 else int(digits[:i] + digits[i + 1:] or "0"))
        else:  # random (and swap of a one-digit sum)
            n = rng.randrange(0, 199)
        if n >= 0 and n != s:
            return n
    return s + 1


def malformed(s: int, rng: random.Random) -> str:
    """A response the rule scores wrong although it may hold the sum."""
    options = [
        str(s),  # no box
        f"The answer is {s}.",
        "\\boxed{}",
        f"\\boxed{{{s}",  # unclosed
        f"\\boxed{{{s}}}\\boxed{{}}",  # the last box is empty
        f"\\boxed{{{s}{rng.choice('+?x ')}}}",
        f"\\boxed{{{s} {rng.choice(['the', 'Put', 'What', 'is'])}}}",
        f"\\boxed{{boxed{s}}}",
        "",
    ]
    return rng.choice(options)


def negative(record: dict, rng: random.Random, policy_wrong: dict) -> tuple[str, str]:
    """``(kind, response)``: a wrong response to ``record``'s prompt."""
    s = answer_of(record)
    kinds, weights = zip(*NEGATIVE_KINDS.items())
    kind = rng.choices(kinds, weights)[0]
    key = record["prompt"][0]["content"]
    if kind == "policy" and policy_wrong.get(key):
        return kind, rng.choice(policy_wrong[key])
    if kind == "policy":
        kind = "near"
    if kind == "malformed":
        return kind, malformed(s, rng)
    return kind, boxed(wrong_number(s, kind, rng))


def conversation(record: dict, response: str) -> list[dict]:
    return [*record["prompt"], {"role": "assistant", "content": response}]


def render(tokenizer, conv: list[dict]) -> list[int]:
    """As ``RewardModel.render``: the chat template, then no special tokens added."""
    text = tokenizer.apply_chat_template(conv, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------------------
# The policy's own answers
# --------------------------------------------------------------------------------------


@torch.no_grad()
def sample_policy(model_dir: Path, records: list[dict], samples: int, seed: int,
                  chunk: int = 512) -> list[str]:
    """``samples`` responses per record from the causal LM at ``model_dir`` (temperature 1, as a
    training rollout samples), decoded without special tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
               for r in records for _ in range(samples)]
    torch.manual_seed(seed)
    out = []
    for i in range(0, len(prompts), chunk):
        batch = tok(prompts[i:i + chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        gen = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        out += tok.batch_decode(gen[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def is_correct(response: str, record: dict) -> bool:
    return RULE.is_correct(response, record["reward_model"]["ground_truth"])


# --------------------------------------------------------------------------------------
# Model and training
# --------------------------------------------------------------------------------------


def build_model(policy_dir: Path, pad_id: int, seed: int):
    """``Qwen2ForSequenceClassification`` (one label) with ``policy_dir``'s backbone weights."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        policy_dir, num_labels=1, dtype=torch.float32, pad_token_id=pad_id)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.02)  # seeded; from_pretrained's init of a missing head is not
    model.config.architectures = ["Qwen2ForSequenceClassification"]
    model.config.pad_token_id = pad_id
    model.config.use_cache = False
    return model


def forward(model, rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scores, hidden, ids)``: float32 [B] scores at each row's last token (right padding), as
    ``RewardModel`` pools, the last hidden states and the padded ids."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    last = mask.sum(1) - 1
    return model.score(hidden[torch.arange(len(rows)), last]).float()[:, 0], hidden, ids


def answer_lm_loss(model, hidden: torch.Tensor, ids: torch.Tensor, starts: list[int],
                   ends: list[int]) -> torch.Tensor:
    """Next-token loss of the response tokens (``[start, end)`` of each row) through the tied
    embeddings: the language-model head ``tiny_qwen2`` computes the sum with, kept learning the
    task beside the score head (the reward model has no head of its own for it)."""
    rows = torch.cat([torch.full((e - s,), i) for i, (s, e) in enumerate(zip(starts, ends))])
    cols = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)])
    logits = hidden[rows, cols - 1] @ model.model.embed_tokens.weight.T
    return torch.nn.functional.cross_entropy(logits.float(), ids[rows, cols])


def train(model, tokenizer, records: list[dict], policy_wrong: dict, args) -> dict:
    """Pairwise Bradley-Terry loss plus ``--bce`` x binary cross-entropy, AdamW with a linear
    warm-up and a cosine decay to 0, over ``--steps`` batches of ``--batch-size`` pairs."""
    rng = random.Random(args.seed)
    pad_id = tokenizer.pad_token_id
    cache: dict = {}

    def ids(rec, response):
        key = (rec["prompt"][0]["content"], response)
        if key not in cache:
            cache[key] = render(tokenizer, conversation(rec, response))
        return cache[key]

    def prompt_len(rec):
        key = (rec["prompt"][0]["content"], None)
        if key not in cache:
            cache[key] = len(tokenizer.apply_chat_template(rec["prompt"], tokenize=True, add_generation_prompt=True,
                                                           return_dict=False))
        return cache[key]

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    start, log = time.perf_counter(), []
    model.train()
    for step in range(args.steps):
        frac = step / max(1, args.steps)
        warm = min(1.0, (step + 1) / args.warmup)
        for group in opt.param_groups:
            group["lr"] = args.lr * warm * 0.5 * (1 + torch.cos(torch.tensor(frac * torch.pi)).item())
        batch = [records[rng.randrange(len(records))] for _ in range(args.batch_size)]
        pos = [ids(r, boxed(answer_of(r))) for r in batch]
        neg = [ids(r, negative(r, rng, policy_wrong)[1]) for r in batch]
        r, hidden, padded = forward(model, pos + neg, pad_id)
        rp, rn = r[:len(batch)], r[len(batch):]
        bt = -torch.nn.functional.logsigmoid(rp - rn).mean()
        bce = 0.5 * (-torch.nn.functional.logsigmoid(rp).mean() - torch.nn.functional.logsigmoid(-rn).mean())
        loss = bt + args.bce * bce
        if args.lm > 0:
            starts = [prompt_len(rec) for rec in batch]
            loss = loss + args.lm * answer_lm_loss(model, hidden, padded, starts, [len(p) for p in pos])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        acc = (rp > rn).float().mean().item()
        log.append((loss.item(), acc))
        if (step + 1) % 50 == 0:
            n = len(log[-50:])
            print(f"  rm step {step + 1:5d}  loss {sum(x for x, _ in log[-50:]) / n:.4f}  "
                  f"pair accuracy {sum(a for _, a in log[-50:]) / n:.3f}  "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    model.eval()
    return {"steps": args.steps, "seconds": time.perf_counter() - start}


# --------------------------------------------------------------------------------------
# Evaluation, with the backend a run uses
# --------------------------------------------------------------------------------------


def load_backend(rm_dir: Path, micro_batch_size: int = 256):
    """``RewardModel`` on the folder, one rank of its own process group."""
    from chatlearn.models.reward.model import RewardModel
    from chatlearn.models.specs import RewardModelSpec

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    spec = RewardModelSpec(load=str(rm_dir), trust_remote_code=False, seed=0, micro_batch_size=micro_batch_size,
                           max_length=256, bf16=False)
    return RewardModel(spec)


def pairwise_accuracy(rm, records: list[dict], seed: int) -> dict:
    """Share of eval prompts whose correct response scores above a wrong one, per kind of wrong answer
    (one wrong answer per prompt and kind, drawn with ``seed``)."""
    rng = random.Random(seed)
    kinds = ("near", "digit", "swap", "length", "random", "malformed")
    convs = [conversation(r, boxed(answer_of(r))) for r in records]
    for kind in kinds:
        for r in records:
            s = answer_of(r)
            text = malformed(s, rng) if kind == "malformed" else boxed(wrong_number(s, kind, rng))
            convs.append(conversation(r, text))
    sc = rm.score(convs).reshape(len(kinds) + 1, len(records))
    out = {kind: float((sc[0] > sc[i + 1]).mean()) for i, kind in enumerate(kinds)}
    out["number mistakes (all but malformed)"] = float((sc[0] > sc[1:-1]).mean())
    out["correct scored > 0"] = float((sc[0] > 0).mean())
    return out


def judge(rm, records: list[dict], responses: list[str], samples: int) -> dict:
    """The reward model as a judge of sampled answers: agreement of ``score > 0`` with the rule, ROC
    AUC, and the share of (correct, wrong) pairs to one prompt ranked right."""
    rule = [is_correct(t, records[k // samples]) for k, t in enumerate(responses)]
    sc = rm.score([conversation(records[k // samples], t) for k, t in enumerate(responses)])
    agree = sum((s > 0) == c for s, c in zip(sc, rule)) / len(rule)
    pos = [s for s, c in zip(sc, rule) if c]
    neg = [s for s, c in zip(sc, rule) if not c]
    auc = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / max(1, len(pos) * len(neg))
    right = total = 0
    for i in range(len(records)):
        group = list(zip(sc[i * samples:(i + 1) * samples], rule[i * samples:(i + 1) * samples]))
        for p, cp in group:
            for n, cn in group:
                if cp and not cn:
                    total += 1
                    right += p > n
    return {"responses": len(rule), "rule accuracy": sum(rule) / len(rule), "agreement (score > 0)": agree,
            "roc auc": auc, "group pairs": total, "group pairs ranked right": right / max(1, total)}


# --------------------------------------------------------------------------------------
# README
# --------------------------------------------------------------------------------------

HEADING = "## Reward model: `tiny_rm/`"


KIND_LABELS = {"near": "near miss: the sum +-1, +-2, +-9, +-10, +-11, +-20 or +-100",
               "digit": "one digit of the sum changed", "swap": "two digits of the sum swapped",
               "length": "a digit added to or dropped from the sum", "random": "a random number in 0..198",
               "malformed": "malformed: no box, an empty or unclosed box, text in the box",
               "number mistakes (all but malformed)": "all the wrong numbers above"}


def write_readme(path: Path, info: dict) -> None:
    """Put this script's section into ``path``, keeping the other sections as they are."""
    pw, jd = info["pairwise"], info["judge"]
    rows = "\n".join(f"| {label} | {pw[kind]:.3f} |" for kind, label in KIND_LABELS.items())
    section = f"""{HEADING}

A tiny reward model for the arith task, for examples and tests of reward-model scoring
(`models.reward.load`). Generated, seeded, by `tools/build_reward_model_assets.py` (after
`tools/build_default_assets.py`, whose task and model it starts from); rebuild it (and this
section) from the repository root with

    python tools/build_reward_model_assets.py --out assets

It takes about ten minutes on one CPU core (`--threads`; longer when other processes share it).
Most of the accuracy comes late, once the backbone picks up carrying: trained for 300 steps
instead, it ends at a pairwise accuracy of about 0.93 on wrong numbers and a ROC AUC as a judge
of `tiny_qwen2/` (below) under 0.8.

- Model: a Hugging Face `Qwen2ForSequenceClassification` with one label (a scalar score read at
  the conversation's last token), {info["num_params"]:,} parameters in fp32, the shape of `tiny_qwen2/`;
  `tiny_qwen2/`'s tokenizer and ChatML chat template; `pad_token_id` {info["pad_id"]} (`<|endoftext|>`).
  It scores a conversation rendered with its chat template: the prompt's messages, then the
  assistant's response, e.g. `\\boxed{{67}}`.
- Training: the backbone from `tiny_qwen2/`'s weights, the score head from a seeded random init;
  the whole model trained on the training split only, {info["train"]["steps"]} steps of \
{info["batch_size"]} pairs (lr {info["lr"]},
  warm-up then cosine decay). Loss: `-log sigmoid(r_correct - r_wrong)`, plus {info["bce"]} x binary
  cross-entropy on each score (so that `score > 0` reads as correct), plus {info["lm"]} x the next-token
  loss of the correct response through the tied embeddings (which keeps the backbone learning
  the sum). The correct response is `\\boxed{{a+b}}`; the wrong one a near miss (the sum +-1, +-2,
  +-9, +-10, +-11, +-20, +-100), a changed, swapped, added or dropped digit, a random number, a
  wrong answer `tiny_qwen2/` sampled itself at temperature 1 ({info["policy_prompts"]} training prompts, \
{info["policy_samples"]}
  samples each), or a malformed answer (no box, an empty or unclosed box, text in the box).

Measured at build time on the eval split ({info["num_eval"]} prompts) with ChatLearn's `RewardModel`
backend reading the folder. Pairwise accuracy: the share of prompts whose correct response
scores above a wrong one (one wrong response per prompt and kind); the correct response alone
scores above 0 for a share {pw["correct scored > 0"]:.3f} of them.

| wrong answer | pairwise accuracy |
|---|---|
{rows}

As a judge of `tiny_qwen2/`'s own answers (Hugging Face `generate`, temperature 1,
{info["judge_samples"]} per prompt: {jd["responses"]} answers, of which a share \
{jd["rule accuracy"]:.3f} are right by the rule,
i.e. the boxed number equals a + b):

| measure | value |
|---|---|
| agreement of `score > 0` with the rule | {jd["agreement (score > 0)"]:.3f} |
| ROC AUC (right answers above wrong ones) | {jd["roc auc"]:.3f} |
| (right, wrong) answer pairs to one prompt ranked right ({jd["group pairs"]} pairs) | \
{jd["group pairs ranked right"]:.3f} |
"""
    replace_section(path, section)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="assets", help="the assets folder (default: assets)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=64, help="pairs per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--bce", type=float, default=0.5, help="weight of the binary cross-entropy term")
    p.add_argument("--lm", type=float, default=1.0, help="weight of the answer's next-token loss")
    p.add_argument("--policy-prompts", type=int, default=1500,
                   help="training prompts tiny_qwen2 answers, for its wrong answers as negatives")
    p.add_argument("--policy-samples", type=int, default=2, help="answers per such prompt")
    p.add_argument("--judge-samples", type=int, default=4, help="tiny_qwen2 answers per eval prompt judged")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the least hurt when other processes share the cores)")
    p.add_argument("--check-only", action="store_true", help="measure an existing tiny_rm/; build nothing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    policy_dir, rm_dir = out / "tiny_qwen2", out / "tiny_rm"
    train_records = read_jsonl(out / "arith" / "train.jsonl")
    evals = read_jsonl(out / "arith" / "eval.jsonl")
    t0 = time.perf_counter()
    info = dict(num_eval=len(evals), batch_size=args.batch_size, lr=args.lr, bce=args.bce, lm=args.lm,
                policy_prompts=args.policy_prompts, policy_samples=args.policy_samples,
                judge_samples=args.judge_samples)

    if not args.check_only:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(policy_dir)
        rng = random.Random(args.seed)
        picked = rng.sample(train_records, args.policy_prompts)
        start = time.perf_counter()
        answers = sample_policy(policy_dir, picked, args.policy_samples, args.seed)
        policy_wrong: dict = {}
        for k, text in enumerate(answers):
            rec = picked[k // args.policy_samples]
            if not is_correct(text, rec):
                policy_wrong.setdefault(rec["prompt"][0]["content"], []).append(text)
        print(f"tiny_qwen2 answered {len(answers)} training prompts in {time.perf_counter() - start:.0f} s; "
              f"{sum(map(len, policy_wrong.values()))} wrong", flush=True)
        model = build_model(policy_dir, tokenizer.pad_token_id, args.seed)
        info["train"] = train(model, tokenizer, train_records, policy_wrong, args)
        shutil.rmtree(rm_dir, ignore_errors=True)
        rm_dir.mkdir(parents=True)
        model.save_pretrained(rm_dir)
        for name in TOKENIZER_FILES:
            shutil.copy(policy_dir / name, rm_dir / name)
        del model

    # Everything below reads the folder back, as a run does.
    rm = load_backend(rm_dir)
    info["num_params"] = sum(p.numel() for p in rm.model.parameters())
    info["pad_id"] = rm.model.config.pad_token_id
    info["pairwise"] = pairwise_accuracy(rm, evals, args.seed)
    responses = sample_policy(policy_dir, evals, args.judge_samples, args.seed + 1)
    info["judge"] = judge(rm, evals, responses, args.judge_samples)
    if not args.check_only:
        write_readme(out / "README.md", info)

    print("\n=== tiny reward model ===")
    print(f"parameters           {info['num_params']:,}")
    if "train" in info:
        print(f"training             {info['train']['steps']} steps: {info['train']['seconds']:.0f} s")
    for k, v in info["pairwise"].items():
        print(f"  eval pairwise      {k:38s} {v:.3f}")
    for k, v in info["judge"].items():
        print(f"  judge of tiny_qwen2 {k:37s} {v:.3f}" if isinstance(v, float) else
              f"  judge of tiny_qwen2 {k:37s} {v}")
    for f in sorted(p for p in rm_dir.rglob("*") if p.is_file()):
        print(f"  {f.relative_to(out)!s:34s} {f.stat().st_size:>10,d} bytes")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
