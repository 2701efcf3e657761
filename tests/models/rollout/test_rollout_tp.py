"""Rollout tensor parallelism: one engine over N devices, each rank fed every bucket of a push.

* ``vllm_tp2`` (CPU, vLLM's CPU backend): a real 2-rank engine (vLLM's multiprocess executor,
  as on CUDA) started from one model, given another model's weights bucket by bucket. Every rank
  must hold its shard of every bucket (checked rank by rank), and the log-probs must be those of
  the pushed model.
* The Ray side: a replica actor spanning N placement-group bundles sees exactly those devices
  (``CUDA_VISIBLE_DEVICES`` in the order of its bundles) and Ray leaves that alone.
* ``@pytest.mark.gpu``: the same generate + push on two CUDA devices, through Ray placement.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import ray
import torch
from backend_specs import rollout_spec
from tiny_model import make_tiny_model  # tests/ is on sys.path (tests/conftest.py)

MAX_PROMPT, MAX_RESPONSE = 16, 8
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two random models of the same shape: "old" (seed 0) and "new" (seed 1)."""
    root = tmp_path_factory.mktemp("tiny_tp")
    return {name: make_tiny_model(str(root / name), seed=seed) for name, seed in (("old", 0), ("new", 1))}


def tp_spec(load: str, tp: int, device: str = "cpu"):
    return rollout_spec(load, trust_remote_code=False, seed=1234, generation_batch_size=8,
                        max_prompt_tokens_length=MAX_PROMPT, max_response_tokens_length=MAX_RESPONSE,
                        seq_length=None, max_num_batched_tokens=None, dtype="float32", device=device,
                        gpu_memory_utilization=0.3, kv_cache="fit", enforce_eager=True,
                        tensor_model_parallel_size=tp, deterministic_inference=True, cpu_threads=None)


def state_dict(path: str) -> list:
    from safetensors.numpy import load_file

    return list(load_file(os.path.join(path, "model.safetensors")).items())


def two_buckets(path: str) -> list[list]:
    """A model folder's weights (no lm_head: tied) as two buckets, split inside a layer."""
    weights = [(k, torch.from_numpy(v.copy())) for k, v in state_dict(path) if k != "lm_head.weight"]
    cut = next(i for i, (k, _) in enumerate(weights) if k.endswith("self_attn.k_proj.weight"))
    return [weights[:cut], weights[cut:]]


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=int(rng.integers(3, MAX_PROMPT))).tolist() for _ in range(n)]


