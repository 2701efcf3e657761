"""A resume that notices what changed: every checkpoint records the config it was trained with, and a
rerun in the same output folder compares its config with it before anything is written or started.

One real run of 2 episodes (a module fixture, in a subprocess) leaves checkpoints; each test resumes a
copy of it in this process, with ``--dry-run`` or with a start that is refused before Ray starts, or
that is stopped where the cluster would start (the config is recorded before that). docs/reliability.md
has the rules in prose."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from shared_runs import RUNS, command, finished, run_env

from chatlearn.cli import main
from conftest import REPO, write_arith

TEMPLATE = "template/grpo_fsdp.yaml"
SECRET = "sk-live-resume-0123456789"
RUN = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=8", "runtime_args.train_global_batch_size=8",
       "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
       "runtime_args.enable_eval_before_training=False", "runtime_args.eval_episode_interval=0",
       "runtime_args.save_episode_interval=1", "runtime_args.rollout_backend=hf", "models.policy_trainer.save_hf=false"]
LR_CHANGE = "models.policy_trainer.optimizer.lr=0.005"  # x50 the template's 1e-4
CKPT = os.path.join("checkpoints", "episode_000002")


def reward_with_secret(folder) -> str:
    """A reward function whose kwargs hold an API key: what every copy of the config must mask."""
    path = os.path.join(folder, "my_reward.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write("def score(*, prompts, responses, ground_truths, data_sources, extra, api_key):\n"
                "    return [float(len(r) % 2) for r in responses]\n")
    return f"models.reward.functions=[{{name: mine, path: '{path}:score', kwargs: {{api_key: {SECRET}}}}}]"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(output folder of a finished 2-episode run, the overrides it ran with but output_dir)."""
    folder = tmp_path_factory.mktemp("resume_config")
    base = [*RUN, reward_with_secret(str(folder))]
    out = folder / "out"
    proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", "run", TEMPLATE, *base,
                           f"runtime_args.output_dir={out}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return str(out), base


@pytest.fixture
def out(trained, tmp_path, monkeypatch):
    """A copy of the trained run to resume; the current directory is the repository."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("CHATLEARN_DEBUG", raising=False)
    copy = str(tmp_path / "out")
    shutil.copytree(trained[0], copy)
    return copy


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray must not start in these tests")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture
def stop_at_cluster(monkeypatch):
    """A run that gets as far as its checkpoint's load stops right after it as on Ctrl-C (exit 130),
    without starting a cluster or building a model: what it wrote before (config.yaml, configs/) is what
    a real resumed run writes before training."""
    import chatlearn.runtime.driver.run as run_module

    class NoCluster:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def startup_times(self):
            return {}

    class Restored:
        # the watchdog the run's start-up calls are watched by: nothing to watch here
        sched = SimpleNamespace(watchdog=SimpleNamespace(watch=lambda *args, **kwargs: contextlib.nullcontext()))

        def __init__(self, *args, **kwargs):
            pass

        def train(self, on_resumed=None):
            if on_resumed is not None:
                on_resumed()  # where a real run records its config: the checkpoint loaded
            raise KeyboardInterrupt

        def close(self):
            pass

    monkeypatch.setattr(run_module, "Cluster", lambda *args, **kwargs: NoCluster())
    monkeypatch.setattr(run_module, "Engine", Restored)


def resume(trained, out, *extra):
    return main(["run", TEMPLATE, *trained[1], f"runtime_args.output_dir={out}", *extra])


def snapshot(folder) -> dict:
    """Every file under ``folder`` with a hash of its content."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


def flat(text: str) -> str:
    return " ".join(text.split())


def error_paragraph(err: str) -> str:
    message = err[err.index("error: "):].strip()
    assert "\n\n" not in message and "Traceback" not in err, err
    return flat(message)


@pytest.mark.slow  # reads or resumes the module's whole run
def test_every_checkpoint_records_its_config_with_secrets_masked(trained):
    import yaml

    out = trained[0]
    for episode in (1, 2):
        path = os.path.join(out, "checkpoints", f"episode_{episode:06d}", "config.yaml")
        text = open(path, encoding="utf-8").read()
        assert SECRET not in text and "api_key: '***'" in text
        assert yaml.safe_load(text)["models"]["policy_trainer"]["optimizer"]["lr"] == 0.0001
        manifest = json.load(open(os.path.join(os.path.dirname(path), "manifest.json")))
        assert "config.yaml" in manifest["files"]  # written inside the checkpoint, before COMPLETE
    assert open(os.path.join(out, CKPT, "config.yaml")).read() == open(os.path.join(out, "config.yaml")).read()
    # the run folder's history of configs starts with the fresh start's
    history = [json.loads(line) for line in open(os.path.join(out, "configs", "history.jsonl"))]
    assert len(history) == 1 and history[0]["resumed_from"] is None and history[0]["accepted"] == []
    assert os.path.isfile(os.path.join(out, "configs", history[0]["file"]))


