"""Config loading: ChatLearn keys, interpolation, overrides, derived sizes, and user errors."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from chatlearn.cli import main
from chatlearn.config.load import load_config
from chatlearn.config.plan import make_plan
from chatlearn.errors import ConfigError, UserError

TEMPLATE = "template/grpo_fsdp.yaml"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)


def test_template_loads_with_interpolation_and_overrides(paths_overrides):
    cfg = load_config(TEMPLATE, paths_overrides + ["runtime_args.num_episode=3", "models.policy_trainer.num_gpu=2"])
    assert cfg.runtime_args.num_episode == 3
    # ${models.policy_trainer.*} interpolations follow the override
    assert cfg.models.ref_policy.num_gpu == 2 and cfg.models.policy.num_gpu == 2
    assert cfg.models.policy.load == cfg.models.policy_trainer.load == cfg.models.ref_policy.load
    assert cfg.models.policy_trainer.train_micro_batch_size == cfg.runtime_args.train_micro_batch_size
    assert cfg.runtime_args.log_args_dict.log_dir == cfg.runtime_args.output_dir


def test_plan_sizes(paths_overrides):
    cfg = load_config(TEMPLATE, paths_overrides + ["runtime_args.sample_per_episode=64",
                                                   "runtime_args.train_global_batch_size=32",
                                                   "runtime_args.train_micro_batch_size=8",
                                                   "models.policy_trainer.num_gpu=2",
                                                   "models.policy.num_inference_per_prompt=4"])
    plan = make_plan(cfg)
    assert plan.prompts_per_episode == 16 and plan.trainer_dp == 2
    assert plan.steps_per_episode == 2 and plan.samples_per_rank_per_step == 16 and plan.micro_batches_per_step == 2
    # kl_coef 0 (the template): no KL term, so no reference model is placed or started
    assert plan.device_groups[0] == ["policy", "policy_trainer"] and plan.devices_per_group == [2]
    assert not plan.uses_ref and "ref_policy" not in plan.placements
    assert plan.placements["reward"].device_group == -1
    assert any("ref_policy: not started" in line for line in plan.describe())

    with_kl = make_plan(load_config(TEMPLATE, paths_overrides + ["models.policy_trainer.kl_coef=0.01"]))
    assert with_kl.uses_ref and with_kl.device_groups[0] == ["policy", "policy_trainer", "ref_policy"]
    apart = make_plan(load_config(TEMPLATE, paths_overrides + ["models.policy_trainer.kl_coef=0.01",
                                                               "runtime_args.colocation=[]"]))
    assert apart.device_groups == [["policy"], ["policy_trainer"], ["ref_policy"]] and apart.total_devices == 3
    assert apart.colocated_with("policy") == []


def test_chatlearn_yaml_with_every_documented_key_loads(tmp_path, tiny_model_dir, arith_data):
    """Every key of ChatLearn's config reference (FSDP and Megatron sections) is accepted."""
    train, evald = arith_data
    # the reference's lengths (1024 + 2048 tokens) on a copy of the tiny model with a long enough context
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 4096}))
    tiny_model_dir = str(model)
    yaml_text = textwrap.dedent(f"""
    runtime_args:
      train_backend: fsdp
      rollout_backend: vllm
      exp_name: grpo_fsdp
      colocation: [policy,policy_trainer,ref_policy]
      output_dir: {tmp_path}/out
      data_path: {train}
      eval_data_path: {evald}
      data_checkpoint_path: ${{runtime_args.output_dir}}/data_checkpoint_path/
      num_episode: 200
      sample_per_episode: 512
      train_micro_batch_size: 8
      train_global_batch_size: 512
      save_episode_interval: 200
      data_shuffle: True
      data_rerank: True
      max_replay_episode: 2
      eval_episode_interval: 5
      enable_eval_before_training: False
      log_args_dict:
        log_dir: ${{runtime_args.output_dir}}
        enable_wandb: False
        enable_tensorboard: False
        tensorboard_dir: ${{runtime_args.output_dir}}
        wandb_project: your_wandb_project
        wandb_dir: ${{runtime_args.output_dir}}
        wandb_name: ${{runtime_args.exp_name}}
        wandb_id: ${{runtime_args.exp_name}}
        wandb_resume: allow
    models:
      policy_trainer:
        use_expandable_segments: False
        free_gpu_memory: {{offload_weights: True, offload_optimizer_states: True, free_grad_buffers: True}}
        optimizer: {{lr: 2e-6, min_lr: 2e-6, clip_grad: 1}}
        trainable: True
        generation_batch_size: 8
        train_micro_batch_size: ${{runtime_args.train_micro_batch_size}}
        gpu_per_process: 1
        num_gpu: 2
        fsdp_size: ${{models.policy_trainer.num_gpu}}
        ulysses_sequence_parallel_size: 1
        packing: False
        meta_init: False
        groupgemm: False
        max_token_in_packing: 10000
        load: {tiny_model_dir}
        gradient_checkpointing: True
        pos_clip_ratio: 0.2
        neg_clip_ratio: 0.2
        diff_clip_ratio: 10
        final_clip_ratio: 3
        entropy_coef: 0.0
        kl_coef: 0.0
        save_hf: True
        bf16: True
        seq_length: 2048
        tokenizer_type: 'HuggingFaceTokenizer'
        tokenizer_model: ${{models.policy.load}}
        tensor_model_parallel_size: 1
        pipeline_model_parallel_size: 1
        expert_tensor_parallel_size: null
        expert_model_parallel_size: 1
        virtual_pipeline_model_parallel_size: null
        decoder_first_pipeline_num_layers: null
        decoder_last_pipeline_num_layers: null
        moe_router_force_load_balancing: False
        save: ${{runtime_args.output_dir}}
        save_interval: 10000
        log_interval: 1
        sequence_parallel: True
        use_distributed_optimizer: True
        recompute_granularity: null
        train_iters: 10000
        use_group_sequence_policy: False
      ref_policy:
        use_expandable_segments: ${{models.policy_trainer.use_expandable_segments}}
        free_gpu_memory: {{offload_weights: True}}
        generation_batch_size: 8
        gpu_per_process: 1
        num_gpu: ${{models.policy_trainer.num_gpu}}
        fsdp_size: ${{models.policy_trainer.num_gpu}}
        meta_init: ${{models.policy_trainer.meta_init}}
        groupgemm: ${{models.policy_trainer.groupgemm}}
        trainable: False
        load: ${{models.policy_trainer.load}}
        packing: ${{models.policy_trainer.packing}}
        max_token_in_packing: ${{models.policy_trainer.max_token_in_packing}}
        seq_length: ${{models.policy_trainer.seq_length}}
        tokenizer_type: 'HuggingFaceTokenizer'
        bf16: True
        sequence_parallel: True
      policy:
        free_gpu_memory: {{offload_weights: True}}
        generation_batch_size: 256
        gpu_per_process: 1
        num_gpu: ${{models.policy_trainer.num_gpu}}
        enforce_eager: False
        tensor_model_parallel_size: 1
        trainable: False
        load: ${{models.policy_trainer.load}}
        num_inference_per_prompt: 32
        seq_length: 2048
        max_seq_len_to_capture: 2348
        temperature: 1.0
        top_p: 1.0
        eval_temperature: 0.6
        eval_top_p: 0.95
        eval_top_k: 20
        vllm_prompt_key: prompt
        vllm_input_ids_key: input_ids
        enable_thinking: False
        enable_stage_resume: False
        gpu_memory_utilization: 0.8
      reward:
        num_cpu: 2
        cpu_per_process: 1
        generation_batch_size: 256
    """)
    path = tmp_path / "chatlearn.yaml"
    path.write_text(yaml_text)
    cfg = load_config(str(path))
    assert cfg.models.policy_trainer.optimizer.lr == pytest.approx(2e-6)
    assert cfg.models.policy.num_inference_per_prompt == 32
    plan = make_plan(cfg)
    assert plan.steps_per_episode == 1 and plan.trainer_dp == 2 and plan.micro_batches_per_step == 32