def reference_logprobs(path: str, batch: dict, temperature: float) -> list[np.ndarray]:
    """Per sample, log_softmax(logits / T) of the response tokens under a full transformers forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt, response in zip(batch["prompts"], batch["responses"]):
        ids = torch.tensor([list(prompt) + list(response)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].numpy())
    return out


def generate(engine, ps: list[list[int]], temperature: float = 1.0) -> dict:
    """Prompts, responses and log-probs, per sample, of one seeded generation."""
    batch = engine.generate(ps, {"temperature": temperature, "top_p": 1.0, "top_k": -1,
                                 "max_tokens": MAX_RESPONSE, "seed": 7})
    return unpack(batch)


def unpack(batch: dict) -> dict:
    out = {"prompts": [], "responses": [], "logprobs": []}
    offsets, plens = np.asarray(batch["offsets"]), np.asarray(batch["prompt_lens"])
    for i in range(len(plens)):
        start, mid, end = int(offsets[i]), int(offsets[i] + plens[i]), int(offsets[i + 1])
        out["prompts"].append(np.asarray(batch["tokens"][start:mid]).tolist())
        out["responses"].append(np.asarray(batch["tokens"][mid:end]).tolist())
        out["logprobs"].append(np.asarray(batch["rollout_logprobs"][mid:end]))
    return out


def assert_logprobs_of(path: str, got: dict, temperature: float = 1.0, tol: float = TOL) -> None:
    assert all(len(r) > 0 for r in got["responses"])
    for ref, lp in zip(reference_logprobs(path, got, temperature), got["logprobs"]):
        np.testing.assert_allclose(lp, ref, atol=tol, rtol=0)


def rank_shards(worker, names: list[str]) -> tuple[int, int, dict]:
    """(tp rank, tp size, {name: this rank's tensor}) inside a vLLM worker (``collective_rpc``).

    Parameters the CPU backend keeps as they were loaded (embedding rows, norms, biases); its
    linear weights are repacked into other storage.
    """
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    params = dict(worker.model_runner.get_model().named_parameters())
    return (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(),
            {n: params[n].detach().cpu().clone() for n in names})


# vLLM names (fused q/k/v: "qkv_proj") of parameters kept as loaded, and how they are split:
# embedding rows across ranks, norms replicated, the q/k/v bias split per projection.
CHECKED = {"model.embed_tokens.weight": "rows", "model.layers.0.input_layernorm.weight": "whole",
           "model.norm.weight": "whole", "model.layers.1.self_attn.qkv_proj.bias": "qkv"}


def expected_shard(full: dict, name: str, rank: int, tp: int, heads: int, kv_heads: int) -> torch.Tensor:
    how = CHECKED[name]
    if how == "whole":
        return full[name]
    if how == "rows":
        t = full[name]
        n = t.shape[0] // tp
        return t[rank * n:(rank + 1) * n]
    prefix = name[:-len("qkv_proj.bias")]
    q, k, v = (full[prefix + f"{x}_proj.bias"] for x in "qkv")
    head_dim = q.shape[0] // heads

    def part(t, h):
        n = h // tp * head_dim
        return t[rank * n:(rank + 1) * n]

    return torch.cat([part(q, heads), part(k, kv_heads), part(v, kv_heads)])


def assert_every_rank_has_every_bucket(engine, path: str, tp: int) -> None:
    """Each rank holds its own shard of the pushed model, for parameters of both buckets."""
    import functools
    import json

    with open(os.path.join(path, "config.json")) as f:
        conf = json.load(f)
    full = {k: torch.from_numpy(v.copy()) for k, v in state_dict(path)}
    first, second = ({k for k, _ in b} for b in two_buckets(path))
    # the checked parameters come from both buckets (qkv_proj from its q/k/v entries)
    assert {"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"} <= first
    assert {"model.norm.weight", "model.layers.1.self_attn.q_proj.bias"} <= second
    shards = engine.llm.collective_rpc(functools.partial(rank_shards, names=list(CHECKED)))
    assert sorted(r for r, _, _ in shards) == list(range(tp)) and {w for _, w, _ in shards} == {tp}
    for rank, _, got in shards:
        for name in CHECKED:
            want = expected_shard(full, name, rank, tp, conf["num_attention_heads"], conf["num_key_value_heads"])
            torch.testing.assert_close(got[name], want, atol=0, rtol=0, msg=f"rank {rank}: {name}")


# -- vLLM, 2 ranks on the CPU ---------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_tp2(model_dirs):
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("the CPU engine; CUDA runs test_vllm_tp2_on_two_gpus")
    # a Python function through collective_rpc (rank_shards): pickled, test only
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    threads, setter = torch.get_num_threads(), torch.set_num_threads
    from chatlearn.models.rollout.vllm import VLLMRollout

    engine = VLLMRollout(tp_spec(model_dirs["old"], tp=2))
    yield engine
    engine.llm.llm_engine.engine_core.shutdown()
    torch.set_num_threads = setter
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_tp2_generates_and_every_rank_takes_every_bucket(vllm_tp2, model_dirs):
    engine = vllm_tp2
    parallel = engine.llm.llm_engine.vllm_config.parallel_config
    assert parallel.tensor_parallel_size == 2 and parallel.distributed_executor_backend == "mp"
    assert not engine._in_process  # the ranks run in processes of their own: pushes are serialised
    ps = prompts()
    assert_logprobs_of(model_dirs["old"], generate(engine, ps))

    # streamed push (chatlearn.runtime.weight_push.stream): one reload fed bucket by bucket
    engine.begin_weight_update()
    for bucket in two_buckets(model_dirs["new"]):
        engine.load_weight_bucket(bucket)
    engine.finish_weight_update()
    assert_every_rank_has_every_bucket(engine, model_dirs["new"], tp=2)
    assert_logprobs_of(model_dirs["new"], generate(engine, ps))

    # and back, at another temperature
    engine.begin_weight_update()
    for bucket in two_buckets(model_dirs["old"]):
        engine.load_weight_bucket(bucket)
    engine.finish_weight_update()
    assert_logprobs_of(model_dirs["old"], generate(engine, ps, temperature=0.7), temperature=0.7)
    assert_every_rank_has_every_bucket(engine, model_dirs["old"], tp=2)


# -- Ray: a replica actor over N bundles -------------------------------------------------------

@pytest.fixture(scope="module")
def ray_four_devices():
    """A local Ray with 4 (logical, without a GPU) devices and a placement group of 4 bundles, started once
    for this file's tests (each kills the actors it starts)."""
    from ray.util.placement_group import placement_group

    gpus = torch.cuda.device_count() or 4
    ray.init(address="local", num_cpus=2, num_gpus=gpus, include_dashboard=False, logging_level="WARNING")
    try:
        pg = placement_group([{"GPU": 1}] * min(gpus, 4), strategy="PACK")
        ray.get(pg.ready(), timeout=60)
        yield pg
    finally:
        ray.shutdown()


@pytest.mark.slow  # a Ray cluster of four logical devices and a TP replica actor: about 35 s
@pytest.mark.timeout(300)
def test_tp_replica_actor_sees_the_devices_of_its_bundles(ray_four_devices):
    from chatlearn.runtime.cluster.group import create_group
    from chatlearn.runtime.cluster.worker_env import worker_env

    pg = ray_four_devices
    env = worker_env("rollout", "vllm", 1)
    started = []
    try:
        # one device per actor (as trainer ranks, and rollouts without tensor parallelism): Ray's choice
        single = create_group("single", "collections:OrderedDict", {}, num_actors=4, pg=pg, bundles=[0, 1, 2, 3],
                              gpu_fraction=0.3, cpus=0, threads=1, distributed=False, env=env)
        started += single.actors
        per_bundle = [ray.get(a.environment.remote())["CUDA_VISIBLE_DEVICES"] for a in single.actors]
        assert len(set(per_bundle)) == 4
        assert all("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES" not in ray.get(a.environment.remote())
                   for a in single.actors)
        # two replicas of 2 devices each, bundles in a non-trivial order: each sees its bundles' devices
        spanning = create_group("policy", "collections:OrderedDict", {}, num_actors=2, pg=pg, bundles=[1, 0, 3, 2],
                                gpu_fraction=0.3, cpus=0, threads=1, distributed=False, env=env, devices_per_actor=2)
        started += spanning.actors
        envs = [ray.get(a.environment.remote()) for a in spanning.actors]
        assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [f"{per_bundle[1]},{per_bundle[0]}",
                                                             f"{per_bundle[3]},{per_bundle[2]}"]
        assert all(e["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1" for e in envs)
        assert all(e["NCCL_CUMEM_ENABLE"] == env["NCCL_CUMEM_ENABLE"] for e in envs)  # the group's env is kept
        with pytest.raises(ValueError, match="need a placement group"):
            create_group("policy", "collections:OrderedDict", {}, num_actors=1, pg=None, bundles=[0, 1],
                         gpu_fraction=0.3, cpus=0, threads=1, distributed=False, env=env, devices_per_actor=2)
    finally:
        for actor in started:  # the bundles' devices are free again for the next test
            ray.kill(actor)


def generate_and_push_through_ray(pg, model_dirs: dict, device: str) -> None:
    """One vLLM replica of 2 ranks on bundles 0 and 1, started as a run starts it
    (``create_group``); it generates, takes a two-bucket push and generates with the new weights."""
    from chatlearn.runtime.cluster.group import create_group
    from chatlearn.runtime.cluster.worker_env import worker_env

    spec = tp_spec(model_dirs["old"], tp=2, device=device)
    group = create_group("policy", "chatlearn.models.rollout.vllm:VLLMRollout", spec, num_actors=1, pg=pg,
                         bundles=[0, 1], gpu_fraction=0.5, cpus=0, threads=1, distributed=False,
                         env=worker_env("rollout", "vllm", 1), devices_per_actor=2)
    ps = prompts()
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": MAX_RESPONSE, "seed": 7}
    assert_logprobs_of(model_dirs["old"], unpack(group.call("generate", ps, sampling)[0][0]))
    group.call("begin_weight_update")
    for bucket in two_buckets(model_dirs["new"]):
        group.call("load_weight_bucket", bucket)
    group.call("finish_weight_update")
    assert_logprobs_of(model_dirs["new"], unpack(group.call("generate", ps, sampling)[0][0]),
                       tol=TOL if device == "cpu" else 2e-3)
    for actor in group.actors:
        ray.kill(actor)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_tp2_replica_through_ray_placement(ray_four_devices, model_dirs):
    """The CPU twin of the GPU run: the replica actor holds 2 bundles and its engine's 2 ranks run
    in processes it spawns (vLLM's multiprocess executor inside a Ray actor)."""
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("CUDA runs test_vllm_tp2_on_two_gpus")
    generate_and_push_through_ray(ray_four_devices, model_dirs, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(900)
def test_vllm_tp2_on_two_gpus(ray_four_devices, model_dirs):
    pytest.importorskip("vllm")
    generate_and_push_through_ray(ray_four_devices, model_dirs, "cuda")