@pytest.mark.slow  # reads or resumes the module's whole run
def test_a_learning_rate_change_is_refused_and_nothing_is_written(trained, out, no_ray, capsys):
    before = snapshot(out)
    for dry in ([], ["--dry-run"]):
        assert resume(trained, out, LR_CHANGE, *dry) == 2
        err = error_paragraph(capsys.readouterr().err)
        for words in ("models.policy_trainer.optimizer.lr: 0.0001 -> 0.005", "episode 2", "--accept-config-changes",
                      os.path.join(out, CKPT, "config.yaml")):
            assert words in err, err
        assert "runtime_args.output_dir:" not in err  # a harmless difference is no reason to refuse
        assert snapshot(out) == before  # config.yaml untouched, no lock left, no log row


@pytest.mark.slow  # reads or resumes the module's whole run
def test_an_accepted_change_is_recorded(trained, out, no_ray, stop_at_cluster, capsys):
    metrics = open(os.path.join(out, "metrics.jsonl")).read()
    # --dry-run with the flag: the diff, then the plan; nothing written
    before = snapshot(out)
    assert resume(trained, out, LR_CHANGE, "--accept-config-changes", "--dry-run") == 0
    text = flat(capsys.readouterr().out)
    assert "models.policy_trainer.optimizer.lr: 0.0001 -> 0.005" in text and "# plan" in text
    assert snapshot(out) == before
    # a start with the flag records the new config, keeps the old one and notes the accepted key
    assert resume(trained, out, LR_CHANGE, "--accept-config-changes") == 130
    captured = capsys.readouterr()
    assert "accepted" in captured.out and "models.policy_trainer.optimizer.lr" in captured.out
    assert "lr: 0.005" in open(os.path.join(out, "config.yaml")).read()
    history = [json.loads(line) for line in open(os.path.join(out, "configs", "history.jsonl"))]
    assert len(history) == 2
    assert history[-1]["resumed_from"] == 2 and history[-1]["accepted"] == ["models.policy_trainer.optimizer.lr"]
    assert history[-1]["changes"]["models.policy_trainer.optimizer.lr"] == [0.0001, 0.005]
    kept = [open(os.path.join(out, "configs", row["file"])).read() for row in history]
    assert "lr: 0.0001" in kept[0] and "lr: 0.005" in kept[1] and SECRET not in kept[1]
    assert open(os.path.join(out, "metrics.jsonl")).read() == metrics
    assert not os.path.exists(os.path.join(out, "run.lock"))


@pytest.mark.slow  # reads or resumes the module's whole run
def test_a_harmless_change_is_shown_and_accepted(trained, out, no_ray, stop_at_cluster, capsys):
    assert resume(trained, out, "runtime_args.num_episode=3", "--dry-run") == 0
    text = flat(capsys.readouterr().out)
    assert "runtime_args.num_episode: 2 -> 3" in text and "# plan" in text
    assert resume(trained, out, "runtime_args.num_episode=3") == 130  # no flag needed
    assert "runtime_args.num_episode: 2 -> 3" in flat(capsys.readouterr().out)
    history = [json.loads(line) for line in open(os.path.join(out, "configs", "history.jsonl"))]
    assert history[-1]["accepted"] == [] and history[-1]["changes"]["runtime_args.num_episode"] == [2, 3]


@pytest.mark.parametrize("change, key", [
    ("data", "runtime_args.data_path"),
    ("models.policy.num_inference_per_prompt=2", "models.policy.num_inference_per_prompt: 4 -> 2"),
    ("runtime_args.sample_per_episode=16", "runtime_args.sample_per_episode: 8 -> 16"),
])
@pytest.mark.slow  # reads or resumes the module's whole run
def test_a_change_of_data_or_sampling_is_refused(trained, out, no_ray, capsys, change, key):
    if change == "data":  # 9800 prompts, then a file of 5
        change = f"runtime_args.data_path={write_arith(os.path.join(os.path.dirname(out), 'five.jsonl'), 5)}"
    before = snapshot(out)
    assert resume(trained, out, change) == 2
    err = error_paragraph(capsys.readouterr().err)
    assert key in err and "--accept-config-changes" in err, err
    assert snapshot(out) == before


@pytest.mark.slow  # reads or resumes the module's whole run
def test_a_checkpoint_without_a_config_resumes_with_a_warning(trained, out, no_ray, capsys):
    """A checkpoint of an older chatlearn: no config.yaml (nor in its manifest)."""
    for entry in os.listdir(os.path.join(out, "checkpoints")):
        folder = os.path.join(out, "checkpoints", entry)
        if entry.startswith("episode_"):
            os.remove(os.path.join(folder, "config.yaml"))
            manifest = json.load(open(os.path.join(folder, "manifest.json")))
            del manifest["files"]["config.yaml"]
            json.dump(manifest, open(os.path.join(folder, "manifest.json"), "w"))
    assert resume(trained, out, LR_CHANGE, "--dry-run") == 0
    captured = capsys.readouterr()
    warning = [line for line in (captured.out + captured.err).splitlines() if "cannot be checked" in line]
    assert len(warning) == 1 and "episode_000002" in warning[0], captured.out + captured.err


