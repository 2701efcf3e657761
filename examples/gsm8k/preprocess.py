"""Turn a local copy of GSM8K into chatlearn's data format.

Reads openai/gsm8k's parquet layout (``main/train-00000-of-00001.parquet``, ``main/test-...``) or
the jsonl layout (``train.jsonl``, ``test.jsonl``): rows with ``question`` and ``answer``, whose last
line is ``#### 42``. Writes ``OUT/train.jsonl`` and ``OUT/test.jsonl`` (or ``.parquet``), one row per
problem::

    {"data_source": "openai/gsm8k", "ability": "math",
     "prompt": [{"role": "user", "content": "<question> Let's think step by step and output the final answer within \\boxed{}."}],
     "reward_model": {"style": "rule", "ground_truth": "42"},
     "extra_info": {"split": "train", "index": 0, "question": "...", "answer": "..."}}

Usage (from the repository root)::

    python examples/gsm8k/preprocess.py --input /path/to/gsm8k --output data/gsm8k
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from chatlearn.data.dataset import DATA_SUFFIXES, read_rows  # noqa: E402
from chatlearn.errors import UserError  # noqa: E402

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
FINAL = re.compile(r"####\s*(-?[0-9.,]+)")


def final_answer(answer: str, where: str) -> str:
    """The number after ``####`` with thousands separators removed (``#### 1,234`` -> ``1234``)."""
    found = FINAL.search(answer)
    if found is None:
        raise UserError(f"{where}: the answer has no final '#### <number>' line. GSM8K answers end with one; "
                        "fix or remove that row.")
    return found.group(1).replace(",", "").rstrip(".")


def split_of(path: str) -> str:
    name = os.path.basename(path).lower()
    for split in ("train", "test"):
        if split in name:
            return split
    raise UserError(f"{path}: cannot tell the split from the file name (it names neither train nor test). "
                    "Rename it, e.g. train.jsonl or test-00000-of-00001.parquet.")


def input_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    found = sorted(os.path.join(root, f) for root, _, files in os.walk(path) for f in files
                   if f.endswith(DATA_SUFFIXES))
    if not found:
        raise UserError(f"{path!r} holds no .parquet, .jsonl or .json file. Point --input at a copy of GSM8K.")
    return found


def convert(files: list[str]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for path in files:
        split = split_of(path)
        rows = out.setdefault(split, [])
        for row, where in read_rows(path):
            if "question" not in row or "answer" not in row:
                raise UserError(f"{where}: expected the GSM8K columns 'question' and 'answer' (the row has: "
                                f"{', '.join(sorted(row))}). Point --input at GSM8K.")
            rows.append({"data_source": DATA_SOURCE, "ability": "math",
                         "prompt": [{"role": "user", "content": f"{row['question'].strip()} {INSTRUCTION}"}],
                         "reward_model": {"style": "rule", "ground_truth": final_answer(row["answer"], where)},
                         "extra_info": {"split": split, "index": len(rows), "question": row["question"],
                                        "answer": row["answer"]}})
    return out


def write_rows(rows: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
        return
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="a GSM8K folder or file (parquet or jsonl)")
    parser.add_argument("--output", default="data/gsm8k", help="output folder (default: data/gsm8k)")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    args = parser.parse_args(argv)
    try:
        splits = convert(input_files(args.input))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for split, rows in sorted(splits.items()):
        path = os.path.join(args.output, f"{split}.{args.format}")
        write_rows(rows, path)
        print(f"{split}: {len(rows)} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
