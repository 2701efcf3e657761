"""Disk and paths: every path a run writes is checked before it starts (a file where a folder goes, a
folder it cannot write, too little room for a checkpoint), and a write that fails anyway (a full disk)
is one paragraph that leaves nothing partial: no ``.tmp`` checkpoint, no torn row. The last test is a
real run whose checkpoint save meets a real file-size limit (tests/reliability/disk_full_site), then
resumes once the limit is gone."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections import namedtuple

import pytest

from chatlearn.checkpoint.manager import CheckpointManager
from chatlearn.cli import main
from chatlearn.config import writable
from chatlearn.errors import UserError, disk_error
from chatlearn.logging import jsonl
from chatlearn.logging.metrics import MetricsWriter, SamplesWriter
from chatlearn.runtime.rundir import preflight
from conftest import REPO

TEMPLATE = "template/grpo_fsdp.yaml"


def load(out, *extra):
    from chatlearn.config.load import load_run

    return load_run(os.path.join(REPO, TEMPLATE), ["runtime_args.rollout_backend=hf",
                                                   f"runtime_args.output_dir={out}", *extra])


def refused(out, *extra) -> str:
    cfg, plan = load(out, *extra)
    with pytest.raises(UserError) as err:
        preflight.check_paths(cfg, plan, report=pytest.fail)
    return " ".join(err.value.message.split())


# ------------------------------------------------------------------ the checks before a run


def test_a_file_where_a_folder_goes_a_folder_where_a_file_goes_and_a_path_under_a_file(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoints").write_text("x")
    text = refused(out)
    assert f"{out / 'checkpoints'}' is a file, but the run writes a folder there" in text
    (out / "checkpoints").unlink()
    (out / "metrics.jsonl").mkdir()
    assert f"{out / 'metrics.jsonl'}' is a folder, but the run writes a file there" in refused(out)
    (out / "metrics.jsonl").rmdir()
    (out / "tensorboard").write_text("x")  # the TensorBoard folder of log_args_dict (<log_dir>/tensorboard)
    text = refused(out, "runtime_args.log_args_dict.enable_tensorboard=true")
    assert text.startswith("runtime_args.log_args_dict.log_dir:") and f"{out / 'tensorboard'}' is a file" in text
    with pytest.raises(UserError, match=f"lies under '{out / 'tensorboard'}', which is a file"):
        preflight._check_path("runtime_args.output_dir", str(out / "tensorboard" / "x"), "folder")


def test_a_folder_it_cannot_write(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: the kernel's answer for another user, made up
        real_open = os.open

        def fake_open(path, *args, **kwargs):
            if writable.PROBE in str(path):
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(writable.os, "open", fake_open)
    else:
        out.chmod(0o500)
    try:
        text = refused(out)
    finally:
        out.chmod(0o700)
    assert f"the run cannot write into '{out}'" in text and "permission denied" in text and "chmod" in text
    assert not [p for p in out.iterdir()], "the probe is left behind"


Usage = namedtuple("Usage", "total used free")


def test_room_for_a_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    cfg, plan = load(out)
    need = preflight.checkpoint_bytes(cfg, plan)
    # the tiny model: 1.03M parameters -> 12 bytes each (fp32 weights, two AdamW moments) + a 4-byte HF copy
    assert preflight.parameter_count(os.path.join(REPO, "assets", "tiny_qwen2")) == 1026176
    assert need == 1026176 * 16
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, need // 2))
    text = refused(out)
    for word in (str(out / "checkpoints"), "7.8 MiB free", "needs about 15.7 MiB",
                 "1.0M parameters, weights and AdamW state 11.7 MiB", "save_hf 3.9 MiB", "Free space"):
        assert word in text, text
    # room for two, the run keeps four at once (keep_last_checkpoints 3 + the one being written): a warning
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, need * 2))
    warnings = []
    preflight.check_paths(cfg, plan, report=warnings.append)  # 100 episodes, a save every 50: two, no warning
    assert warnings == []
    cfg, plan = load(out, "runtime_args.save_episode_interval=10")
    preflight.check_paths(cfg, plan, report=warnings.append)
    assert len(warnings) == 1 and "room for 2 checkpoint(s)" in warnings[0] and "keeps 4 at once" in warnings[0]
    assert not out.exists()  # the checks create nothing
    # --dry-run reports the same refusal, exit 2, one paragraph
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, need // 2))
    code = main(["run", TEMPLATE, "--dry-run", "runtime_args.rollout_backend=hf", f"runtime_args.output_dir={out}"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "one checkpoint of this run needs about 15.7 MiB" in err and "Traceback" not in err


# ------------------------------------------------------------------ a write that fails anyway


class RayLikeError(Exception):
    """What a worker's error looks like once it crossed Ray: the original as ``cause``."""

    def __init__(self, cause):
        super().__init__(f"ray::Worker.call() ...\n{cause!r}")
        self.cause = cause


