"""The fingerprint of a run's train data (chatlearn.config.data_fingerprint): by content, not by spelling."""
from __future__ import annotations

import os
import shutil

from chatlearn.config import data_fingerprint as fp


def test_the_same_file_spelled_or_copied_elsewhere_is_the_same_data(tmp_path, monkeypatch):
    data = tmp_path / "a" / "train.jsonl"
    data.parent.mkdir()
    data.write_text('{"prompt": "1 + 1"}\n' * 50)
    monkeypatch.chdir(tmp_path)
    relative = fp.data_fingerprint("a/train.jsonl")
    assert relative[0]["path"] == str(data) and relative[0]["files"][0]["size"] == os.path.getsize(data)
    shutil.copy(data, tmp_path / "copy.jsonl")  # a copy has another modification time: the same data
    assert fp.same_data(relative, fp.data_fingerprint(str(data)))
    assert fp.same_data(relative, fp.data_fingerprint("copy.jsonl"))
    (tmp_path / "other.jsonl").write_text('{"prompt": "1 + 2"}\n' * 50)  # as many bytes, other rows
    assert not fp.same_data(relative, fp.data_fingerprint("other.jsonl"))
    assert "other.jsonl (1000 bytes, sha256 " in fp.describe(fp.data_fingerprint("other.jsonl"))
    assert fp.same_data([{"hub": "org/name@abc"}], [{"hub": "org/name@abc"}])
    assert not fp.same_data([{"hub": "org/name@abc"}], [{"hub": "org/name@def"}])
    assert not fp.same_data([{"unknown": 1}], relative)  # a record this version does not read


def test_a_large_file_is_hashed_by_its_size_and_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(fp, "WHOLE_FILE", 1000)
    monkeypatch.setattr(fp, "EDGE", 100)
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"a" * 5000)
    first = fp.file_hash(str(big))
    with open(big, "r+b") as f:  # the middle changed: not read (size and ends only)
        f.seek(2500)
        f.write(b"b")
    assert fp.file_hash(str(big)) == first
    with open(big, "r+b") as f:  # an end changed
        f.seek(4990)
        f.write(b"b")
    assert fp.file_hash(str(big)) != first
    big.write_bytes(b"a" * 5001)  # another size
    assert fp.file_hash(str(big)) != first