@pytest.mark.slow  # reads or resumes the module's whole run
def test_the_same_data_path_with_other_contents_is_refused(trained, out, no_ray, capsys):
    """The data file rewritten in place (the checkpoint's sampler counted 9801 prompts, the file holds 9800):
    refused once the data is read, before the folder is locked or written."""
    state_path = os.path.join(out, CKPT, "state.json")
    state = open(state_path).read()
    assert '"size": 9800' in state
    with open(state_path, "w") as f:
        f.write(state.replace('"size": 9800', '"size": 9801'))  # as many bytes: the manifest still matches
    before = snapshot(out)
    assert resume(trained, out) == 2
    err = error_paragraph(capsys.readouterr().err)
    assert "runtime_args.data_path (number of prompts): 9801 -> 9800" in err and "--accept-config-changes" in err
    assert snapshot(out) == before


@pytest.mark.slow  # reads or resumes the module's whole run
def test_the_same_data_spelled_another_way_is_the_same_data(trained, out, no_ray, capsys):
    """Each checkpoint records the data's fingerprint (absolute paths, sizes, hashes): the same file named
    by its absolute path is a harmless change, not a refusal."""
    state = json.load(open(os.path.join(out, CKPT, "state.json")))
    assert state["data"][0]["path"] == os.path.join(REPO, "assets", "arith", "train.jsonl"), state["data"]
    assert state["data"][0]["files"][0]["size"] == os.path.getsize(state["data"][0]["path"])
    spelled = f"runtime_args.data_path={os.path.join(REPO, 'assets', 'arith', 'train.jsonl')}"
    assert resume(trained, out, spelled, "--dry-run") == 0, capsys.readouterr().err
    text = flat(capsys.readouterr().out)
    assert "runtime_args.data_path: 'assets/arith/train.jsonl' -> " in text and "(harmless)" in text, text


@pytest.mark.slow  # reads or resumes the module's whole run
def test_a_relative_data_path_resolved_elsewhere_is_other_data(trained, out, no_ray, stop_at_cluster, tmp_path,
                                                               monkeypatch, capsys):
    """The same relative data path from another directory names another file of as many prompts (one row
    rewritten): refused by content before anything is loaded or written."""
    other = tmp_path / "elsewhere"
    (other / "assets" / "arith").mkdir(parents=True)
    rows = open(os.path.join(REPO, "assets", "arith", "train.jsonl"), encoding="utf-8").readlines()
    first = json.loads(rows[0])
    first[next(k for k, v in first.items() if isinstance(v, str))] += " (rewritten)"
    (other / "assets" / "arith" / "train.jsonl").write_text(json.dumps(first) + "\n" + "".join(rows[1:]))
    os.symlink(os.path.join(REPO, "assets", "arith", "eval.jsonl"), other / "assets" / "arith" / "eval.jsonl")
    os.symlink(os.path.join(REPO, "assets", "tiny_qwen2"), other / "assets" / "tiny_qwen2")
    monkeypatch.chdir(other)
    before = snapshot(out)
    assert main(["run", os.path.join(REPO, TEMPLATE), *trained[1], f"runtime_args.output_dir={out}"]) == 2
    err = error_paragraph(capsys.readouterr().err)
    for words in ("runtime_args.data_path (content):", os.path.join(REPO, "assets", "arith", "train.jsonl"),
                  str(other / "assets" / "arith" / "train.jsonl"), "--accept-config-changes"):
        assert words in err, (words, err)
    assert snapshot(out) == before


@pytest.mark.slow  # resumes the suite's shared LoRA run up to its checkpoint's load
@pytest.mark.timeout(400)
def test_a_resume_refused_at_the_checkpoint_load_writes_no_config(tmp_path):
    """A LoRA rank the checkpoint's adapters were not trained with, accepted with --accept-config-changes,
    is refused when the trainer loads the checkpoint: config.yaml and configs/ stay as they were."""
    out = finished("lora").check().copy_to(tmp_path / "out")
    kept = {name: open(os.path.join(out, name)).read() for name in ("config.yaml", "configs/history.jsonl")}
    configs = sorted(os.listdir(out / "configs"))
    proc = subprocess.run([*command(RUNS["lora"], out), "models.policy_trainer.lora.rank=4", "--accept-config-changes"],
                          cwd=REPO, capture_output=True, text=True, timeout=380, env=run_env(RUNS["lora"], tmp_path))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "lora" in error_paragraph(proc.stderr) and "rank" in proc.stderr, proc.stderr[-3000:]
    assert {name: open(os.path.join(out, name)).read() for name in kept} == kept
    assert sorted(os.listdir(out / "configs")) == configs