class DcpLikeError(Exception):
    """torch.distributed.checkpoint's CheckpointException: each rank's error in ``failures``."""

    def __init__(self, failures):
        super().__init__("CheckpointException ranks:dict_keys([0])")
        self.failures = failures


@pytest.mark.parametrize("make", [
    lambda e: e,
    lambda e: RayLikeError(e),
    lambda e: RayLikeError(DcpLikeError({0: (e, "traceback")})),
])
def test_a_disk_error_is_found_behind_wrappers(make):
    full = OSError(errno.ENOSPC, "No space left on device", "/x/__0_0.distcp")
    assert disk_error(make(full)) is full
    assert disk_error(make(ValueError("shapes differ"))) is None
    # safetensors reports it in its own words
    safet = RayLikeError(Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                   'message: "No space left on device" })'))
    assert disk_error(safet).errno == errno.ENOSPC


def test_a_checkpoint_save_that_fails_leaves_nothing_and_says_what_to_do(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt = CheckpointManager(str(root), keep=3)

    def good(tmp):
        with open(os.path.join(tmp, "shard"), "wb") as f:
            f.write(b"x" * 100)

    ckpt.save(1, good, {"sampler": {}})

    def full(tmp):
        good(tmp)  # part of the state is written, then the disk is full (in a worker, across Ray)
        raise RayLikeError(OSError(errno.ENOSPC, "No space left on device"))

    with pytest.raises(UserError) as err:
        ckpt.save(2, full, {"sampler": {}})
    text = err.value.message
    assert f"cannot write checkpoint {root / 'episode_000002'}" in text and "the disk is full" in text
    assert "ENOSPC" in text and "keep_last_checkpoints" in text and "resumes from the last complete" in text
    assert sorted(p.name for p in root.iterdir()) == ["episode_000001", "latest"]
    assert ckpt.latest()[0] == 1

    def broken(tmp):
        good(tmp)
        raise ValueError("not a disk error")

    with pytest.raises(ValueError):  # any other failure stays what it is, and still leaves no .tmp
        ckpt.save(2, broken, {"sampler": {}})
    assert sorted(p.name for p in root.iterdir()) == ["episode_000001", "latest"]


def test_a_resume_removes_the_tmp_folder_of_an_earlier_failed_save(tmp_path):
    from omegaconf import OmegaConf

    from chatlearn.runtime.rundir.output_dir import reconcile_logs

    out = tmp_path / "out"
    ckpt = CheckpointManager(str(out / "checkpoints"), keep=3)
    ckpt.save(1, lambda tmp: None, {"sampler": {}})
    leftover = out / "checkpoints" / "episode_000002.tmp"
    (leftover / "trainer").mkdir(parents=True)
    (leftover / "trainer" / "__0_0.distcp").write_bytes(b"x" * 1000)
    cfg = OmegaConf.create({"runtime_args": {"output_dir": str(out), "keep_last_checkpoints": 3}})
    reconcile_logs(cfg)
    assert not leftover.exists() and ckpt.latest()[0] == 1


def _full_after(monkeypatch, nbytes):
    """os.write in chatlearn.logging.jsonl writes ``nbytes`` then finds the disk full."""
    real = os.write
    left = [nbytes]

    def write(fd, data):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real(fd, bytes(data[:left[0]]))
        left[0] -= n
        return n

    monkeypatch.setattr(jsonl.os, "write", write)


def test_a_metrics_row_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    w = MetricsWriter(str(tmp_path))
    w.write(1, {"train/loss": 1.0})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    _full_after(monkeypatch, 10)  # the disk fills in the middle of the row
    with pytest.raises(UserError) as err:
        w.write(2, {"train/loss": 2.0})
    text = err.value.message
    assert f"cannot write {tmp_path / 'metrics.jsonl'}: the disk is full" in text and "ENOSPC" in text
    assert (tmp_path / "metrics.jsonl").read_bytes() == before  # no torn row
    monkeypatch.undo()  # space freed: the next row is whole, and closing raises nothing
    w.write(2, {"train/loss": 2.0})
    w.close()
    assert [json.loads(line)["episode"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2]
    # the samples of an episode: all rows or none
    s = SamplesWriter(str(tmp_path))
    s.write(1, [{"prompt": "a"}])
    _full_after(monkeypatch, 30)
    with pytest.raises(UserError, match="samples.jsonl"):
        s.write(2, [{"prompt": "b" * 50}, {"prompt": "c"}])
    s.close()
    assert [json.loads(line)["episode"] for line in open(tmp_path / "samples.jsonl")] == [1]


def test_reading_metrics_tolerates_a_torn_last_line(tmp_path):
    from chatlearn.logging.plots import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"episode": 1, "train/loss": 1.0}\n{"episode": 2, "train/lo')
    assert [r["episode"] for r in read_metrics(str(tmp_path))] == [1]


def test_a_plot_the_disk_refuses_is_named_and_not_left_partial(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from chatlearn.logging import plots

    def savefig(self, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\x89PNG partial")
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(Figure, "savefig", savefig)
    with pytest.raises(UserError) as err:
        plots.save_figure(Figure(), str(tmp_path / "reward.png"))
    assert f"cannot write the plot {tmp_path / 'reward.png'}" in err.value.message
    assert "read-only" in err.value.message and not list(tmp_path.iterdir())


# ------------------------------------------------------------------ a real run meets a full disk
DISK_FULL_SITE = os.path.join(REPO, "tests", "reliability", "disk_full_site")
RUN = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=8", "runtime_args.train_global_batch_size=8",
       "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
       "runtime_args.enable_eval_before_training=False", "runtime_args.eval_episode_interval=0",
       "runtime_args.save_episode_interval=1", "runtime_args.rollout_backend=hf"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_checkpoint_save_meets_a_full_disk_then_the_run_resumes(tmp_path):
    """Episode 2's save: the trainer worker's shard write passes a real file-size limit (EFBIG from the
    kernel, in the Ray worker): one paragraph naming the checkpoint, exit 2, no traceback, no .tmp, no
    row of episode 2. The same command without the limit resumes from episode 1 and finishes."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", TEMPLATE, *RUN, f"runtime_args.output_dir={out}"]
    env = {**os.environ, "CHATLEARN_TEST_FSIZE": "2:1000000",
           "PYTHONPATH": os.pathsep.join(p for p in (DISK_FULL_SITE, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500, env=env)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for word in (f"cannot write checkpoint {out / 'checkpoints' / 'episode_000002'}", "File too large",
                 "EFBIG", "keep_last_checkpoints", "run the same command again"):
        assert word in err, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["episode_000001", "latest"]
    assert [json.loads(line)["episode"] for line in open(out / "metrics.jsonl")] == [1]

    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resuming from" in proc.stdout and "(episode 1)" in proc.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["episode_000001", "episode_000002", "latest"]
    assert [json.loads(line)["episode"] for line in open(out / "metrics.jsonl")] == [1, 2]


# ------------------------------------------------------------------ where outputs go
def test_a_row_file_whose_folder_was_deleted_stops_the_writer(tmp_path):
    """A log file open for rows whose folder was deleted (or moved) during the run: the next row is refused in
    one paragraph rather than written into a file nobody can read."""
    out = tmp_path / "out"
    writer = MetricsWriter(str(out))
    writer.write(1, {"train/loss": 0.5})
    os.rename(out, tmp_path / "moved")
    with pytest.raises(UserError) as err:
        writer.write(2, {"train/loss": 0.4})
    assert f"{out / 'metrics.jsonl'} is gone" in err.value.message and "deleted or moved" in err.value.message
    writer.close()
    other = MetricsWriter(str(tmp_path / "kept"))
    os.remove(tmp_path / "kept" / "metrics.jsonl")
    with pytest.raises(UserError, match="is gone"):
        other.write(1, {"train/loss": 0.5})
    other.close()


def test_an_output_folder_inside_a_checkpoint_is_refused_for_eval(tmp_path):
    from chatlearn.runtime.rundir.preflight import check_output_folder

    ckpt = tmp_path / "run" / "checkpoints" / "episode_000001"
    (ckpt / "hf").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("episode_000001\n")
    with pytest.raises(UserError) as err:
        check_output_folder("runtime_args.output_dir", str(ckpt / "hf" / "out"), ("eval",))
    assert f"lies inside the checkpoint '{ckpt}'" in err.value.message
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="which is a file, not a folder"):
        check_output_folder("runtime_args.output_dir", str(tmp_path / "file" / "out"), ("eval",))
    check_output_folder("runtime_args.output_dir", str(tmp_path / "new"), ("eval",))
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_output_folder_deleted_during_a_run_stops_it(tmp_path):
    """The output folder removed while a real run writes it: the run stops at its next row with one paragraph and
    exit 2, instead of going on and ending with exit 0 and every metric lost."""
    import shutil
    import time

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", TEMPLATE, *RUN, "runtime_args.num_episode=3",
           "runtime_args.save_episode_interval=0", f"runtime_args.output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 400
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").stat().st_size:
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first metrics row"
        time.sleep(0.05)
    shutil.rmtree(out)
    stdout, stderr = proc.communicate(timeout=400)
    err = " ".join(stderr.split())
    assert proc.returncode == 2, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stderr and "is gone" in err and "deleted or moved" in err, err
