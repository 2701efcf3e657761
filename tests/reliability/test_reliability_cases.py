"""What happens when: one row per case, through the CLI in this process (no Ray is started).

Each row: the situation (set up in a scratch folder), the command, the expected exit code, the
words the output must contain and the words it must not contain. Errors are one paragraph on
stderr without a traceback. The cases with a real training run are in test_reliability_e2e.py;
docs/reliability.md has the table in prose.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from chatlearn.cli import main
from chatlearn.config import sizes
from conftest import REPO

TEMPLATE = "template/grpo_fsdp.yaml"
SECRET = "sk-live-0123456789abcdef"


@dataclass
class Ctx:
    tmp: str
    model: str
    base: list  # overrides for a valid config, output in OUT
    env: dict = field(default_factory=dict)  # environment variables a row sets for its command

    @property
    def out(self) -> str:
        return os.path.join(self.tmp, "out")

    def file(self, rel: str, content: str) -> str:
        path = os.path.join(self.tmp, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(content)
        return path


def old_run(c: Ctx, episodes=5) -> None:
    """What a finished run leaves: metrics, a timeline, checkpoints and ``latest``."""
    c.file("out/metrics.jsonl", "".join(json.dumps({"episode": e}) + "\n" for e in range(episodes + 1)))
    c.file("out/timeline.jsonl", json.dumps({"episode": 1, "kind": "stage"}) + "\n")
    for e in range(1, episodes + 1):
        c.file(f"out/checkpoints/episode_{e:06d}/COMPLETE", "ok\n")
        c.file(f"out/checkpoints/episode_{e:06d}/state.json", json.dumps({"episode": e, "run_id": "old"}))
    c.file("out/checkpoints/latest", f"episode_{episodes:06d}\n")


def lock(c: Ctx, pid: int, host: str | None = None) -> dict:
    holder = {"pid": pid, "host": host or socket.gethostname(), "started": "2026-01-02 03:04:05 +0000",
              "pid_start": None, "command": "chatlearn run first.yaml", "token": "t0"}
    c.file("out/run.lock", json.dumps(holder))
    return holder


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*extra, dry=False):
    return lambda c: ["run", TEMPLATE, *c.base, *extra, *(["--dry-run"] if dry else [])]


def then(setup, argv):
    def make(c):
        setup(c)
        return argv(c)
    return make


def secret_reward(c: Ctx) -> str:
    path = c.file("my_reward.py", "def score(*, prompts, responses, ground_truths, data_sources, extra, api_key):\n"
                                  "    return [0.0 for _ in responses]\n")
    return f"models.reward.functions=[{{name: mine, path: '{path}:score', kwargs: {{api_key: {SECRET}}}}}]"


# ------------------------------------------------------------------ merge: a checkpoint whose model names code
def remote_code_checkpoint(c: Ctx) -> str:
    """A trainer checkpoint recording ``trust_remote_code: true`` whose model folder's config.json
    names Python code (auto_map) that leaves a marker file when it runs."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    from chatlearn.checkpoint import sharded

    model = os.path.join(c.tmp, "remote_model")
    shutil.copytree(c.model, model, ignore=shutil.ignore_patterns("*.safetensors"))
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    config["auto_map"] = {"AutoConfig": "configuration_mine.MineConfig"}
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    c.file("remote_model/configuration_mine.py",
           "import os\nopen(os.environ['RELIABILITY_CODE_MARKER'], 'w').write('ran')\n"
           "from transformers import Qwen2Config\n\nclass MineConfig(Qwen2Config):\n    pass\n")
    ckpt = os.path.join(c.tmp, "ckpt")
    os.makedirs(ckpt)
    with pytest.warns(UserWarning):  # DCP without a process group: a single-process save
        dcp.save({"model.model.embed_tokens.weight": torch.zeros(4, 4)}, checkpoint_id=ckpt)
    sharded.write_meta(ckpt, {"hf_source": model, "trust_remote_code": True, "tied": {}})
    sharded.mark_complete(ckpt)
    return ckpt


def truths_data(c: Ctx, *truths) -> str:
    """The override of a train data file whose rows have these ground truths."""
    rows = [json.dumps({"prompt": f"What is {i} + 2?", "reward_model": {"ground_truth": t}})
            for i, t in enumerate(truths)]
    return f"runtime_args.data_path={c.file('truths.jsonl', chr(10).join(rows) + chr(10))}"


