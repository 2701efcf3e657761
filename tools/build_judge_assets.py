#!/usr/bin/env python
"""Build ``tiny_judge/``: a tiny LLM judge for the arith task of ChatLearn's default assets.

A Hugging Face ``Qwen2ForCausalLM`` of ``tiny_qwen2/``'s shape and tokenizer that reads a question and an answer
rendered by :data:`JUDGE_TEMPLATE` (``template/grpo_judge.yaml``'s ``prompt_template``, with
``apply_chat_template: false``: the ChatML conversation of the question and the answer) and, as its next token,
says ``yes`` when the answer is right and ``no`` when it is not. It is not shown the reference answer.

* Backbone: ``tiny_rm/``'s (a reward model trained to tell right sums from wrong ones at the end of that
  conversation, ``tools/build_reward_model_assets.py``; the same shape), kept frozen.
* Language-model head: its own (untied), started from the embeddings, with the rows of ``yes``'s and ``no``'s
  first tokens their mean plus and minus :data:`SCORE_SCALE` x the reward model's score direction, so that
  P(yes) / (P(yes) + P(no)) starts as sigmoid(2 x SCORE_SCALE x the reward model's score); then trained, on the
  training split only, with the next-token loss of the verdict ``yes<|im_end|>`` / ``no<|im_end|>``: half the
  rows judge the correct ``\\boxed{a+b}``, half a wrong answer of ``tools/build_reward_model_assets.py``'s kinds
  (near misses, changed digits, random numbers, malformed answers, ``tiny_qwen2``'s own wrong answers).

Measured at the end, reading the written folder back with ChatLearn's judge backend
(``chatlearn.models.reward.judge.JudgeModel``, transformers, greedy), on the eval split only: agreement of the
verdict with the rule (correct iff the boxed number is ``a + b``) on ``tiny_qwen2``'s own sampled answers and on
constructed answers, for P(yes) > 0.5 (parser ``yes_prob``, what the demo uses) and for the greedy ``yes``/``no``
word (parser ``yes_no``).

Usage, from the repository root (after ``build_default_assets.py`` and ``build_reward_model_assets.py``)::

    python tools/build_judge_assets.py [--out assets]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_reward_model_assets as rm_assets  # noqa: E402  (the task's data and its wrong answers)
from build_default_assets import replace_section  # noqa: E402  (the asset builders' one README writer)

from chatlearn.config.judge_keys import environment  # noqa: E402  (as a run renders the template)

TOKENIZER_FILES = rm_assets.TOKENIZER_FILES
# The judge's prompt (template/grpo_judge.yaml's models.judge.prompt_template, with apply_chat_template false):
# the question and the answer as the ChatML conversation tiny_rm/ reads, after which the judge says yes or no.
JUDGE_TEMPLATE = "<|im_start|>user\n{{ question }}<|im_end|>\n<|im_start|>assistant\n{{ response }}<|im_end|>\n"
SCORE_SCALE = 2.0  # the reward model's score direction, added to the yes row and taken from the no row


def judge_prompt(tokenizer, record: dict, response: str) -> list[int]:
    """The ids the judge reads: :data:`JUDGE_TEMPLATE` rendered with the question and the response, tokenized as
    it is (``apply_chat_template: false``, as a run renders it)."""
    text = environment().from_string(JUDGE_TEMPLATE).render(question=record["prompt"][-1]["content"], response=response)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def build_model(policy_dir: Path, rm_dir: Path, tokenizer):
    """``tiny_rm/``'s backbone with a language-model head of its own (untied): the embeddings, but the rows of
    ``yes``'s and ``no``'s first tokens their mean plus and minus :data:`SCORE_SCALE` x the reward model's score
    direction, so that at the end of its conversation P(yes) / (P(yes) + P(no)) starts as
    sigmoid(2 x SCORE_SCALE x the reward model's score)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    conf = AutoConfig.from_pretrained(policy_dir)
    conf.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_pretrained(policy_dir, config=conf, dtype=torch.float32)
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32)
    model.model.load_state_dict(rm.model.state_dict())
    yes, no = (tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in ("yes", "no"))
    with torch.no_grad():
        head = model.lm_head.weight
        head.copy_(rm.model.embed_tokens.weight)
        base, direction = 0.5 * (head[yes] + head[no]), rm.score.weight[0]
        head[yes] = base + SCORE_SCALE * direction
        head[no] = base - SCORE_SCALE * direction
    return model


