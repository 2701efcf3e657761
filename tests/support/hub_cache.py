"""A Hugging Face cache laid out as ``huggingface_hub`` writes it, built offline for tests.

``add_model(cache, "org/name", folder)`` copies a model folder into
``<cache>/models--org--name/snapshots/<commit>/`` and points ``refs/main`` at it;
``add_dataset(cache, "org/name", configs)`` writes a dataset repository in the Hub's parquet
layout (``<config>/<split>-00000-of-00001.parquet`` and a README.md declaring the configs, as
``openai/gsm8k`` has). With ``HF_HOME`` (or ``HF_HUB_CACHE``) pointing there and
``HF_HUB_OFFLINE=1``, ``snapshot_download`` and ``datasets.load_dataset`` find them without network.
"""
from __future__ import annotations

import hashlib
import os
import shutil


def commit_of(repo_id: str, revision: str = "main") -> str:
    return hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()


def _repo(cache: str, kind: str, repo_id: str, revision: str) -> tuple[str, str]:
    folder = os.path.join(cache, f"{kind}s--" + repo_id.replace("/", "--"))
    commit = commit_of(repo_id, revision)
    snap = os.path.join(folder, "snapshots", commit)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(folder, "refs"), exist_ok=True)
    with open(os.path.join(folder, "refs", revision), "w", encoding="utf-8") as f:
        f.write(commit)
    return snap, commit


def add_model(cache: str, repo_id: str, src: str, revision: str = "main", drop: tuple = ()) -> str:
    """Copy the model folder ``src`` into the cache as ``repo_id`` at ``revision``; returns the snapshot folder."""
    snap, _ = _repo(cache, "model", repo_id, revision)
    for name in os.listdir(src):
        if name not in drop and os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(snap, name))
    return snap


def gsm_rows(n: int, start: int = 0) -> list[dict]:
    """GSM8K-shaped rows (``question``, ``answer`` ending in ``#### <number>``) of one-digit sums."""
    rows = []
    for i in range(start, start + n):
        a, b = i % 10, (i * 7) % 10
        rows.append({"question": f"What is {a} + {b}?", "answer": f"{a} plus {b} is {a + b}.\n#### {a + b}"})
    return rows


def add_dataset(cache: str, repo_id: str, configs: dict[str, dict[str, list[dict]]], revision: str = "main") -> str:
    """Write ``{config: {split: rows}}`` as the Hub dataset ``repo_id``; returns the snapshot folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    snap, _ = _repo(cache, "dataset", repo_id, revision)
    card = ["---", "configs:"]
    for config, splits in configs.items():
        os.makedirs(os.path.join(snap, config), exist_ok=True)
        card += [f"- config_name: {config}", "  data_files:"]
        for split, rows in splits.items():
            pq.write_table(pa.Table.from_pylist(rows), os.path.join(snap, config, f"{split}-00000-of-00001.parquet"))
            card += [f"  - split: {split}", f"    path: {config}/{split}-*"]
    card += ["---", f"# {repo_id}", ""]
    with open(os.path.join(snap, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(card))
    return snap
