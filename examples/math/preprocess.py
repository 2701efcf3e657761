"""Turn a local copy of the MATH dataset (Hendrycks et al., 2021) into chatlearn's data format.

Reads either the original layout, one JSON file per problem (``MATH/train/algebra/1.json``, ...
``MATH/test/...``), or the jsonl/parquet layout of the competition_math dataset (files named with
``train`` / ``test``); each problem has ``problem``, ``solution`` (with the answer in ``\\boxed{}``),
``level`` and ``type``. The ground truth is the last ``\\boxed{...}`` of the solution; problems
without one are skipped (and counted). Writes ``OUT/train.jsonl`` and ``OUT/test.jsonl`` (or
``.parquet``)::

    {"data_source": "hendrycks/MATH", "ability": "math",
     "prompt": [{"role": "user", "content": "<problem> Let's think step by step and output the final answer within \\boxed{}."}],
     "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
     "extra_info": {"split": "test", "index": 0, "level": "Level 3", "type": "Algebra", "solution": "..."}}

Usage (from the repository root)::

    python examples/math/preprocess.py --input /path/to/MATH --output data/math
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from chatlearn.data.dataset import read_rows  # noqa: E402
from chatlearn.errors import UserError  # noqa: E402
from chatlearn.models.reward.math_reward import last_boxed  # noqa: E402

DATA_SOURCE = "hendrycks/MATH"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
COLUMNS = ("problem", "solution")


def split_of(path: str, root: str) -> str:
    """``train`` or ``test``: the nearest part of the path (below and including ``root``) naming one."""
    rel = os.path.relpath(os.path.abspath(path), os.path.dirname(os.path.abspath(root)))
    for part in reversed(rel.lower().split(os.sep)):
        for split in ("train", "test"):
            if split in part:
                return split
    raise UserError(f"{path}: cannot tell the split from the path (no folder or file name holds train or test). "
                    "Keep the MATH/train and MATH/test folders, or name the files train.jsonl / test.jsonl.")


def read_problems(path: str) -> list[tuple[dict, str]]:
    """The problems of one file: a per-problem JSON object, or rows of a jsonl/parquet file."""
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                obj = json.load(f)
        except json.JSONDecodeError:
            obj = None  # not one JSON document: a jsonl file with a .json name
        if isinstance(obj, dict):
            return [(obj, path)]
    return read_rows(path)


def input_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    found = sorted(os.path.join(root, f) for root, _, files in os.walk(path) for f in files
                   if f.endswith((".json", ".jsonl", ".parquet")))
    if not found:
        raise UserError(f"{path!r} holds no .json, .jsonl or .parquet file. Point --input at a copy of MATH.")
    return found


def convert(files: list[str], root: str) -> tuple[dict[str, list[dict]], int]:
    out: dict[str, list[dict]] = {}
    skipped = 0
    for path in files:
        split = split_of(path, root)
        rows = out.setdefault(split, [])
        for row, where in read_problems(path):
            if not all(c in row for c in COLUMNS):
                raise UserError(f"{where}: expected the MATH fields 'problem' and 'solution' (it has: "
                                f"{', '.join(sorted(row))}). Point --input at MATH.")
            answer = last_boxed(row["solution"])
            if answer is None:
                skipped += 1
                continue
            rows.append({"data_source": DATA_SOURCE, "ability": "math",
                         "prompt": [{"role": "user", "content": f"{row['problem'].strip()} {INSTRUCTION}"}],
                         "reward_model": {"style": "rule", "ground_truth": answer.strip()},
                         "extra_info": {"split": split, "index": len(rows), "level": str(row.get("level", "")),
                                        "type": str(row.get("type", "")), "solution": row["solution"]}})
    return out, skipped


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
    parser.add_argument("--input", required=True, help="the MATH folder, or competition_math jsonl/parquet files' "
                                                        "folder or file")
    parser.add_argument("--output", default="data/math", help="output folder (default: data/math)")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    args = parser.parse_args(argv)
    try:
        splits, skipped = convert(input_files(args.input), args.input)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for split, rows in sorted(splits.items()):
        path = os.path.join(args.output, f"{split}.{args.format}")
        write_rows(rows, path)
        print(f"{split}: {len(rows)} rows -> {path}")
    if skipped:
        print(f"skipped {skipped} problems whose solution has no \\boxed{{}} answer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