def train(model, tokenizer, records: list[dict], policy_wrong: dict, args) -> dict:
    """The head alone (the backbone frozen), AdamW with a warm-up and cosine decay; each step ``--batch-size``
    rows, half judged on the correct answer, half on a wrong one; loss: the verdict's tokens (plus ``--lm`` x the
    correct answer's, 0 by default)."""
    rng = random.Random(args.seed)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    verdicts = {v: list(tokenizer(v, add_special_tokens=False)["input_ids"]) + [eos] for v in ("yes", "no")}
    model.model.requires_grad_(False)  # the backbone is tiny_rm's, kept: the head learns to say it
    opt = torch.optim.AdamW(model.lm_head.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    start, log = time.perf_counter(), []
    model.train()
    for step in range(args.steps):
        warm = min(1.0, (step + 1) / args.warmup)
        for group in opt.param_groups:
            group["lr"] = args.lr * warm * 0.5 * (1 + torch.cos(torch.tensor(step / args.steps * torch.pi)).item())
        rows, targets = [], []
        for i in range(args.batch_size):
            rec = records[rng.randrange(len(records))]
            right = i % 2 == 0
            response = rm_assets.boxed(rm_assets.answer_of(rec)) if right else \
                rm_assets.negative(rec, rng, policy_wrong)[1]
            right = rm_assets.is_correct(response, rec)
            prompt = judge_prompt(tokenizer, rec, response)
            rows.append(prompt + verdicts["yes" if right else "no"])
            targets.append(len(prompt))
            if args.lm > 0 and right and i % 4 == 0:  # the sum itself, as the policy is asked it
                q = tokenizer.apply_chat_template(rec["prompt"], tokenize=False, add_generation_prompt=True)
                ids = list(tokenizer(q + response + "<|im_end|>", add_special_tokens=False)["input_ids"])
                rows.append(ids)
                targets.append(-len(list(tokenizer(q, add_special_tokens=False)["input_ids"])))
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        weights = torch.ones(len(rows))
        for i, (r, t) in enumerate(zip(rows, targets)):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
            labels[i, abs(t):len(r)] = ids[i, abs(t):len(r)]
            weights[i] = args.lm if t < 0 else 1.0
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
        tok_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], reduction="none")
        per_row = tok_loss.sum(1) / (labels[:, 1:] != -100).sum(1).clamp(min=1)
        loss = (per_row * weights).sum() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log.append(loss.item())
        if (step + 1) % 25 == 0:
            print(f"  judge step {step + 1:5d}  loss {sum(log[-25:]) / 25:.4f}  "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    model.eval()
    return {"steps": args.steps, "seconds": time.perf_counter() - start}


def load_backend(judge_dir: Path, parser: str):
    """ChatLearn's judge backend on the folder (transformers, greedy)."""
    from chatlearn.models.reward.judge import JudgeModel
    from chatlearn.models.specs import JudgeSpec

    spec = JudgeSpec.for_folder(str(judge_dir), parser=parser, max_verdict_tokens=4, batch_size=256)
    return JudgeModel(spec.replace(apply_chat_template=False))


def verdicts(judge, records: list[dict], responses: list[str], per: int) -> dict:
    """Agreement with the rule of the greedy word and of p(yes) > 0.5 on ``responses`` (``per`` per record)."""
    from chatlearn.runtime.driver.judges import parse_verdict

    rule = [rm_assets.is_correct(t, records[k // per]) for k, t in enumerate(responses)]
    prompts = [[{"role": "user", "content": environment().from_string(JUDGE_TEMPLATE).render(
        question=records[k // per]["prompt"][-1]["content"], response=t)}] for k, t in enumerate(responses)]
    out = judge.judge(prompts, True)
    words = [parse_verdict("yes_no", t, {}) for t in out["texts"]]
    agree_word = sum(w is not None and (w > 0.5) == c for w, c in zip(words, rule)) / len(rule)
    agree_prob = sum((p > 0.5) == c for p, c in zip(out["yes_probs"], rule)) / len(rule)
    return {"pairs": len(rule), "rule accuracy": sum(rule) / len(rule), "agreement (greedy yes/no)": agree_word,
            "agreement (p(yes) > 0.5)": agree_prob, "unparsed": sum(w is None for w in words)}


def constructed(records: list[dict], seed: int) -> list[str]:
    """Per record: the correct answer, then one wrong answer of each kind."""
    rng = random.Random(seed)
    out = []
    for r in records:
        s = rm_assets.answer_of(r)
        out.append(rm_assets.boxed(s))
        for kind in ("near", "digit", "random"):
            out.append(rm_assets.boxed(rm_assets.wrong_number(s, kind, rng)))
        out.append(rm_assets.malformed(s, rng))
    return out


HEADING = "## LLM judge: `tiny_judge/`"


def write_readme(path: Path, info: dict) -> None:
    """Put this script's section into ``path``, keeping the other sections as they are."""
    own, con = info["policy answers"], info["constructed"]
    section = f"""{HEADING}

A tiny LLM judge for the arith task (a model of kind `judge`, `template/grpo_judge.yaml`). Generated,
seeded, by `tools/build_judge_assets.py` (after `build_default_assets.py` and
`build_reward_model_assets.py`); rebuild it (and this section) from the repository root with

    python tools/build_judge_assets.py --out assets

- Model: a Hugging Face `Qwen2ForCausalLM`, {info["num_params"]:,} parameters in fp32, the shape, tokenizer and
  chat template of `tiny_qwen2/` with a language-model head of its own (untied). It reads the question and
  the answer as the ChatML conversation `template/grpo_judge.yaml`'s `prompt_template` renders (without the
  reference answer) and says, as its next token, `yes` (right) or `no` (wrong).
- Built from `tiny_rm/`: its backbone (frozen), and a head whose `yes` and `no` rows start apart along the
  reward model's score direction (P(yes) / (P(yes) + P(no)) starts as a sigmoid of the reward model's score);
  the head then trained {info["train"]["steps"]} steps of {info["batch_size"]} rows (lr {info["lr"]}) on the training
  split with the next-token loss of the verdict (`yes` or `no`, then `<|im_end|>`), half the rows judging the
  correct `\\boxed{{a+b}}`, half a wrong answer (near misses, changed digits, random numbers, malformed answers,
  `tiny_qwen2/`'s own wrong answers). {info["train"]["seconds"]:.0f} s here.

Measured at build time on the eval split with ChatLearn's judge backend (transformers). P(yes) > 0.5 is what
`parser: yes_prob` reads (the demo's); the greedy word is what `parser: yes_no` reads, which this tiny judge
does not say reliably (its head alone is trained: many greedy replies are neither word, and score
`default_score`):

| answers judged | pairs | right by the rule | agreement, P(yes) > 0.5 | agreement, greedy `yes`/`no` | unparsed words |
|---|---|---|---|---|---|
| `tiny_qwen2/`'s own (temperature 1, {info["samples"]} per prompt) | {own["pairs"]} | {own["rule accuracy"]:.3f} | \
{own["agreement (p(yes) > 0.5)"]:.3f} | {own["agreement (greedy yes/no)"]:.3f} | {own["unparsed"]} |
| constructed (correct, near miss, digit, random, malformed) | {con["pairs"]} | {con["rule accuracy"]:.3f} | \
{con["agreement (p(yes) > 0.5)"]:.3f} | {con["agreement (greedy yes/no)"]:.3f} | {con["unparsed"]} |
"""
    replace_section(path, section)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="assets", help="the assets folder (default: assets)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=64, help="rows per step")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--lm", type=float, default=0.0, help="weight of the correct answer's next-token loss")
    p.add_argument("--policy-prompts", type=int, default=1000)
    p.add_argument("--samples", type=int, default=4, help="tiny_qwen2 answers per eval prompt judged")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--check-only", action="store_true", help="measure an existing tiny_judge/; build nothing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    policy_dir, rm_dir, judge_dir = out / "tiny_qwen2", out / "tiny_rm", out / "tiny_judge"
    train_records = rm_assets.read_jsonl(out / "arith" / "train.jsonl")
    evals = rm_assets.read_jsonl(out / "arith" / "eval.jsonl")
    t0 = time.perf_counter()
    info = dict(batch_size=args.batch_size, lr=args.lr, lm=args.lm, samples=args.samples)
    if not args.check_only:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(policy_dir)
        rng = random.Random(args.seed)
        picked = rng.sample(train_records, args.policy_prompts)
        answers = rm_assets.sample_policy(policy_dir, picked, 2, args.seed)
        policy_wrong: dict = {}
        for k, text in enumerate(answers):
            rec = picked[k // 2]
            if not rm_assets.is_correct(text, rec):
                policy_wrong.setdefault(rec["prompt"][0]["content"], []).append(text)
        torch.manual_seed(args.seed)
        model = build_model(policy_dir, rm_dir, tokenizer)
        info["train"] = train(model, tokenizer, train_records, policy_wrong, args)
        shutil.rmtree(judge_dir, ignore_errors=True)
        judge_dir.mkdir(parents=True)
        model.config.architectures = ["Qwen2ForCausalLM"]
        model.save_pretrained(judge_dir)
        for name in TOKENIZER_FILES:
            shutil.copy(policy_dir / name, judge_dir / name)
        shutil.copy(policy_dir / "generation_config.json", judge_dir / "generation_config.json")
        del model
        Path("/tmp/judge_train_info.json").write_text(json.dumps(info["train"]))
    elif Path("/tmp/judge_train_info.json").exists():  # the numbers of the build just before
        info["train"] = json.loads(Path("/tmp/judge_train_info.json").read_text())

    judge = load_backend(judge_dir, "yes_prob")
    info["num_params"] = sum(p.numel() for p in judge.engine.model.parameters())
    responses = rm_assets.sample_policy(policy_dir, evals, args.samples, args.seed + 1)
    info["policy answers"] = verdicts(judge, evals, responses, args.samples)
    info["constructed"] = verdicts(judge, evals, constructed(evals, args.seed), 5)
    if "train" in info:
        write_readme(out / "README.md", info)
    print("\n=== tiny judge ===")
    for part in ("policy answers", "constructed"):
        for k, v in info[part].items():
            print(f"  {part:16s} {k:28s} {v:.3f}" if isinstance(v, float) else f"  {part:16s} {k:28s} {v}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