def merge(*flags):
    return lambda c: ["merge", remote_code_checkpoint(c), os.path.join(c.tmp, "merged"), *flags]


def model_without(*names):
    """A copy of the test model folder without the files ``names``; the run loads it."""
    def setup(c: Ctx) -> list:
        folder = os.path.join(c.tmp, "partial_model")
        shutil.copytree(c.model, folder, ignore=shutil.ignore_patterns(*names))
        return run(f"models.policy_trainer.load={folder}")(c)
    return setup


def model_truncated(c: Ctx) -> list:
    """A copy of the test model folder whose model.safetensors lost its last 1000 bytes; --dry-run."""
    folder = os.path.join(c.tmp, "cut_model")
    shutil.copytree(c.model, folder)
    weights = os.path.join(folder, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) - 1000)
    return run(f"models.policy_trainer.load={folder}", dry=True)(c)


def model_config_edited(**changes):
    """A copy of the test model folder whose config.json was edited after its weights were written; --dry-run."""
    def setup(c: Ctx) -> list:
        folder = os.path.join(c.tmp, "edited_model")
        shutil.copytree(c.model, folder)
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        config.update(changes)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        return run(f"models.policy_trainer.load={folder}", dry=True)(c)
    return setup


# id, argv(ctx), exit code, words the output must hold ({out}: the output folder, {pid}: the holder's),
# words it must not hold
CASES = [
    # 1. a fresh start into a folder that holds a run
    ("--no-resume into a used folder", then(old_run, run("--no-resume")), 2,
     ["{out}", "already holds a run", "checkpoints/", "metrics.jsonl", "--overwrite", "nothing is deleted",
      "another runtime_args.output_dir", "run without --no-resume"], ["Traceback"]),
    ("enable_resume_training=false into a used folder",
     then(old_run, run("runtime_args.enable_resume_training=false")), 2,
     ["{out}", "already holds a run", "--overwrite"], ["Traceback"]),
    ("--no-resume --dry-run into a used folder", then(old_run, run("--no-resume", dry=True)), 2,
     ["{out}", "already holds a run", "--overwrite"], ["# plan"]),
    ("--overwrite --dry-run says what it would move", then(old_run, run("--overwrite", dry=True)), 0,
     ["# plan", "--overwrite: the run in {out} would be moved to {out}.old-<time>"], []),
    ("--no-resume into a folder with only config.yaml",
     then(lambda c: c.file("out/config.yaml", "x: 1\n"), run("--no-resume", dry=True)), 0, ["# plan"], []),
    ("--overwrite when the data is inside the folder",
     lambda c: (old_run(c), run("--overwrite", f"runtime_args.data_path={c.file('out/train.jsonl', ARITH)}")(c))[1],
     2, ["--overwrite would move", "{out}", "runtime_args.data_path", "is inside it"], ["Traceback"]),
    # 3. a second run into a folder in use
    ("a run is using the folder", then(lambda c: lock(c, os.getpid()), run()), 2,
     ["{out}", "is in use by process {pid} on host", "started 2026-01-02 03:04:05", "chatlearn run first.yaml",
      "Wait for that run to finish"], ["Traceback"]),
    ("a run on another host holds the lock", then(lambda c: lock(c, 1, host="elsewhere-node"), run()), 2,
     ["is in use by process 1 on host elsewhere-node", "cannot be checked from here", "delete",
      "run.lock"], ["Traceback"]),
    ("--dry-run while a run uses the folder", then(lambda c: lock(c, os.getpid()), run(dry=True)), 0,
     ["# note:", "is in use by process {pid}", "a run now would be refused"], []),
    # 5. merge never runs a checkpoint's code on the checkpoint's word
    ("merge: checkpoint says trust_remote_code", merge(), 2,
     ["needs the Python code", "auto_map", "configuration_mine.MineConfig",
      "a checkpoint's own metadata cannot allow running code", "--trust-remote-code"], ["Traceback"]),
    ("merge into a path under a file",
     lambda c: ["merge", remote_code_checkpoint(c), os.path.join(c.file("afile", "x"), "merged")], 2,
     ["chatlearn merge cannot write its output folder", "afile/merged", "which is a file, not a folder"],
     ["Traceback", "NotADirectoryError", "auto_map"]),
    ("merge into the checkpoint it reads",
     lambda c: (lambda ck: ["merge", ck, os.path.join(ck, "hf_out")])(remote_code_checkpoint(c)), 2,
     ["lies inside the checkpoint", "Name a folder outside the checkpoint"], ["Traceback", "auto_map"]),
    ("merge into a folder that is a file",
     lambda c: ["merge", remote_code_checkpoint(c), c.file("merged", "x")], 2,
     ["chatlearn merge cannot write its output folder", "it is a file"], ["Traceback"]),
    # the output folder inside a checkpoint, or inside a run's checkpoints/
    ("output_dir inside a checkpoint",
     lambda c: (old_run(c), run(f"runtime_args.output_dir={c.out}/checkpoints/episode_000005/hf/new", dry=True)(c))[1],
     2, ["runtime_args.output_dir", "lies inside the checkpoint", "episode_000005", "would be written among the "
         "checkpoint's and damage it"], ["Traceback", "# plan"]),
    ("output_dir inside a run's checkpoints/",
     lambda c: (old_run(c), run(f"runtime_args.output_dir={c.out}/checkpoints/run2", dry=True)(c))[1], 2,
     ["runtime_args.output_dir", "lies inside a run's checkpoints/ folder", "{out}/checkpoints"], ["Traceback"]),
    # 4. non-finite numbers in the config
    ("lr=inf", run("models.policy_trainer.optimizer.lr=inf", dry=True), 2,
     ["models.policy_trainer.optimizer.lr", "must be a finite number, got inf", "cannot hold inf or nan"],
     ["Traceback", "# plan"]),
    ("lr=nan names lr", run("models.policy_trainer.optimizer.lr=nan", dry=True), 2,
     ["models.policy_trainer.optimizer.lr: must be a finite number, got nan"], ["lr_warmup_init", "Traceback"]),
    ("a reward weight of -inf", run("models.reward.functions=[{name: m, path: 'builtin:math', weight: -.inf}]",
                                    dry=True), 2,
     ["models.reward.functions[0].weight: must be a finite number, got -inf"], ["Traceback"]),
    ("max_nonfinite_steps=0", run("models.policy_trainer.optimizer.max_nonfinite_steps=0", dry=True), 2,
     ["models.policy_trainer.optimizer.max_nonfinite_steps", "positive integer"], ["Traceback"]),
    # 8. reward timeout setting
    ("a negative reward timeout", run("models.reward.timeout_s=-1", dry=True), 2,
     ["models.reward.timeout_s", "must be >= 0"], ["Traceback"]),
    # 9. a RAY_ADDRESS where no cluster listens: refused at once, before Ray is started
    ("RAY_ADDRESS where nothing listens",
     lambda c: (c.env.update(RAY_ADDRESS=f"127.0.0.1:{closed_port()}"), run()(c))[1], 2,
     ["could not reach the Ray cluster at RAY_ADDRESS='127.0.0.1:", "connection refused", "ray start --head",
      "unset RAY_ADDRESS to run on this machine alone"], ["Traceback"]),
    ("ray_connect_timeout_s=0", run("runtime_args.ray_connect_timeout_s=0", dry=True), 2,
     ["runtime_args.ray_connect_timeout_s", "must be > 0"], ["Traceback"]),
    # 7. a model folder is checked at validation: config, weights, tokenizer; Hub ids resolve or say why not
    ("a model folder without tokenizer files", model_without("tokenizer.json", "tokenizer_config.json"), 2,
     ["models.policy_trainer.load", "partial_model", "no tokenizer files (tokenizer.json", "add what is missing"],
     ["Traceback", "no weights", "no config.json"]),
    ("a model folder without weights", model_without("*.safetensors"), 2,
     ["models.policy_trainer.load", "no weights (model.safetensors"], ["Traceback", "no tokenizer"]),
    ("a model folder without config.json and weights", model_without("config.json", "*.safetensors"), 2,
     ["no config.json (the model's configuration); no weights"], ["Traceback"]),
    ("a truncated safetensors file in the model folder", model_truncated, 2,
     ["models.policy_trainer.load", "cut_model/model.safetensors", "bytes, but its header places",
      "truncated", "download or copy the model again"], ["Traceback"]),
    ("config.json with another hidden_size than the weights", model_config_edited(hidden_size=256), 2,
     ["models.policy_trainer.load", "edited_model", "its config.json does not describe its weights",
      "model.embed_tokens.weight in model.safetensors has shape [320, 128], but config.json (vocab_size 320, "
      "hidden_size 256) implies [320, 256]", "restore the config.json that came with these weights"],
     ["Traceback", "# plan"]),
    ("config.json with more layers than the weights", model_config_edited(num_hidden_layers=4), 2,
     ["edited_model", "the weights hold 2 layers (layers.0 to layers.1), but config.json has num_hidden_layers 4"],
     ["Traceback", "# plan"]),
    ("load names a file in the model folder",
     lambda c: run(f"models.policy_trainer.load={os.path.join(c.model, 'config.json')}", dry=True)(c), 2,
     ["models.policy_trainer.load", "is a file", "must be a model folder"], ["Traceback", "does not exist"]),
    # 11. errors up front, naming the key, before anything starts (all at --dry-run)
    ("colocation given as a string", run("runtime_args.colocation=policy,policy_trainer", dry=True), 2,
     ["runtime_args.colocation: must be a list", "runtime_args.colocation=[policy,policy_trainer,ref_policy]"],
     ["Traceback", "AnyNode", "ListConfig"]),
    ("temperature: nan", run("models.policy.temperature=nan", dry=True), 2,
     ["models.policy.temperature", "inf or nan"], ["Traceback", "# plan"]),
    ("eval_temperature: nan", run("models.policy.eval_temperature=nan", dry=True), 2,
     ["models.policy.eval_temperature", "inf or nan"], ["Traceback", "# plan"]),
    ("seed: 1e23", run("runtime_args.seed=1e23", dry=True), 2,
     ["runtime_args.seed", "could not be converted to Integer"], ["Traceback", "# plan"]),
    ("seed out of range", run("models.policy.seed=99999999999999", dry=True), 2,
     ["models.policy.seed: is 99999999999999; a seed must be an integer from 0 to 4294967295"],
     ["Traceback", "# plan"]),
    ("a negative seed", run("runtime_args.seed=-1", dry=True), 2,
     ["runtime_args.seed: is -1"], ["Traceback", "# plan"]),
    ("prompt + response longer than the model's context",
     run("models.policy.max_prompt_tokens_length=4000", "models.policy.max_response_tokens_length=1000", dry=True),
     2, ["models.policy.max_prompt_tokens_length (4000) + models.policy.max_response_tokens_length (1000) = 5000",
         "the model takes (max_position_embeddings in", "Lower one of them"], ["Traceback", "# plan"]),
    ("an empty data file", lambda c: run(f"runtime_args.data_path={c.file('empty/a.jsonl', chr(10))}", dry=True)(c),
     2, ["runtime_args.data_path", "is empty (no rows)"], ["Traceback", "# plan"]),
    ("a data folder of empty files",
     lambda c: run(f"runtime_args.data_path={os.path.dirname(c.file('empty/a.jsonl', ''))}", dry=True)(c), 2,
     ["runtime_args.data_path", "holds only empty files (no rows)"], ["Traceback", "# plan"]),
    ("a data folder without data files",
     lambda c: run(f"runtime_args.data_path={os.path.dirname(c.file('nodata/readme.txt', 'x'))}", dry=True)(c), 2,
     ["runtime_args.data_path", "holds no .jsonl, .json or .parquet file"], ["Traceback", "# plan"]),
    ("a Hub model id not in the cache, offline", run("models.policy_trainer.load=acme/not-cached", dry=True), 2,
     ["models.policy_trainer.load", "'acme/not-cached' is not a local path", "HF_HUB_OFFLINE=1",
      "hf download acme/not-cached"], ["Traceback", "# plan"]),
    # the dry run reads the data as a run does
    ("--dry-run with a malformed jsonl line",
     lambda c: run(f"runtime_args.data_path={c.file('bad/a.jsonl', ARITH + '{not json' + chr(10))}", dry=True)(c),
     2, ["bad/a.jsonl:2: malformed JSON", "fix or remove that line"], ["Traceback", "# plan"]),
    ("--dry-run with a row without the prompt key",
     lambda c: run(f"runtime_args.data_path={c.file('bad/b.jsonl', ARITH + json.dumps({'question': 'x'}) + chr(10))}",
                   dry=True)(c),
     2, ["bad/b.jsonl:2: the row has no 'prompt' field (it has: question)", "runtime_args.prompt_key"],
     ["Traceback", "# plan"]),
    ("--dry-run with eval data without the ground truth",
     lambda c: run(f"runtime_args.eval_data_path={c.file('bad/e.jsonl', json.dumps({'prompt': 'x'}) + chr(10))}",
                   dry=True)(c),
     2, ["bad/e.jsonl:1: the row has no 'reward_model.ground_truth' field"], ["Traceback", "# plan"]),
    ("--dry-run counts the prompts it read", run(dry=True), 0,
     ["# plan", "train data: 64 prompts", "eval data: 16 prompts"], []),
    # an environment variable the config interpolates is not set
    ("an unset ${oc.env:VAR} names the key that holds it",
     lambda c: run("runtime_args.output_dir=${oc.env:CHATLEARN_TEST_UNSET_DIR}/out", dry=True)(c), 2,
     ["runtime_args.output_dir: uses the environment variable CHATLEARN_TEST_UNSET_DIR, which is not set",
      "export CHATLEARN_TEST_UNSET_DIR=", "${{oc.env:CHATLEARN_TEST_UNSET_DIR,default}}"],
     ["Traceback", "log_dir", "# plan"]),
    ("an unset ${oc.env:VAR} in a reward function's kwargs",
     lambda c: run("models.reward.functions=[{name: m, path: 'builtin:math', "
                   "kwargs: {api_key: '${oc.env:CHATLEARN_TEST_UNSET_KEY}'}}]", dry=True)(c), 2,
     ["models.reward.functions[0].kwargs.api_key: uses the environment variable CHATLEARN_TEST_UNSET_KEY"],
     ["Traceback"]),
    # a list entry, a section or a resolver the command line gets wrong: one paragraph naming the key
    ("an override of a list entry that does not exist",
     run("models.reward.functions=[{name: m, path: 'builtin:math'}]", "models.reward.functions[3].weight=2",
         dry=True), 2,
     ["models.reward.functions: has one entry, [0], so 'models.reward.functions[3].weight=2'",
      "give the whole list"], ["Traceback", "# plan"]),
    ("a mapping where a list belongs", run("models.reward.functions.weight=2", dry=True), 2,
     ["models.reward.functions: must be a list, but the command line gives it a mapping (weight)",
      "models.reward.functions[0].<key>=value"], ["Traceback", "incompatible container", "# plan"]),
    ("a single value for a section", run("models.policy=3", dry=True), 2,
     ["models.policy: is a section of keys (", "gives it a single value (3)", "models.policy.num_gpu=..."],
     ["Traceback", "Merge error", "# plan"]),
    ("an unknown resolver names the key that holds it",
     run("runtime_args.exp_name=${nosuch:x}", "runtime_args.output_dir=${runtime_args.exp_name}", dry=True), 2,
     ["runtime_args.exp_name: uses the resolver 'nosuch'", "which does not exist", "oc.env"],
     ["Traceback", "output_dir:", "# plan"]),
    ("a huge stage timeout", run("runtime_args.stage_timeout_s=1e300", dry=True), 2,
     ["runtime_args.stage_timeout_s: is 1e+300 seconds, more than the largest accepted, 100000000",
      "or 0 for no deadline"], ["Traceback", "# plan"]),
    ("a huge reward timeout", run("models.reward.timeout_s=1e20", dry=True), 2,
     ["models.reward.timeout_s: is 1e+20 seconds, more than the largest accepted, 100000000"],
     ["Traceback", "# plan"]),
    ("an episode larger than the machine's memory",
     run("runtime_args.sample_per_episode=1000000000000", "runtime_args.train_global_batch_size=1000000000",
         dry=True), 2,
     ["runtime_args.sample_per_episode: is 1000000000000", "held by the driver", "need about",
      "of memory available", "allows at most about"], ["Traceback", "# plan"]),
    # 6. secrets are never printed
    ("--dry-run with a secret in a reward function's kwargs", lambda c: run(secret_reward(c), dry=True)(c), 0,
     ["api_key: '***'", "secrets shown as ***"], [SECRET]),
    # 10. data that cannot be rewarded: ground truths that are null or empty
    ("data whose every ground truth is empty", lambda c: run(truths_data(c, None, ""), dry=True)(c), 2,
     ["runtime_args.data_path: every one of the 2 prompts has an empty ground truth", "truths.jsonl:1",
      "train on nothing", "runtime_args.ground_truth_key"], ["Traceback", "# plan"]),
    ("data with some empty ground truths", lambda c: run(truths_data(c, "3", None, "5", ""), dry=True)(c), 0,
     ["warning: runtime_args.data_path: 2 of the 4 prompts have an empty ground truth", "truths.jsonl:2",
      "train data: 4 prompts"], ["Traceback"]),
    ("max_constant_reward_episodes=-1", run("runtime_args.max_constant_reward_episodes=-1", dry=True), 2,
     ["runtime_args.max_constant_reward_episodes", "0 (never warn)"], ["Traceback"]),
]

