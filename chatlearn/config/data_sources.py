"""The data paths of the config (``runtime_args.data_path``, ``eval_data_path``): local files and
folders checked, Hugging Face Hub dataset ids resolved, as validation does before a run starts.
chatlearn.data reads the rows of the sources resolved here.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from chatlearn.errors import ConfigError
from chatlearn.hub import looks_like_hub_id, snapshot, split_revision

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class DataSource:
    """One entry of a data path: a local file or folder, or a Hub dataset."""

    spec: str  # as written in the config (a Hub id may carry @revision)
    path: str  # local file or folder; for a Hub dataset its snapshot folder, or the id (read from datasets' cache)
    hub_id: str | None = None  # the Hub id (without revision) when the entry names a Hub dataset
    revision: str | None = None

    @property
    def pinned(self) -> str:
        """The entry as it should be recorded: a Hub id pinned to the commit it resolved to."""
        if self.hub_id and os.path.isdir(self.path):
            return f"{self.hub_id}@{os.path.basename(os.path.normpath(self.path))}"
        return self.spec


def quiet_datasets():
    import datasets

    datasets.disable_progress_bars()  # "Map: 100%|..." and "Generating train split" bars
    datasets.logging.set_verbosity_error()
    return datasets


def resolve_data_sources(value: str, key: str, *, name: str | None, split: str) -> list[DataSource]:
    """The entries of the comma-separated ``value``; local paths are checked, Hub dataset ids are resolved
    (downloaded into the Hugging Face cache unless cached) and their ``name``/``split`` checked. Problems
    are ConfigErrors naming ``key``."""
    entries = [p.strip() for p in str(value).split(",") if p.strip()]
    if not entries:
        raise ConfigError("is empty. Give one or more jsonl/json/parquet files or folders, or Hugging Face Hub "
                          "dataset ids, comma-separated.", key=key)
    out = []
    for entry in entries:
        if entry.lower().endswith(DATA_SUFFIXES) or not looks_like_hub_id(entry):
            if not os.path.exists(entry):
                raise ConfigError(f"path {entry!r} does not exist (cwd: {os.getcwd()}). Fix the path (relative paths "
                                  "are relative to the directory you run chatlearn from), or give a Hugging Face Hub "
                                  "dataset id such as openai/gsm8k.", key=key)
            if not os.access(entry, os.R_OK):
                raise ConfigError(f"path {entry!r} is not readable. Fix its permissions.", key=key)
            if os.path.isdir(entry) and not any(f.endswith(DATA_SUFFIXES) for f in os.listdir(entry)):
                raise ConfigError(f"data folder {entry!r} holds no .jsonl, .json or .parquet file. Put the data files "
                                  "there, or point it at the files.", key=key)
            files = ([os.path.join(entry, f) for f in sorted(os.listdir(entry)) if f.endswith(DATA_SUFFIXES)]
                     if os.path.isdir(entry) else [entry])
            if not any(_has_rows(f) for f in files):
                what = f"data folder {entry!r} holds only empty files" if os.path.isdir(entry) else \
                    f"data file {entry!r} is empty"
                raise ConfigError(f"{what} (no rows). Point it at data with at least one row.", key=key)
            out.append(DataSource(entry, entry))
            continue
        repo_id, revision = split_revision(entry)
        out.append(_hub_source(entry, repo_id, revision, key, name=name, split=split))
    return out


def _has_rows(path: str) -> bool:
    """Whether a local data file holds at least one row (cheap: parquet metadata, or any character that is
    not blank and not an empty JSON array). A file that cannot be read counts as having rows: reading it
    later names what is wrong with it."""
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows > 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 16):
                text = chunk.strip()
                if text:
                    if text == b"[]" and not f.read(1):  # a JSON file holding an empty list
                        return False
                    return True
        return False
    except Exception:  # noqa: BLE001 - reported when the file is read
        return True


def _hub_source(entry: str, repo_id: str, revision: str | None, key: str, *, name, split) -> DataSource:
    hint = "a local folder or jsonl/json/parquet files"
    try:
        path = snapshot(entry, key=key, repo_type="dataset", local_hint=hint).path
    except ConfigError as err:
        # not in the Hub cache: a dataset prepared earlier by datasets.load_dataset is in datasets' own cache
        # (looked up offline: the Hub was just found unreachable or off limits)
        if "is not in the Hugging Face cache" not in str(err) or _builder(repo_id, name, revision, split, key,
                                                                          quiet=True, offline=True) is None:
            raise err from None
        return DataSource(entry, repo_id, repo_id, revision)
    _builder(path, name, revision=None, split=split, key=key, shown=entry)
    return DataSource(entry, path, repo_id, revision)


@contextlib.contextmanager
def datasets_offline(on: bool):
    """``datasets`` without network inside (when ``on``): for datasets read from its own cache."""
    import datasets

    was = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = was or on
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = was


def _builder(path: str, name, revision, split: str, key: str, quiet: bool = False, shown: str | None = None,
             offline: bool = False):
    """The ``datasets`` builder of ``path`` with config ``name``, checked to have ``split`` (None when
    ``quiet`` and it cannot be made). ``offline``: only from datasets' cache, no network."""
    datasets = quiet_datasets()
    shown = shown or path
    name_key = "runtime_args.eval_data_subset" if "eval" in key else "runtime_args.data_subset"
    split_key = "runtime_args.eval_data_split" if "eval" in key else "runtime_args.data_split"
    try:
        with datasets_offline(offline):
            builder = datasets.load_dataset_builder(path, name, revision=revision)
    except Exception as err:  # datasets raises ValueError, FileNotFoundError, ConnectionError, ... for a bad id/config
        if quiet:
            return None
        try:
            configs = datasets.get_dataset_config_names(path)
        except Exception:  # noqa: BLE001 (the first error is the one to report)
            configs = []
        if len(configs) > 1 and name not in configs:
            what = f"has no subset {name!r}; its subsets (configs) are" if name else "has several subsets (configs):"
            raise ConfigError(f"the Hub dataset {shown!r} {what} {', '.join(configs)}. Set {name_key} to one of "
                              "them.", key=name_key) from None
        raise ConfigError(f"cannot read the Hub dataset {shown!r}: {type(err).__name__}: {brief(err)}. Check "
                          f"the id and {name_key}.", key=key) from None
    splits = list((builder.config.data_files or {}).keys()) or list((builder.info.splits or {}).keys())
    if splits and split not in splits:
        raise ConfigError(f"the Hub dataset {shown!r} (config {builder.config.name!r}) has no split {split!r}; it has "
                          f"{', '.join(map(str, splits))}. Set {split_key} to one of them.", key=split_key)
    return builder


def brief(err: Exception, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " (...)"