@pytest.mark.parametrize("override, key, words", [
    ("runtime_args.num_episod=3", "runtime_args.num_episod", ["Did you mean 'runtime_args.num_episode'"]),
    ("models.policy.temprature=1", "models.policy.temprature", ["Did you mean 'models.policy.temperature'"]),
    ("runtime_args.log_args_dict.log_samples_interval=-1", "runtime_args.log_args_dict.log_samples_interval",
     ["or 0 (do not)"]),
    ("runtime_args.log_args_dict.log_samples_num=0", "runtime_args.log_args_dict.log_samples_num",
     ["positive integer"]),
    ("models.policy_trainer.optimizer.lr=abc", "models.policy_trainer.optimizer.lr", ["wrong type", "Float"]),
    ("runtime_args.num_episode=many", "runtime_args.num_episode", ["wrong type"]),
    ("runtime_args.sample_per_episode=250", "runtime_args.sample_per_episode", ["divisible", "num_inference_per_prompt"]),
    ("runtime_args.train_global_batch_size=96", "runtime_args.sample_per_episode", ["divisible", "train_global_batch_size"]),
    ("models.policy_trainer.num_gpu=3", "runtime_args.train_global_batch_size", ["data-parallel"]),
    ("runtime_args.train_micro_batch_size=48", "models.policy_trainer.train_micro_batch_size", ["per-rank batch"]),
    ("models.policy.load=/no/such/model", "models.policy.load", ["does not exist"]),
    ("runtime_args.data_path=/no/such.jsonl", "runtime_args.data_path", ["does not exist"]),
    ("runtime_args.rollout_backend=vlm", "runtime_args.rollout_backend", ["Did you mean 'vllm'"]),
    ("runtime_args.colocation=[policy,polcy]", "runtime_args.colocation",
     ["not a model of this config", "Did you mean 'policy'"]),
    ("models.policy.top_p=0", "models.policy.top_p", ["(0, 1]"]),
    ("models.policy.presence_penalty=2.5", "models.policy.presence_penalty", ["[-2, 2]"]),
    ("models.policy.eval_frequency_penalty=-3", "models.policy.eval_frequency_penalty", ["[-2, 2]"]),
    ("models.policy.repetition_penalty=0", "models.policy.repetition_penalty", ["> 0"]),
    ("models.policy.eval_repetition_penalty=-1", "models.policy.eval_repetition_penalty", ["> 0"]),
    ("models.policy_trainer.old_logprobs=engine", "models.policy_trainer.old_logprobs", ["recompute", "rollout"]),
])
def test_config_errors_name_the_key(paths_overrides, override, key, words):
    with pytest.raises(ConfigError) as info:
        load_config(TEMPLATE, paths_overrides + [override])
    msg = str(info.value)
    assert info.value.key == key, msg
    assert msg.startswith(key)
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("overrides, pass_from", [
    ([], 128),  # the template: 2 steps of 128; step 1's own forward gives its old log-probs
    (["runtime_args.train_global_batch_size=256"], 256),  # one step per episode: no pass
    (["models.policy_trainer.old_logprobs=recompute"], 0),
    (["runtime_args.num_training_epoch=2"], 0),  # the second epoch needs step 1's old log-probs
    (["runtime_args.max_replay_episode=1"], 0),  # a later episode replays them
    (["models.policy_trainer.kl_coef=0.1", "models.policy_trainer.kl_in_reward=True"], 0),  # the reward's KL
])
def test_old_logprob_pass_leaves_out_what_the_math_does_not_need(paths_overrides, overrides, pass_from, capsys):
    plan = make_plan(load_config(TEMPLATE, paths_overrides + overrides))
    assert plan.old_logprob_pass_from == pass_from
    lines = " ".join(plan.describe())
    assert ("no separate pass" in lines) == (pass_from == 256)
    assert ("step 1's own forward" in lines) == (pass_from == 128)



