"""No copy of the config a run writes or prints shows a secret: a value read from the environment
(``${oc.env:...}``), an ``Authorization`` header in a reward function's kwargs, a URL's password.

The rules are in chatlearn/config/secrets.py (unit tests below); one real run (transformers rollout,
without Ray, TensorBoard and W&B offline on, a checkpoint) is searched sink by sink, byte by byte, and so
are a dry run of it and a resumed dry run whose secrets changed (the resume diff).
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO

from chatlearn.config.secrets import EnvSources, is_secret, redact, redact_argument, redact_text

ENV_SECRET = "env-s3cret-value-42"
HEADER_SECRET = "hdr-s3cret-token-17"
URL_SECRET = "url-s3cret-pw-99"
SECRETS = (ENV_SECRET, HEADER_SECRET, URL_SECRET)

REWARD = '''
def score(prompts, responses, ground_truths, data_sources, extra, judge_token_env, headers, endpoint):
    # the function still receives every value whole
    assert judge_token_env == "{env}", judge_token_env
    assert headers == {{"Authorization": "Bearer {hdr}"}}, headers
    assert endpoint == "https://alice:{url}@judge.example/v1", endpoint
    return [float(len(r) % 3) for r in responses]
'''


# ---------------------------------------------------------------- the rules


@pytest.mark.parametrize("name", ["Authorization", "authorization", "Cookie", "basic_auth", "proxy_auth"])
def test_header_names_are_secret(name):
    assert is_secret(name)


def test_values_are_redacted_wherever_they_appear():
    sources = EnvSources({"a.k": "${oc.env:X}"}, (ENV_SECRET,))
    cfg = {"a": {"k": ENV_SECRET, "copy": f"x {ENV_SECRET} y", "url": f"redis://bob:{URL_SECRET}@h:6379/0",
                 "note": f"Bearer {HEADER_SECRET}", "lst": [f"https://u:{URL_SECRET}@h"], "n": 3}}
    out = redact(cfg, sources)
    assert out == {"a": {"k": "${oc.env:X}", "copy": "x *** y", "url": "redis://bob:***@h:6379/0",
                         "note": "Bearer ***", "lst": ["https://u:***@h"], "n": 3}}
    assert redact_text("https://judge.example/v1?x=1") == "https://judge.example/v1?x=1"  # no credentials: kept


def test_command_line_arguments():
    assert redact_argument("models.reward.functions[0].kwargs.headers.Authorization=Bearer x") == \
        "models.reward.functions[0].kwargs.headers.Authorization=***"
    assert redact_argument(f"x.url=https://u:{URL_SECRET}@h") == "x.url=https://u:***@h"
    assert redact_argument("runtime_args.num_episode=3") == "runtime_args.num_episode=3"


# ---------------------------------------------------------------- a real run, sink by sink


def _config(tmp, out) -> str:
    with open(os.path.join(REPO, "template", "grpo_fsdp.yaml"), encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    reward = os.path.join(tmp, "judge.py")
    with open(reward, "w", encoding="utf-8") as f:
        f.write(REWARD.format(env=ENV_SECRET, hdr=HEADER_SECRET, url=URL_SECRET))
    cfg["models"]["reward"]["functions"] = [{"name": "judge", "path": f"{reward}:score", "kwargs": {
        "judge_token_env": "${oc.env:JUDGE_SECRET_FOR_TEST}",
        "headers": {"Authorization": f"Bearer {HEADER_SECRET}"},
        "endpoint": f"https://alice:{URL_SECRET}@judge.example/v1"}}]
    rt = cfg["runtime_args"]
    rt.update({"output_dir": str(out), "rollout_backend": "hf", "num_episode": 2, "sample_per_episode": 16,
               "train_global_batch_size": 16, "train_micro_batch_size": 16, "save_episode_interval": 2,
               "eval_episode_interval": 0, "enable_eval_before_training": False})
    rt.setdefault("log_args_dict", {}).update({"enable_tensorboard": True, "enable_wandb": True,
                                               "wandb_project": "secrets-test"})
    cfg["models"]["policy"]["num_inference_per_prompt"] = 4
    path = os.path.join(tmp, "config.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f)
    return path


def _chatlearn(tmp, *args, env_secret=ENV_SECRET):
    netrc = os.path.join(tmp, "netrc")
    open(netrc, "w").close()
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DIR")}
    env.update({"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "NETRC": netrc, "JUDGE_SECRET_FOR_TEST": env_secret,
                "WANDB_CONFIG_DIR": os.path.join(tmp, "wandb-config"), "PYTHONPATH": REPO})
    return subprocess.run([sys.executable, "-m", "chatlearn.cli", "run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secrets")
    out = tmp / "out"
    config = _config(str(tmp), out)
    run = _chatlearn(str(tmp), config)
    assert run.returncode == 0, run.stdout + run.stderr
    return {"tmp": str(tmp), "out": out, "config": config, "console": run.stdout + run.stderr}


def _leaks(paths) -> list:
    found = []
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        found += [(str(path), s) for s in SECRETS if s.encode() in data]
    return found


def _files(folder) -> list:
    return [p for p in glob.glob(os.path.join(folder, "**", "*"), recursive=True) if os.path.isfile(p)]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sink", ["config.yaml", "checkpoints", "configs", "logs", "tensorboard", "wandb",
                                  "metrics and samples", "console"])
def test_no_secret_in_sink(secret_run, sink):
    out = secret_run["out"]
    if sink == "console":
        assert not [s for s in SECRETS if s in secret_run["console"]]
        return
    paths = {"config.yaml": [out / "config.yaml"], "metrics and samples": glob.glob(str(out / "*.jsonl"))}.get(sink)
    if paths is None:
        paths = _files(out / sink)
    assert paths, f"the run wrote nothing to {sink}"
    assert _leaks(paths) == []
    if sink in ("config.yaml", "checkpoints"):  # the environment's value kept as its interpolation
        written = out / "config.yaml" if sink == "config.yaml" else out / "checkpoints" / "episode_000002" / "config.yaml"
        text = written.read_text()
        assert "judge_token_env: ${oc.env:JUDGE_SECRET_FOR_TEST}" in text
        assert "Authorization: '***'" in text and "https://alice:***@judge.example/v1" in text


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("flags", [["--dry-run"], ["--dry-run", "--all"]])
def test_no_secret_in_dry_run(secret_run, flags):
    run = _chatlearn(secret_run["tmp"], secret_run["config"], "runtime_args.num_episode=3", *flags)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not [s for s in SECRETS if s in run.stdout + run.stderr]
    assert "${oc.env:JUDGE_SECRET_FOR_TEST}" in run.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_no_secret_in_resume_diff(secret_run):
    """A resumed dry run whose secrets changed: the diff against the checkpoint's config shows neither value."""
    text = open(secret_run["config"], encoding="utf-8").read()
    changed = os.path.join(secret_run["tmp"], "changed.yaml")
    with open(changed, "w", encoding="utf-8") as f:
        f.write(text.replace(HEADER_SECRET, "hdr-n3w-token").replace(URL_SECRET, "url-n3w-pw"))
    run = _chatlearn(secret_run["tmp"], changed, "runtime_args.num_episode=3", "--dry-run", env_secret="env-n3w-value")
    shown = run.stdout + run.stderr
    assert not [s for s in SECRETS + ("hdr-n3w-token", "url-n3w-pw", "env-n3w-value") if s in shown]
    assert run.returncode == 0, shown
