"""``chatlearn eval --checkpoint`` of a trainer checkpoint (no ``hf/``: the model is merged first):
nothing is left outside the output folder (the merge goes to ``OUTPUT_DIR/eval/merged_model`` and is
deleted afterwards, also on errors and on Ctrl-C), ``metrics.json`` names the checkpoint and the
folder evaluated, an incomplete checkpoint is refused before anything loads, and an earlier result is
never overwritten silently.

One 1-episode run of the embedded default (trainer state only) gives the checkpoint for every test;
one evaluation of it is shared by the tests that read its result."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import runs

from conftest import REPO
from test_reliability_e2e import ctrl_c_reaches_it

pytestmark = pytest.mark.slow  # every test reads a whole run's checkpoint or its evaluation

RUN = ["runtime_args.num_episode=1", "runtime_args.sample_per_episode=16", "runtime_args.train_global_batch_size=16",
       "runtime_args.train_micro_batch_size=16", "models.policy.num_inference_per_prompt=4",
       "runtime_args.enable_eval_before_training=False", "runtime_args.eval_episode_interval=0",
       "runtime_args.save_episode_interval=1", "runtime_args.rollout_backend=hf",
       "models.policy.max_response_tokens_length=16", "models.policy_trainer.save_hf=false"]
EVAL = ["runtime_args.rollout_backend=hf", "models.policy.eval_num_inference_per_prompt=1",
        "models.policy.max_response_tokens_length=16"]
MODEL_FILES = (".safetensors", ".distcp", ".bin")


def model_files(folder) -> list[str]:
    """Weights (and any merged-model folder) under ``folder``: what eval must not leave behind there."""
    found = []
    for root, dirs, names in os.walk(folder):
        found += [os.path.join(root, n) for n in names if n.endswith(MODEL_FILES)]
        found += [os.path.join(root, d) for d in dirs if d.startswith("chatlearn_eval_")]
    return sorted(found)


@contextlib.contextmanager
def fresh_tmpdir():
    """A new, empty folder for TMPDIR, with a short path: Ray puts its sockets under TMPDIR, and a socket
    path may not exceed 107 bytes (pytest's tmp_path is too deep)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="ev", dir="/tmp" if os.path.isdir("/tmp") else None))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tmpdir_env():
    with fresh_tmpdir() as path:
        yield path


def eval_command(out, checkpoint, data, *extra):
    return [sys.executable, "-m", "chatlearn.cli", "eval", "template/grpo_fsdp.yaml", *EVAL,
            f"runtime_args.eval_data_path={data}", f"runtime_args.output_dir={out}", *extra,
            "--checkpoint", str(checkpoint)]


def run_eval(out, checkpoint, data, tmpdir, *extra):
    return subprocess.run(eval_command(out, checkpoint, data, *extra), cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TMPDIR": str(tmpdir)})


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A run's complete checkpoint (``checkpoints/episode_000001``, trainer state only), and a small eval set."""
    root = tmp_path_factory.mktemp("eval_ckpt")
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *RUN,
           f"runtime_args.output_dir={root / 'run'}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    path = root / "run" / "checkpoints" / "episode_000001"
    assert (path / "COMPLETE").exists() and not (path / "hf").exists()
    return {"root": root, "path": path, "data": runs.small_eval_set(str(root), n=8)}


@pytest.fixture(scope="module")
def evaluated(ckpt):
    """One evaluation of the checkpoint, with TMPDIR a fresh folder."""
    out = ckpt["root"] / "eval_out"
    with fresh_tmpdir() as tmpdir:
        proc = run_eval(out, ckpt["path"], ckpt["data"], tmpdir)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        yield {"out": out, "tmpdir": tmpdir, "proc": proc}


@pytest.mark.timeout(600)
def test_eval_leaves_no_model_outside_its_output_folder(evaluated):
    assert model_files(evaluated["tmpdir"]) == []
    # and none inside it either: the merged model is deleted once the evaluation is done
    assert model_files(evaluated["out"]) == []
    assert sorted(os.listdir(evaluated["out"] / "eval")) == ["logs", "metrics.json", "samples.jsonl"]


@pytest.mark.timeout(600)
def test_metrics_json_names_the_checkpoint_and_the_folder_evaluated(ckpt, evaluated):
    with open(evaluated["out"] / "eval" / "metrics.json", encoding="utf-8") as f:
        result = json.load(f)
    assert result["checkpoint"] == {"path": str(ckpt["path"]), "episode": 1}
    assert result["model"] == str(evaluated["out"] / "eval" / "merged_model")
    assert result["model_deleted"] is True
    assert str(evaluated["tmpdir"]) not in json.dumps(result)


@pytest.mark.timeout(600)
def test_a_second_eval_into_the_same_folder_is_refused(ckpt, evaluated):
    metrics = evaluated["out"] / "eval" / "metrics.json"
    before = metrics.read_bytes()
    proc = run_eval(evaluated["out"], ckpt["path"], ckpt["data"], evaluated["tmpdir"])
    text = flat(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert str(metrics) in text and "--overwrite" in text and "runtime_args.output_dir" in text, text
    assert "merging" not in proc.stdout  # refused before anything is loaded or written
    assert metrics.read_bytes() == before
    assert model_files(evaluated["out"]) == [] and model_files(evaluated["tmpdir"]) == []


@pytest.mark.timeout(600)
def test_an_incomplete_checkpoint_is_refused_before_anything_loads(ckpt, tmp_path, tmpdir_env):
    from chatlearn.errors import UserError
    from chatlearn.runtime.driver.evaluate import resolve_model

    # a torn save: the trainer state written, the run killed before state.json, manifest.json, COMPLETE
    torn = tmp_path / "checkpoints" / "episode_000002.tmp"
    shutil.copytree(ckpt["path"], torn, ignore=shutil.ignore_patterns("COMPLETE", "manifest.json", "state.json"))
    out = tmp_path / "out"
    proc = run_eval(out, torn, ckpt["data"], tmpdir_env)
    text = flat(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"--checkpoint {str(torn)!r} is incomplete" in text and "no COMPLETE file" in text, text
    assert "merging" not in proc.stdout and "evaluating" not in proc.stdout
    assert not os.path.exists(out / "eval" / "metrics.json")
    assert model_files(out) == [] and model_files(tmpdir_env) == []
    # the same save renamed by hand (no COMPLETE), given whole or as its trainer/
    renamed = tmp_path / "checkpoints" / "episode_000003"
    shutil.copytree(torn, renamed)
    # a complete checkpoint with a file deleted afterwards
    damaged = tmp_path / "checkpoints" / "episode_000004"
    shutil.copytree(ckpt["path"], damaged)
    (damaged / "trainer" / ".metadata").unlink()
    for given, pattern in [(renamed, "is incomplete: .* has no COMPLETE file"),
                           (renamed / "trainer", "is incomplete: .* has no COMPLETE file"),
                           (damaged, "is damaged: trainer/.metadata is missing")]:
        with pytest.raises(UserError, match=pattern):
            resolve_model(str(given), str(tmp_path / "merged"))
    assert not (tmp_path / "merged").exists()


EVAL_IN_PROCESS = """
import sys
from chatlearn.config.load import load_config
from chatlearn.runtime.driver.evaluate import evaluate_only
cfg = load_config("template/grpo_fsdp.yaml", sys.argv[3:])
evaluate_only(cfg, checkpoint=sys.argv[1], overwrite=True, keep_merged=sys.argv[2] == "keep")
"""


@pytest.mark.timeout(600)
def test_overwrite_replaces_the_result_and_keep_merged_keeps_the_model(ckpt, tmp_path, tmpdir_env):
    """``evaluate_only(..., overwrite=True)`` (``--overwrite``) replaces an earlier result, moved aside;
    ``keep_merged=True`` (``--keep-merged``) leaves the merged model under OUTPUT_DIR/eval/merged_model."""
    out = tmp_path / "out"
    (out / "eval").mkdir(parents=True)
    (out / "eval" / "metrics.json").write_text('{"old": true}')
    cmd = [sys.executable, "-c", EVAL_IN_PROCESS, str(ckpt["path"]), "keep", *EVAL,
           f"runtime_args.eval_data_path={ckpt['data']}", f"runtime_args.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmpdir_env)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out / "eval" / "metrics.json", encoding="utf-8") as f:
        result = json.load(f)
    merged = out / "eval" / "merged_model"
    assert result["model"] == str(merged) and result["model_deleted"] is False
    old = list((out / "eval").glob("metrics.json.old-*"))  # the earlier result moved aside, not deleted
    assert len(old) == 1 and old[0].read_text() == '{"old": true}', old
    assert (merged / "config.json").exists() and list(merged.glob("*.safetensors"))
    assert model_files(tmpdir_env) == []


@pytest.mark.timeout(600)
def test_the_merged_model_is_deleted_when_the_eval_fails_after_the_merge(ckpt, tmp_path, tmpdir_env):
    out = tmp_path / "out"
    # every prompt longer than 2 tokens: the evaluation stops on the data, after the merge
    proc = run_eval(out, ckpt["path"], ckpt["data"], tmpdir_env, "models.policy.max_prompt_tokens_length=2")
    assert proc.returncode == 2 and "max_prompt_tokens_length" in flat(proc.stderr), proc.stderr[-4000:]
    assert model_files(out) == [] and model_files(tmpdir_env) == []


@pytest.mark.timeout(600)
def test_the_merged_model_is_deleted_on_ctrl_c(ckpt, tmp_path, tmpdir_env):
    out, tmpdir = tmp_path / "out", tmpdir_env
    proc = subprocess.Popen(eval_command(out, ckpt["path"], ckpt["data"]), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmpdir)},
                            start_new_session=True,
                            preexec_fn=ctrl_c_reaches_it)
    merged = [out / "eval" / "merged_model" / "config.json"] + [p / "model" / "config.json" for p in
                                                               tmpdir.glob("chatlearn_eval_*")]
    deadline = time.time() + 120
    try:
        while not any(p.exists() for p in merged):
            assert proc.poll() is None, "the eval ended before it merged the model: " + proc.stderr.read()[-3000:]
            assert time.time() < deadline, "timed out waiting for the merged model"
            time.sleep(0.02)
            merged = merged[:1] + [p / "model" / "config.json" for p in tmpdir.glob("chatlearn_eval_*")]
        proc.send_signal(signal.SIGINT)  # the driver only, as Ctrl-C in a terminal reaches it first
        assert proc.wait(timeout=120) == 130, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert model_files(out) == [] and model_files(tmpdir) == []
