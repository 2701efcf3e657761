"""Bad inputs, one row each: exit code 2 and one paragraph on stderr that names the culprit and the fix.

Config mistakes are caught by ``chatlearn run --dry-run``; data mistakes surface in ``chatlearn run``
while the prompts are loaded, before Ray starts (``ray.init`` fails the test here if it is called).
No traceback unless ``--debug`` is given.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

from chatlearn.cli import main
from conftest import REPO

TEMPLATE = "template/grpo_fsdp.yaml"
ROW = {"data_source": "arith", "prompt": [{"role": "user", "content": "What is 1 + 2?"}],
       "reward_model": {"style": "rule", "ground_truth": "3"}}


@dataclass
class Ctx:
    """Paths of one test: the tiny model, a working base config, and a scratch folder."""

    tmp: str
    model: str
    base: list  # overrides for a valid config

    def file(self, name: str, content: str | bytes) -> str:
        path = os.path.join(self.tmp, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
        return path

    def model_copy(self, name: str, drop=(), replace=None) -> str:
        path = os.path.join(self.tmp, name)
        shutil.copytree(self.model, path, ignore=shutil.ignore_patterns(*drop))
        for fname, text in (replace or {}).items():
            with open(os.path.join(path, fname), "w") as f:
                f.write(text)
        return path

    def data(self, *lines: str) -> str:
        return self.file("data/train.jsonl", "".join(line + "\n" for line in lines))


def rows(n=4, **override):
    return [json.dumps({**ROW, **override}) for _ in range(n)]


def dry(*overrides):
    return lambda c: ["run", TEMPLATE, *c.base, *overrides, "--dry-run"]


def run_with(*overrides):
    return lambda c: ["run", TEMPLATE, *c.base, *overrides]


def data_case(*lines):
    return lambda c: data_at(c, c.data(*lines))


def data_at(c, path):
    return ["run", TEMPLATE, *c.base, f"runtime_args.data_path={path}"]


def with_model(make_model, dry_run=True):
    """The config pointed at the model folder ``make_model(ctx)`` builds."""
    return lambda c: ["run", TEMPLATE, *c.base, f"models.policy_trainer.load={make_model(c)}",
                      *(["--dry-run"] if dry_run else [])]


def _folder_with_dir_entry(c: Ctx) -> str:
    c.file("dfolder/a.jsonl", "\n".join(rows(2)) + "\n")
    os.makedirs(os.path.join(c.tmp, "dfolder", "sub.jsonl"), exist_ok=True)  # a folder named like a data file
    return os.path.join(c.tmp, "dfolder")


def teacher(make_teacher, algorithm="opd"):
    """The config with a teacher (``models.teacher``) of the folder ``make_teacher(ctx)`` builds."""
    return lambda c: ["run", TEMPLATE, *c.base, f"models.policy_trainer.algorithm={algorithm}",
                      "models.teacher.kind=teacher", f"models.teacher.load={make_teacher(c)}", "--dry-run"]


def _teacher_other_vocabulary(c: Ctx) -> str:
    with open(os.path.join(c.model, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    first = next(t for t in vocab if t.isalpha())  # a plain word piece renamed: another vocabulary
    vocab["zz" + first] = vocab.pop(first)
    return c.model_copy("teacher_vocab", replace={"tokenizer.json": json.dumps(tok)})


def _teacher_other_template(c: Ctx) -> str:
    with open(os.path.join(c.model, "tokenizer_config.json")) as f:
        conf = json.load(f)
    conf["chat_template"] = "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return c.model_copy("teacher_template", drop=["chat_template.jinja"],
                        replace={"tokenizer_config.json": json.dumps(conf)})


def _teacher_short_context(c: Ctx) -> str:
    with open(os.path.join(c.model, "config.json")) as f:
        conf = json.load(f)
    conf["max_position_embeddings"] = 16
    return c.model_copy("teacher_short", replace={"config.json": json.dumps(conf)})


def _model_without_template(c: Ctx) -> str:
    with open(os.path.join(c.model, "tokenizer_config.json")) as f:
        conf = json.load(f)
    conf.pop("chat_template", None)
    return c.model_copy("nochat", drop=["chat_template.jinja"], replace={"tokenizer_config.json": json.dumps(conf)})


def _in_container(c: Ctx) -> list:
    """A run in the image (its output volume named, as docker/Dockerfile does) whose output folder cannot be
    written: /proc takes no new file, even for root (the ctx fixture restores the variable)."""
    os.environ["CHATLEARN_OUTPUT_VOLUME"] = "/proc/chatlearn-out"
    return ["run", TEMPLATE, *c.base, "runtime_args.output_dir=/proc/chatlearn-out/run"]


SFT_TEMPLATE = "template/sft.yaml"
SFT_ROW = {"messages": [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "\\boxed{3}"}]}


def sft_case(*lines, overrides=()):
    """``chatlearn sft`` on the conversations ``lines`` (none: the template's data)."""
    def argv(c):
        data = [f"sft.data_path={c.file('sft/train.jsonl', ''.join(line + chr(10) for line in lines))}"] if lines else []
        return ["sft", SFT_TEMPLATE, f"models.policy_trainer.load={c.model}", f"runtime_args.output_dir={c.tmp}/sft",
                "sft.eval_data_path=null", "sft.eval_reward=false", *data, *overrides]
    return argv


VLM = os.path.join(REPO, "assets", "tiny_qwen2_vl")  # the vision-language toy


def image_row(*images) -> str:
    """A data row whose prompt holds ``images`` (references as a row gives them) and a question."""
    parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": "Add the digits."}]
    return json.dumps({**ROW, "prompt": [{"role": "user", "content": parts}]})


def vlm_data(make_lines, *overrides):
    """``chatlearn run`` of the VLM toy on the rows ``make_lines(ctx)`` (their images beside the data file)."""
    return lambda c: ["run", TEMPLATE, *c.base, f"models.policy_trainer.load={VLM}", *overrides,
                      f"runtime_args.data_path={c.data(*make_lines(c))}"]


def _png(c: Ctx, name: str) -> str:
    from PIL import Image

    path = os.path.join(c.tmp, "data", name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", (64, 64), (200, 10, 10)).save(path)
    return name


MIN_YAML = "runtime_args:\n  num_episode: 1\nmodels:\n  policy_trainer:\n    load: {model}\n"

# id, argv(ctx), words naming the culprit, words saying how to fix it
CASES = [
    # ---------------------------------------------------------------- config keys and values
    ("unknown key", dry("runtime_args.num_episod=3"), ["runtime_args.num_episod"],
     ["Did you mean 'runtime_args.num_episode'"]),
    ("unknown section", dry("model.policy.load=x"), ["model: unknown key"], ["remove it or fix its spelling"]),
    ("unknown key in YAML", lambda c: ["run", c.file("typo.yaml", "runtime_args:\n  sampel_per_episode: 8\n")],
     ["runtime_args.sampel_per_episode", "typo.yaml"], ["Did you mean 'runtime_args.sample_per_episode'"]),
    ("int expected", dry("runtime_args.num_episode=many"), ["runtime_args.num_episode", "wrong type"],
     ["Fix the value"]),
    ("float expected", dry("models.policy_trainer.optimizer.lr=abc"), ["models.policy_trainer.optimizer.lr"],
     ["Fix the value"]),
    ("list expected", dry("runtime_args.colocation=policy"), ["runtime_args.colocation", "must be a list"],
     ["Write it as a list"]),
    ("required key missing", lambda c: ["run", c.file("min.yaml", MIN_YAML.format(model=c.model)), "--dry-run"],
     ["runtime_args.data_path", "required key has no value"], ["Set it in the YAML file or on the command line"]),
    ("samples not divisible by group", dry("runtime_args.sample_per_episode=250"),
     ["runtime_args.sample_per_episode", "num_inference_per_prompt"], ["Use a multiple"]),
    ("samples not divisible by batch", dry("runtime_args.train_global_batch_size=96"),
     ["runtime_args.sample_per_episode", "train_global_batch_size (96)"], ["must be divisible"]),
    ("micro batch does not divide", dry("runtime_args.train_micro_batch_size=48"),
     ["models.policy_trainer.train_micro_batch_size", "(48)"], ["must be divisible"]),
    ("batch over ranks", dry("models.policy_trainer.num_gpu=3"),
     ["runtime_args.train_global_batch_size", "data-parallel size (3)"], ["must be divisible"]),
    ("colocation unknown model", dry("runtime_args.colocation=[policy,actor]"),
     ["runtime_args.colocation", "'actor'"], ["not a model of this config (policy, policy_trainer, ref_policy, critic, "
                                              "reward)", "models.<name> with its kind"]),
    ("colocation critic without PPO", dry("runtime_args.colocation=[policy,critic]"),
     ["runtime_args.colocation", "names critic"], ["set algorithm: ppo"]),
    ("unknown kind of model", dry("models.rm_math.kind=reward_modle", "models.rm_math.load=assets/tiny_rm"),
     ["models.rm_math.kind", "'reward_modle'"], ["Did you mean 'reward_model'"]),
    ("judge template names a field the data lacks",
     dry("models.jd.kind=judge", "models.jd.load=assets/tiny_qwen2",
         "models.jd.prompt_template='{{ question }} {{ solution }}'"),
     ["models.jd.prompt_template", "names solution"], ["the fields are question, response, reference"]),
    ("judge template reads reference without ground truth",
     dry("models.jd.kind=judge", "models.jd.load=assets/tiny_qwen2", "runtime_args.ground_truth_key=null",
         "models.jd.prompt_template='{{ response }} {{ reference }}'"),
     ["models.jd.prompt_template", "reference, but the data has none"], ["Set ground_truth_key"]),
    ("judge context shorter than its prompt",
     dry("models.jd.kind=judge", "models.jd.load=assets/tiny_qwen2", "models.jd.max_prompt_tokens_length=250"),
     ["models.jd.max_prompt_tokens_length", "context (assets/tiny_qwen2: 256 tokens)"], ["Lower it to at most 240"]),
    ("judge prompt longer than its limit",
     dry("models.jd.kind=judge", "models.jd.load=assets/tiny_qwen2", "models.jd.max_prompt_tokens_length=60"),
     ["models.jd.max_prompt_tokens_length", "shorter than the longest prompt the judge may be given"], ["Raise it"]),
    ("judge parser not importable",
     dry("models.jd.kind=judge", "models.jd.load=assets/tiny_qwen2", "models.jd.parser=no_such_module:parse"),
     ["models.jd.parser", "judge parser 'no_such_module:parse'", "cannot import module"], []),
    ("judge parser unknown", dry("models.jd.kind=judge", "models.jd.load=assets/tiny_qwen2", "models.jd.parser=yesno"),
     ["models.jd.parser", "'yesno' is no judge parser"], ["module:function"]),
    ("served judge endpoint malformed", dry("models.jd.kind=judge", "models.jd.endpoint=localhost:8000/v1"),
     ["models.jd.endpoint", "'localhost:8000/v1' is not an endpoint URL", "scheme"], ["http://127.0.0.1:8000/v1"]),
    ("served judge endpoint port out of range", dry("models.jd.kind=judge", "models.jd.endpoint=http://h:99999/v1"),
     ["models.jd.endpoint", "not an endpoint URL", "out of range"], ["base URL"]),
    ("served judge api key variable unset",
     dry("models.jd.kind=judge", "models.jd.endpoint=http://127.0.0.1:9/v1", "models.jd.api_key_env=NO_SUCH_KEY_VAR"),
     ["models.jd.api_key_env", "'NO_SUCH_KEY_VAR', which is not set"], ["export NO_SUCH_KEY_VAR="]),
    ("served judge colocated", dry("models.jd.kind=judge", "models.jd.endpoint=http://127.0.0.1:9/v1",
                                   "runtime_args.colocation=[policy,policy_trainer,jd]"),
     ["runtime_args.colocation", "a served judge"], ["Take it out of the list"]),
    ("local judge without load", dry("models.jd.kind=judge"),
     ["models.jd.load", "required key has no value"], ["models.jd.endpoint=http://host:port/v1"]),
    ("a second rollout engine", dry("models.policy2.kind=rollout"),
     ["models.policy2.kind", "second model of kind rollout"], ["Configure that one, or remove models.policy2"]),
    ("colocation model twice", dry("runtime_args.colocation=[policy,policy_trainer,policy]"),
     ["runtime_args.colocation", "'policy' more than once"], ["List each model once"]),
    ("invalid choice", dry("runtime_args.rollout_backend=vlm"), ["runtime_args.rollout_backend", "'vlm'"],
     ["Did you mean 'vllm'"]),
    ("unknown advantage estimator", dry("models.policy_trainer.advantage_estimator=grop"),
     ["models.policy_trainer.advantage_estimator", "'grop'"], ["Did you mean 'grpo'", "in runtime_args.plugins"]),
    ("plugin module not found", dry("runtime_args.plugins=[no_such_pkg.my_rl]"),
     ["runtime_args.plugins[0]", "'no_such_pkg.my_rl'", "no module 'no_such_pkg'"],
     ["add that directory to PYTHONPATH", "give the file instead"]),
    ("plugin raising on import", lambda c: dry(f"runtime_args.plugins=[{c.file('my_rl.py', 'raise KeyError(1)')}]")(c),
     ["runtime_args.plugins[0]", "failed with KeyError: 1 at", "my_rl.py:1"], ["Fix the module so that it imports"]),
    ("invalid wandb_resume", dry("runtime_args.log_args_dict.wandb_resume=sometimes"),
     ["runtime_args.log_args_dict.wandb_resume", "'sometimes'"], ["is not one of allow, must, never, auto"]),
    ("memory fraction out of range", dry("models.policy.gpu_memory_utilization=1.5"),
     ["models.policy.gpu_memory_utilization"], ["must be in (0, 1]"]),
    ("negative interval", dry("runtime_args.eval_episode_interval=-1"), ["runtime_args.eval_episode_interval"],
     ["must be 0 or a positive number"]),
    ("zero count", dry("models.policy.num_inference_per_prompt=0"), ["models.policy.num_inference_per_prompt"],
     ["must be a positive integer"]),
    ("top_p out of range", dry("models.policy.top_p=0"), ["models.policy.top_p"], ["must be in (0, 1]"]),
    ("eval on without eval data", dry("runtime_args.eval_data_path=null"), ["runtime_args.eval_data_path"],
     ["Set it, or turn evaluation off"]),
    ("bad interpolation", dry("models.policy.load=${models.nope.load}"), ["models.policy.load", "interpolation"],
     ["Check the ${...} reference"]),
    # ---------------------------------------------------------------- files and folders
    ("config file missing", lambda c: ["run", os.path.join(c.tmp, "nope.yaml")], ["nope.yaml", "does not exist"],
     ["Pass the path of a YAML config"]),
    ("config file is a folder", lambda c: ["run", c.tmp], ["config file", "is a folder"],
     ["Pass the path of a YAML config file"]),
    ("bad YAML", lambda c: ["run", c.file("bad.yaml", "runtime_args:\n  num_episode: [1, 2\n")],
     ["bad.yaml", "not valid YAML", "line"], ["Fix the syntax at the line and column shown"]),
    ("YAML not a mapping", lambda c: ["run", c.file("list.yaml", "- 1\n- 2\n")], ["list.yaml", "ListConfig"],
     ["must hold a mapping with 'runtime_args' and 'models'"]),
    ("override without =", dry("runtime_args.num_episode"), ["'runtime_args.num_episode'"],
     ["not of the form key.path=value, for example runtime_args.num_episode=10"]),
    ("override with empty key part", dry("runtime_args..num_episode=2"), ["'runtime_args..num_episode=2'"],
     ["not of the form key.path=value"]),
    ("override value not YAML", dry("runtime_args.colocation=[policy"), ["'runtime_args.colocation=[policy'"],
     ["Write lists as [a,b]"]),
    ("model folder missing", dry("models.policy_trainer.load=/no/such/model"),
     ["models.policy_trainer.load", "'/no/such/model'", "does not exist"],
     ["Point it at a local Hugging Face model folder"]),
    ("model folder without config.json", with_model(lambda c: c.model_copy("m", drop=["config.json"])),
     ["models.policy_trainer.load", "no config.json"], ["Point it at the folder that holds config.json"]),
    ("config.json not JSON", with_model(lambda c: c.model_copy("m", replace={"config.json": "{oops"})),
     ["models.policy_trainer.load", "config.json is not valid JSON"], ["Restore the model folder's config.json"]),
    ("output_dir is a file", lambda c: dry(f"runtime_args.output_dir={c.file('a_file', 'x')}")(c),
     ["runtime_args.output_dir", "is a file"], ["Point it at a folder"]),
    ("output_dir under a file", lambda c: dry(f"runtime_args.output_dir={c.file('b_file', 'x')}/out")(c),
     ["runtime_args.output_dir", "a parent of", "is a file"], ["Point it at a folder"]),
    ("data path missing", dry("runtime_args.data_path=/no/such.jsonl"), ["runtime_args.data_path", "/no/such.jsonl"],
     ["Fix the path"]),
    ("reward function path not importable",
     dry("models.reward.functions=[{name: mine, path: nowhere/my_reward.py:score}]"),
     ["models.reward.functions[0].path", "'nowhere/my_reward.py:score'", "does not exist"], ["Fix the path"]),
    ("reward function module not importable",
     dry("models.reward.functions=[{name: mine, path: no_such_pkg.rewards:score}]"),
     ["models.reward.functions[0].path", "cannot import module 'no_such_pkg.rewards'"],
     ["Install the package or run chatlearn from the directory that holds it"]),
    # ---------------------------------------------------------------- data (loaded by `run`, before Ray)
    ("malformed JSON line", data_case(*rows(2), '{"prompt": "What is 1 + 2?"', *rows(1)),
     ["train.jsonl:3", "malformed JSON"], ["fix or remove that line"]),
    ("row not an object", data_case(*rows(1), "[1, 2]"), ["train.jsonl:2", "expected a JSON object, got list"],
     ["must be an object with a 'prompt' field"]),
    ("missing prompt key", data_case(*rows(2), json.dumps({"question": "What is 1 + 2?"})),
     ["train.jsonl:3", "no 'prompt' field", "question"], ["Add it"]),
    ("prompt of the wrong type", data_case(json.dumps({"prompt": 42})), ["train.jsonl:1", "'prompt'"],
     ["must be a string or a non-empty list of chat messages"]),
    ("empty message list", data_case(json.dumps({"prompt": []})), ["train.jsonl:1"], ["non-empty list"]),
    ("message without role", data_case(json.dumps({"prompt": [{"content": "hi"}]})), ["train.jsonl:1"],
     ["{'role': '...', 'content': '...'}"]),
    ("reward_model not an object", data_case(json.dumps({**ROW, "reward_model": "3"})),
     ["train.jsonl:1", "'reward_model'", "not a str"], ["must be an object such as"]),
    ("empty dataset", data_case(), ["runtime_args.data_path", "is empty (no rows)"],
     ["Point it at data with at least one row"]),
    ("every prompt too long", run_with("models.policy.max_prompt_tokens_length=2"),
     ["runtime_args.data_path", "longer than models.policy.max_prompt_tokens_length (2)"], ["raise it"]),
    ("eval data malformed", lambda c: ["run", TEMPLATE, *c.base,
                                       f"runtime_args.eval_data_path={c.file('e/eval.jsonl', 'not json')}"],
     ["eval.jsonl:1", "malformed JSON"], ["fix or remove that line"]),
    ("file not UTF-8", lambda c: data_at(c, c.file("d/latin1.jsonl", b'{"prompt": "caf\xe9"}\n')),
     ["latin1.jsonl", "cannot read data file"], ["UTF-8 text"]),
    ("unreadable entry in a data folder", lambda c: data_at(c, _folder_with_dir_entry(c)),
     ["sub.jsonl", "cannot read data file"], ["Check the path"]),
    ("data folder without data files", lambda c: data_at(c, os.path.dirname(c.file("nodata/a.txt", "x"))),
     ["nodata", "holds no .jsonl, .json or .parquet file"], ["Put the data files there"]),
    ("parquet that is not parquet", lambda c: data_at(c, c.file("p/train.parquet", "a,b\n1,2\n")),
     ["train.parquet", "cannot read parquet file"], ["Check that it is a valid parquet file"]),
    ("MoE key on a dense model", run_with("models.policy_trainer.moe_aux_loss_coeff=0.01"),
     ["models.policy_trainer.moe_aux_loss_coeff", "dense model"], ["load a mixture-of-experts model"]),
    ("routing replay on a dense model", run_with("models.policy_trainer.routing_replay=rollout"),
     ["models.policy_trainer.routing_replay", "dense model"], ["Set it to off"]),
    ("SFT conversation without an assistant turn",
     sft_case(json.dumps(SFT_ROW), json.dumps({"messages": SFT_ROW["messages"][:1]})),
     ["sft.data_path", "train.jsonl:2", "has no assistant turn (1 such row(s))"], ["Add the assistant's reply"]),
    ("SFT conversations longer than the context", sft_case(*[json.dumps(SFT_ROW)] * 3, overrides=["sft.max_seq_len=10"]),
     ["sft.overlong", "3 row(s) are longer than sft.max_seq_len (10 tokens)", "train.jsonl:1"],
     ["Raise sft.max_seq_len", "truncate", "drop"]),
    ("SFT row without messages", sft_case(json.dumps(ROW)), ["train.jsonl:1", "no 'messages' field"],
     ["sft.messages_key"]),
    ("SFT without data", sft_case(overrides=["sft.data_path=null"]), ["sft.data_path", "is not set"], ["Set it"]),
    ("SFT unknown overlong", sft_case(overrides=["sft.overlong=cut"]), ["sft.overlong", "'cut'"],
     ["refuse, truncate, drop"]),
    ("model folder without chat template", with_model(_model_without_template, dry_run=False),
     ["models.policy.load", "no chat template"], ["Add one to the folder"]),
    ("model folder with a broken tokenizer",
     with_model(lambda c: c.model_copy("badtok", replace={"tokenizer.json": "{oops"}), dry_run=False),
     ["models.policy.load", "cannot load a tokenizer"], ["Point it at a model folder that holds the tokenizer files"]),
    # ---------------------------------------------------------------- distillation (a teacher)
    ("distillation without a teacher", dry("models.policy_trainer.algorithm=opd"),
     ["models.policy_trainer.algorithm", "'opd'", "kind teacher", "declares none"],
     ["models.teacher: {kind: teacher, load: path/to/model}"]),
    ("a teacher no algorithm reads", teacher(lambda c: c.model, algorithm="grpo"),
     ["models.teacher.kind", "reads no teacher"], ["algorithm: opd", "remove models.teacher"]),
    ("a teacher of another vocabulary", teacher(_teacher_other_vocabulary),
     ["models.teacher.load", "teacher's tokenizer", "differs from the student's"],
     ["Use a teacher with the student's tokenizer"]),
    ("a teacher of another chat template", teacher(_teacher_other_template),
     ["models.teacher.load", "teacher's chat template", "differs from the student's"],
     ["Use a teacher with the student's chat template"]),
    ("a teacher of a shorter context", teacher(_teacher_short_context),
     ["models.teacher.load", "takes 16 tokens", "longest prompt + response"], ["Use a teacher with a longer context"]),
    ("a GKD key under another algorithm", dry("models.policy_trainer.gkd_beta=0.1"),
     ["models.policy_trainer.gkd_beta", "only algorithm: gkd reads it"], ["Set models.policy_trainer.algorithm: gkd"]),
    ("a GKD beta out of [0, 1]", lambda c: [*teacher(lambda c: c.model, algorithm="gkd")(c)[:-1],
                                            "models.policy_trainer.gkd_beta=1.5", "--dry-run"],
     ["models.policy_trainer.gkd_beta", "is 1.5", "in [0, 1]"], ["0: forward KL"]),
    ("a KL term with GKD", lambda c: [*teacher(lambda c: c.model, algorithm="gkd")(c)[:-1],
                                      "models.policy_trainer.kl_coef=0.1", "--dry-run"],
     ["models.policy_trainer.kl_coef", "generalized JSD to the teacher alone"], ["Set it to 0"]),
    ("a GKD lambda out of [0, 1]", lambda c: [*teacher(lambda c: c.model, algorithm="gkd")(c)[:-1],
                                              "models.policy_trainer.gkd_lambda=1.5", "--dry-run"],
     ["models.policy_trainer.gkd_lambda", "is 1.5", "[0, 1]"], ["1: every episode"]),
    ("a GKD lambda under another algorithm", dry("models.policy_trainer.gkd_lambda=0.5"),
     ["models.policy_trainer.gkd_lambda", "only algorithm: gkd reads it"], ["Set models.policy_trainer.algorithm: gkd"]),
    ("a GKD lambda below 1 with a row without a reference response",
     lambda c: [*teacher(lambda c: c.model, algorithm="gkd")(c)[:-1], "models.policy_trainer.gkd_lambda=0.5",
                f"runtime_args.data_path={c.data(*rows(2), json.dumps({**ROW, 'prompt': [*ROW['prompt'], {'role': 'assistant', 'content': '3'}]}))}",
                "--dry-run"],
     ["train.jsonl:1", "no reference response", "models.policy_trainer.gkd_lambda", "roles: ['user']"],
     ["last assistant message", "gkd_lambda: 1"]),
    ("opd's distill_coef with GKD", lambda c: [*teacher(lambda c: c.model, algorithm="gkd")(c)[:-1],
                                               "models.policy_trainer.distill_coef=0.5", "--dry-run"],
     ["models.policy_trainer.distill_coef", "only algorithm: opd reads it"], ["Remove it"]),
    # ---------------------------------------------------------------- the container image (docker/Dockerfile)
    ("an output volume the container cannot write", _in_container,
     ["runtime_args.output_dir", "cannot be written by this container's user"],
     ["-v $PWD/out:/proc/chatlearn-out", "not `:ro`"]),
    # ---------------------------------------------------------------- vision-language models (images in prompts)
    ("images for a text-only model", data_case(image_row("a.png")),
     ["train.jsonl:1", "holds an image", "takes text only", "models.policy.load"], ["Use a vision-language model"]),
    ("a missing image file", vlm_data(lambda c: [image_row("nowhere.png")]),
     ["train.jsonl:1", "nowhere.png does not exist"], ["fix or drop the row"]),
    ("an image that does not decode", vlm_data(lambda c: [image_row(os.path.basename(c.file("data/bad.png", b"no")))]),
     ["train.jsonl:1", "the image does not decode"], ["fix or drop the row"]),
    ("an image URL", vlm_data(lambda c: [image_row("https://example.com/a.png")]),
     ["train.jsonl:1", "is a URL", "runs are offline"], ["local files or base64"]),
    ("more images than the model accepts",
     vlm_data(lambda c: [image_row(_png(c, "a.png"), _png(c, "a.png"))], "models.policy.max_images_per_prompt=1"),
     ["train.jsonl:1", "holds 2 images", "models.policy.max_images_per_prompt (1)"], ["Raise that key"]),
    ("an image prompt longer than the context",
     vlm_data(lambda c: [image_row(_png(c, "a.png"))], "models.policy.max_prompt_tokens_length=20"),
     ["train.jsonl:1", "16 vision tokens", "models.policy.max_prompt_tokens_length (20)"],
     ["Raise that key", "smaller images"]),
    ("a VLM on the Megatron trainer", dry(f"models.policy_trainer.load={VLM}", "runtime_args.train_backend=megatron"),
     ["runtime_args.train_backend", "is a vision-language model"], ["train_backend: fsdp"]),
    ("a VLM on SGLang", dry(f"models.policy_trainer.load={VLM}", "runtime_args.rollout_backend=sglang"),
     ["runtime_args.rollout_backend", "is a vision-language model"], ["rollout_backend: hf"]),
] + ([  # vLLM runs a VLM where it can import its Qwen2-VL module, which needs torchvision (absent on CPU machines)
    ("a VLM on vLLM without torchvision", dry(f"models.policy_trainer.load={VLM}", "runtime_args.rollout_backend=vllm"),
     ["runtime_args.rollout_backend", "is a vision-language model", "torchvision is not installed here"],
     ["Install the torchvision", "rollout_backend: hf"]),
] if importlib.util.find_spec("torchvision") is None else [])


@pytest.fixture
def ctx(tmp_path, tiny_model_dir, arith_data, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("CHATLEARN_DEBUG", raising=False)
    monkeypatch.setenv("CHATLEARN_OUTPUT_VOLUME", "")  # set by a row (_in_container); restored after each test
    train, evald = arith_data
    base = [f"models.policy_trainer.load={tiny_model_dir}", f"runtime_args.data_path={train}",
            f"runtime_args.eval_data_path={evald}", f"runtime_args.output_dir={tmp_path / 'out'}",
            "runtime_args.rollout_backend=hf"]
    return Ctx(str(tmp_path), tiny_model_dir, base)


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray must not start for a user error")

    monkeypatch.setattr(ray, "init", refuse)
    yield
    assert not ray.is_initialized()


def check_message(err: str, culprit: list, fix: list) -> None:
    assert "Traceback" not in err, err
    message = err[err.index("error: "):]  # libraries may log warnings before it
    assert "\n\n" not in message.strip(), message
    flat = " ".join(message.split())
    for w in culprit + fix:
        assert w in flat, f"{w!r} not in: {flat}"


def test_table_has_enough_rows():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("argv, culprit, fix", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(ctx, no_ray, capsys, argv, culprit, fix):
    assert main(argv(ctx)) == 2
    check_message(capsys.readouterr().err, culprit, fix)


def test_debug_shows_the_traceback(ctx, capsys):
    assert main(["run", TEMPLATE, *ctx.base, "runtime_args.num_episod=3", "--dry-run", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ConfigError" in err
    assert "error: runtime_args.num_episod: unknown key" in err  # the paragraph follows the traceback


def test_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", TEMPLATE, "--dryrun"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --dryrun" in err and "usage: chatlearn" in err and "Traceback" not in err


RAISING_REWARD = """
def score(*, prompts, responses, ground_truths, data_sources, extra):
    return [parse(r) for r in responses]

def parse(text):
    raise KeyError("no answer in " + repr(text[:0]))
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_reward_function_raising_at_runtime(ctx):
    """A reward function that raises in the reward workers, through the real CLI with Ray: exit 2 and one
    paragraph naming the function's path, the exception and where it was raised."""
    path = ctx.file("my_reward.py", RAISING_REWARD)
    short = ["runtime_args.num_episode=1", "runtime_args.sample_per_episode=16", "runtime_args.train_global_batch_size=16",
             "runtime_args.train_micro_batch_size=16", "models.policy.num_inference_per_prompt=4",
             "runtime_args.enable_eval_before_training=False", "runtime_args.eval_episode_interval=0"]
    proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", "run", TEMPLATE, *ctx.base, *short,
                           f"models.reward.functions=[{{name: mine, path: '{path}:score'}}]"],
                          cwd=REPO, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    check_message(proc.stderr, [f"reward function '{path}:score' raised KeyError", "no answer in",
                                "my_reward.py:6 in parse", "my_reward.py:3 in score"], ["Fix the function"])


@pytest.mark.parametrize("name, make", [
    ("bad YAML", lambda c: ["run", c.file("bad.yaml", "runtime_args: [\n")]),
    ("malformed data line", lambda c: ["run", TEMPLATE, *c.base, f"runtime_args.data_path={c.data('{oops')}"]),
])
def test_console_script(ctx, name, make):
    """The installed entry point: exit code 2, the paragraph on stderr, nothing started."""
    proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", *make(ctx)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "error: " in proc.stderr
    assert "[chatlearn] train data" not in proc.stdout  # stopped while loading, before the run was set up


def test_debug_env_variable(ctx, monkeypatch, capsys):
    monkeypatch.setenv("CHATLEARN_DEBUG", "1")
    assert main(["run", TEMPLATE, *ctx.base, "runtime_args.num_episode=many", "--dry-run"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_message_is_wrapped_as_one_paragraph(ctx, capsys):
    long_path = os.path.join(ctx.tmp, "a" * 60, "b" * 60, "missing.jsonl")
    assert main(["run", TEMPLATE, *ctx.base, f"runtime_args.data_path={long_path}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert all(len(line) <= 100 or " " not in line for line in err.splitlines())
    assert long_path in err  # a path is never broken across lines


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_damaged_checkpoint_on_resume(ctx):
    """A run saves a checkpoint; its DCP metadata is then damaged. Resuming stops with exit 2 and one
    paragraph naming the file and the two ways on (the checkpoint before it, or --no-resume)."""
    short = ["runtime_args.sample_per_episode=16", "runtime_args.train_global_batch_size=16",
             "runtime_args.train_micro_batch_size=16", "models.policy.num_inference_per_prompt=4",
             "runtime_args.enable_eval_before_training=False", "runtime_args.eval_episode_interval=0",
             "models.policy_trainer.save_hf=false"]
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", TEMPLATE, *ctx.base, *short]
    first = subprocess.run(cmd + ["runtime_args.num_episode=1"], cwd=REPO, capture_output=True, text=True,
                           timeout=280)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-4000:]
    ckpt = os.path.join(ctx.tmp, "out", "checkpoints", "episode_000001")
    meta = os.path.join(ckpt, "trainer", ".metadata")
    size = os.path.getsize(meta)
    with open(meta, "wb") as f:  # damaged in place, same size: the manifest cannot tell, the load does
        f.write(b"\x80\x04not a pickle".ljust(size, b"\0"))
    proc = subprocess.run(cmd + ["runtime_args.num_episode=2"], cwd=REPO, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    check_message(proc.stderr, [f"cannot resume from the newest checkpoint '{ckpt}'", ".metadata",
                                "the checkpoint is damaged"], ["delete or move that folder", "--no-resume"])
    with open(meta, "r+b") as f:  # truncated: refused from the manifest before anything starts
        f.truncate(10)
    proc = subprocess.run(cmd + ["runtime_args.num_episode=2"], cwd=REPO, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    check_message(proc.stderr, ["every checkpoint in", "none to resume from", f"{ckpt} is damaged: "
                                f"trainer/.metadata is 10 bytes, {size} when written (truncated)"],
                  ["Restore the files from a copy", "--no-resume"])
