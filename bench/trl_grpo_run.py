"""One TRL GRPOTrainer run for ``bench/grpo_vs_trl.py`` (run in its own process).

    python bench/trl_grpo_run.py SPEC.json

SPEC holds ``model`` (folder), ``data_path``, ``prompt_key``, ``max_prompt_tokens``, ``threads``,
``reward`` (MathReward's correct/incorrect scores), ``out`` (result JSON) and ``trl`` (GRPOConfig
keyword arguments, see ``grpo_compare.trl_config_kwargs``). The prompts are chatlearn's training
rows in file order, without those chatlearn drops as longer than ``max_prompt_tokens``; the reward
is chatlearn's ``MathReward`` on the decoded completion. The result records when the imports and
the trainer's set-up were done and the time of every optimizer step's end, and per generated batch its samples, generated tokens, mean reward and
prompts (to check the order against chatlearn's).
"""
from __future__ import annotations

import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def load_rows(spec: dict, tokenizer) -> list[dict]:
    """chatlearn's prompt rows (``load_prompts`` keeps the same ones, in the same order)."""
    from chatlearn.data.dataset import list_data_files, read_rows

    rows = []
    for path in list_data_files(spec["data_path"].split(",")):
        for row, _ in read_rows(path):
            prompt = row[spec["prompt_key"]]
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                **spec["trl"]["chat_template_kwargs"])
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            if len(ids) > spec["max_prompt_tokens"]:
                continue
            rm = row.get("reward_model") or {}
            rows.append({"prompt": messages, "ground_truth": str(rm.get("ground_truth", row.get("ground_truth", "")))})
    return rows


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    import torch

    torch.set_num_threads(int(spec["threads"]))
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from chatlearn.models.reward.math_reward import MathReward

    imports_done = time.perf_counter()

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    dataset = Dataset.from_list(load_rows(spec, tokenizer))
    scorer = MathReward(spec["reward"])
    gens: list[dict] = []

    def math_reward(prompts, completions, completion_ids, ground_truth, **kwargs):
        """chatlearn's MathReward on the decoded completions; records the generated batch."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [float(s) for s in scorer.score(texts, list(ground_truth))]
        gens.append({"time": time.perf_counter(), "samples": len(texts),
                     "tokens": int(sum(len(ids) for ids in completion_ids)),
                     "reward_mean": sum(scores) / len(scores),
                     "prompts": [p[-1]["content"] for p in prompts[::spec["trl"]["num_generations"]]]})
        return scores

    step_ends: list[float] = []
    marks: dict = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks["train_start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    args = GRPOConfig(**spec["trl"])
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=math_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    setup_done = time.perf_counter()
    setup_s = setup_done - t0
    trainer.train()
    built = {k: getattr(args, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                          "generation_batch_size", "steps_per_generation", "num_iterations")}
    with open(spec["out"], "w") as f:
        json.dump({"imports_done": imports_done, "setup_done": setup_done,
                   "train_start": marks["train_start"], "step_ends": step_ends, "gens": gens, "setup_s": setup_s,
                   "torch_threads": torch.get_num_threads(), "config": built,
                   "num_prompts": len(dataset)}, f)


if __name__ == "__main__":
    main()