ARITH = json.dumps({"data_source": "arith", "prompt": [{"role": "user", "content": "What is 1 + 2?"}],
                    "reward_model": {"style": "rule", "ground_truth": "3"}}) + "\n"


@pytest.fixture
def ctx(tmp_path, tiny_model_dir, arith_data, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("CHATLEARN_DEBUG", raising=False)
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setenv("RELIABILITY_CODE_MARKER", str(tmp_path / "code_ran"))
    train, evald = arith_data
    base = [f"models.policy_trainer.load={tiny_model_dir}", f"runtime_args.data_path={train}",
            f"runtime_args.eval_data_path={evald}", f"runtime_args.output_dir={tmp_path / 'out'}",
            "runtime_args.rollout_backend=hf"]
    return Ctx(str(tmp_path), tiny_model_dir, base)


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray must not start in these cases")

    monkeypatch.setattr(ray, "init", refuse)


def test_table_is_complete():
    assert len({c[0] for c in CASES}) == len(CASES) >= 10


@pytest.mark.parametrize("argv, code, present, absent", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_case(ctx, no_ray, capsys, monkeypatch, argv, code, present, absent):
    args = argv(ctx)
    for key, value in ctx.env.items():
        monkeypatch.setenv(key, value)
    rc = main(args)
    captured = capsys.readouterr()
    out = captured.out + captured.err
    flat = " ".join(out.split())
    assert rc == code, out[-3000:]
    fill = {"out": ctx.out, "pid": os.getpid()}
    for word in present:
        assert " ".join(word.format(**fill).split()) in flat, f"{word!r} not in: {flat[-3000:]}"
    for word in absent:
        assert word not in out, f"{word!r} in: {out[-3000:]}"
    if code == 2:
        message = captured.err[captured.err.index("error: "):]
        assert "\n\n" not in message.strip(), message


def test_a_failed_validation_leaves_the_output_folder_untouched(ctx, no_ray, capsys):
    assert main(run("runtime_args.seed=-1")(ctx)) == 2
    assert "runtime_args.seed" in capsys.readouterr().err
    assert not os.path.exists(ctx.out)  # no config.yaml, no lock, no folder


def test_a_ray_address_that_does_not_answer_is_given_up_after_the_timeout():
    """A port whose listen queue is full drops new connections unanswered (as a firewalled host does):
    runtime_args.ray_connect_timeout_s bounds the wait."""
    from chatlearn.errors import UserError
    from chatlearn.runtime.cluster.cluster import check_ray_address

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        queued = [socket.socket() for _ in range(4)]
        for c in queued:
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
        try:
            with pytest.raises(UserError) as err:
                check_ray_address(f"127.0.0.1:{port}", 0.5)
        finally:
            for c in queued:
                c.close()
    assert f"RAY_ADDRESS='127.0.0.1:{port}'" in err.value.message
    assert "no answer within 0.5 s (runtime_args.ray_connect_timeout_s)" in err.value.message
    assert "ray start --head" in err.value.message


def test_refused_fresh_start_leaves_the_old_run_untouched(ctx, no_ray, capsys):
    old_run(ctx)
    before = sorted(os.path.relpath(os.path.join(d, f), ctx.out) for d, _, fs in os.walk(ctx.out) for f in fs)
    assert main(run("--no-resume")(ctx)) == 2
    after = sorted(os.path.relpath(os.path.join(d, f), ctx.out) for d, _, fs in os.walk(ctx.out) for f in fs)
    assert after == before and "run.lock" not in after


def test_merge_runs_the_models_code_only_with_the_flag(ctx, capsys):
    marker = os.path.join(ctx.tmp, "code_ran")
    assert main(merge()(ctx)) == 2
    assert not os.path.exists(marker)
    # with the flag the code may run (this checkpoint then fails its tensor check: exit 2 all the same)
    assert main(["merge", os.path.join(ctx.tmp, "ckpt"), os.path.join(ctx.tmp, "merged"), "--trust-remote-code"]) == 2
    assert os.path.exists(marker)


def test_stale_lock_of_a_dead_process_is_taken_over(ctx, capsys):
    """A lock left by a process that no longer exists on this host: taken over with a warning."""
    from chatlearn.runtime.rundir.lock import RunLock

    pid = dead_pid()
    lock(ctx, pid)
    with RunLock(ctx.out) as held:
        err = capsys.readouterr().err
        assert "taking over the lock" in err and f"process {pid}" in err and "no longer running" in err
        holder, _ = held.read()
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        assert holder["started"] and holder["command"]
    assert not os.path.exists(os.path.join(ctx.out, "run.lock"))


def test_lock_is_released_on_errors_and_ctrl_c(ctx):
    from chatlearn.runtime.rundir.lock import RunLock

    path = os.path.join(ctx.out, "run.lock")
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with RunLock(ctx.out):
                assert os.path.exists(path)
                raise exc
        assert not os.path.exists(path)


def test_a_lock_being_written_is_not_taken_over(ctx):
    """An empty lock file younger than a few seconds belongs to a run that is creating it."""
    from chatlearn.runtime.rundir.lock import RunLock

    ctx.file("out/run.lock", "")
    assert RunLock(ctx.out).live_holder() is not None
    old = time.time() - 60
    os.utime(os.path.join(ctx.out, "run.lock"), (old, old))
    assert RunLock(ctx.out).live_holder() is None  # left by a run that died while creating it


def test_validation_does_not_walk_the_episodes(ctx, monkeypatch):
    """runtime_args.num_episode=10**9 validates without a step per episode: the run's optimizer steps
    (what the learning-rate schedule spans) are counted in closed form, replay included."""
    from chatlearn.config import plan as plan_module
    from chatlearn.config.load import load_run

    calls = []
    real = plan_module.Plan.steps_in_episode

    def counted(self, episode):
        calls.append(episode)
        assert len(calls) < 100, "validation walks the episodes one by one"
        return real(self, episode)

    monkeypatch.setattr(plan_module.Plan, "steps_in_episode", counted)
    # replaying all of 10**9 episodes cannot fit any machine's memory (chatlearn/config/sizes.py refuses it):
    # the counting is what this test checks
    monkeypatch.setattr(sizes, "available_memory", lambda: 2**90)
    for replay in (0, 3, -1):
        _, plan = load_run(TEMPLATE, ctx.base + ["runtime_args.num_episode=1000000000",
                                                 f"runtime_args.max_replay_episode={replay}"])
        n, per = 10**9, plan.steps_per_episode
        replayed = {0: 0, 3: 0 + 1 + 2 + 3 * (n - 3), -1: n * (n - 1) // 2}[replay]
        assert plan.total_steps == per * (n + replayed)
    for n, replay in ((1, 0), (5, 2), (7, -1), (4, 9)):  # the closed form against the sum it replaces
        _, plan = load_run(TEMPLATE, ctx.base + [f"runtime_args.num_episode={n}",
                                                 f"runtime_args.max_replay_episode={replay}"])
        assert plan.total_steps == sum(real(plan, e) for e in range(1, n + 1))