def test_missing_required_key(tmp_path, tiny_model_dir, arith_data):
    path = tmp_path / "min.yaml"
    path.write_text(f"runtime_args:\n  data_path: {arith_data[0]}\n  num_episode: 1\n  sample_per_episode: 64\n"
                    f"  train_global_batch_size: 64\nmodels:\n  policy_trainer:\n    load: {tiny_model_dir}\n")
    with pytest.raises(ConfigError, match="required key has no value") as info:
        load_config(str(path))
    assert info.value.key == "runtime_args.output_dir"


def test_model_folder_without_config_json(paths_overrides, tmp_path):
    (tmp_path / "empty_model").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(TEMPLATE, paths_overrides + [f"models.policy_trainer.load={tmp_path / 'empty_model'}"])


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("runtime_args:\n  num_episode: [1, 2\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(str(bad))
    with pytest.raises(UserError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))


def test_cli_exit_code_and_one_paragraph_without_traceback(paths_overrides, capsys):
    assert main(["run", TEMPLATE, *paths_overrides, "runtime_args.num_episod=3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: runtime_args.num_episod")
    assert "\n\n" not in err.strip()


def test_cli_dry_run_prints_config_and_plan(paths_overrides, capsys):
    assert main(["run", "--dry-run", TEMPLATE, *paths_overrides]) == 0
    out = capsys.readouterr().out
    assert "# settings that differ from the defaults" in out and "runtime_args:" in out
    assert "optimizer steps per episode: 2" in out and "device group 0" in out


def secret_reward(tmp_path) -> str:
    """A reward function whose kwargs hold a secret."""
    path = tmp_path / "my_reward.py"
    path.write_text("def score(*, prompts, responses, ground_truths, data_sources, extra, api_key):\n"
                    "    return [0.0 for _ in responses]\n")
    return f"models.reward.functions=[{{name: m, path: '{path}:score', kwargs: {{api_key: sk-do-not-print}}}}]"


def test_cli_dry_run_prints_only_changed_settings_unless_all(paths_overrides, tmp_path, capsys):
    """--dry-run: the settings that differ from the schema's defaults (set in the YAML file or on the
    command line), secrets redacted; a default that follows another key (ref_policy.load follows
    policy_trainer.load) is not a change; --all: every setting."""
    from omegaconf import OmegaConf

    args = ["run", "--dry-run", TEMPLATE, *paths_overrides, "runtime_args.num_episode=7", secret_reward(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    changed = OmegaConf.create(out.split("\n# plan")[0])
    assert changed.runtime_args.num_episode == 7 and changed.models.policy_trainer.load
    assert changed.models.reward.functions[0].kwargs.api_key == "***" and "sk-do-not-print" not in out
    assert "adam_beta1" not in out and "num_training_epoch" not in out  # defaults left alone
    assert "load" not in changed.models.get("ref_policy", {})  # follows policy_trainer.load
    assert "optimizer steps per episode" in out

    assert main([*args, "--all"]) == 0
    out = capsys.readouterr().out
    assert "# resolved config, every setting" in out
    full = OmegaConf.create(out.split("\n# plan")[0].split("\n", 1)[1])
    assert full.models.policy_trainer.optimizer.adam_beta1 == 0.9 and full.runtime_args.num_training_epoch == 1
    assert full.models.ref_policy.load == full.models.policy_trainer.load and "sk-do-not-print" not in out


def test_cli_all_needs_dry_run(paths_overrides, capsys):
    assert main(["run", TEMPLATE, *paths_overrides, "--all"]) == 2
    assert "--all only changes what --dry-run prints" in capsys.readouterr().err


def test_console_script_exits_2(paths_overrides):
    proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", "run", TEMPLATE, *paths_overrides,
                           "models.policy.num_inference_per_prompt=0", "--dry-run"], capture_output=True, text=True)
    assert proc.returncode == 2 and "models.policy.num_inference_per_prompt" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ rollout tensor parallelism

MICRO8 = ["runtime_args.train_micro_batch_size=8"]  # fits 2 or 4 trainer ranks of the template's batch

def test_rollout_tensor_parallel_plan(paths_overrides):
    """A rollout replica is one engine on tensor_model_parallel_size devices of its group."""
    plan = make_plan(load_config(TEMPLATE, paths_overrides + MICRO8 + ["models.policy_trainer.num_gpu=4",
                                                              "models.policy.tensor_model_parallel_size=2"]))
    pl = plan.placements["policy"]
    assert plan.rollout_replicas == pl.num_actors == 2 and pl.devices_per_actor == plan.rollout_tp == 2
    assert [pl.actor_devices(i) for i in range(2)] == [[0, 1], [2, 3]]
    assert plan.devices_per_group == [4] and plan.placements["policy_trainer"].num_actors == 4
    lines = plan.describe()
    assert "  policy: 2 rollout replica(s) on device group 0, tensor parallel 2 (2 device(s) per engine)" in lines
    assert "    replica 0: devices 0, 1" in lines and "    replica 1: devices 2, 3" in lines
    assert "rollout replicas: 2 (tensor parallel 2: one engine on 2 devices each)" in lines
    # the derived num_replica is checked against num_gpu / tensor_model_parallel_size
    make_plan(load_config(TEMPLATE, paths_overrides + MICRO8 + ["models.policy_trainer.num_gpu=4",
                                                       "models.policy.tensor_model_parallel_size=2",
                                                       "models.policy.num_replica=2"]))


def test_rollout_tensor_parallel_devices_follow_their_group(paths_overrides):
    """Devices are numbered across groups: a rollout on its own group lists the run's device numbers."""
    plan = make_plan(load_config(TEMPLATE, paths_overrides + MICRO8 + [
        "runtime_args.colocation=[]", "models.policy_trainer.num_gpu=2", "models.policy.num_gpu=4",
        "models.policy.tensor_model_parallel_size=4"]))
    assert plan.device_groups == [["policy"], ["policy_trainer"]] and plan.total_devices == 6
    assert plan.rollout_replicas == 1
    assert "    replica 0: devices 0, 1, 2, 3" in plan.describe()
    apart = make_plan(load_config(TEMPLATE, paths_overrides + MICRO8 + [
        "runtime_args.colocation=[]", "models.policy_trainer.num_gpu=2", "models.policy.num_gpu=2",
        "models.policy.tensor_model_parallel_size=2"]))
    # policy_trainer's group comes after policy's: policy holds devices 0 and 1
    assert apart.device_groups[0] == ["policy"] and "    replica 0: devices 0, 1" in apart.describe()


def test_tensor_parallel_one_keeps_one_device_per_replica(paths_overrides):
    plan = make_plan(load_config(TEMPLATE, paths_overrides + MICRO8 + ["models.policy_trainer.num_gpu=2"]))
    pl = plan.placements["policy"]
    assert pl.num_actors == 2 and pl.devices_per_actor == 1 and pl.devices == [0, 1]
    assert "    replica 1: device 1" in plan.describe()
    assert "rollout replicas: 2" in plan.describe()


@pytest.mark.parametrize("overrides, key, words", [
    (["models.policy_trainer.num_gpu=3", "runtime_args.train_global_batch_size=33",
      "runtime_args.sample_per_episode=264", "runtime_args.train_micro_batch_size=11",
      "models.policy.num_inference_per_prompt=8", "models.policy.tensor_model_parallel_size=2"],
     "models.policy.num_gpu", ["divisible by tensor_model_parallel_size (2)"]),
    (["models.policy.tensor_model_parallel_size=2"], "models.policy.num_gpu", ["num_gpu (1)"]),
    (["models.policy.tensor_model_parallel_size=0"], "models.policy.tensor_model_parallel_size",
     ["positive integer"]),
    (["models.policy_trainer.num_gpu=2", "models.policy.tensor_model_parallel_size=2",
      "runtime_args.rollout_backend=hf"], "models.policy.tensor_model_parallel_size", ["rollout_backend: hf"]),
    (["models.policy.pipeline_model_parallel_size=2"], "models.policy.pipeline_model_parallel_size",
     ["not supported"]),
    (["models.policy_trainer.num_gpu=4", "models.policy.tensor_model_parallel_size=2",
      "models.policy.num_replica=4"], "models.policy.num_replica", ["is derived (2"]),
])
def test_rollout_tensor_parallel_errors_name_the_key(paths_overrides, overrides, key, words):
    with pytest.raises(ConfigError) as info:
        make_plan(load_config(TEMPLATE, paths_overrides + MICRO8 + overrides))
    msg = str(info.value)
    assert info.value.key == key, msg
    for w in words:
        assert w in msg, msg


def test_cli_dry_run_shows_rollout_tensor_parallel(paths_overrides, capsys):
    assert main(["run", "--dry-run", TEMPLATE, *paths_overrides, *MICRO8, "models.policy_trainer.num_gpu=4",
                 "models.policy.tensor_model_parallel_size=2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 2" in out and "replica 1: devices 2, 3" in out
