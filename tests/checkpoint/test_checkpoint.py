"""Sharded trainer checkpoints (FSDPTrainer.save_checkpoint / load_checkpoint) and the
offline merge into a Hugging Face folder (chatlearn.checkpoint.merge, ``chatlearn merge``).

Three rank jobs run once per module, in order (spawned processes with a hard deadline):
2 ranks train a step, save, and go on uninterrupted; a fresh 2-rank trainer resumes from
that checkpoint (2 -> 2). 1 rank resumes from it (2 -> 1), and saves its own checkpoint;
2 ranks resume from that one (1 -> 2). The tests compare what each returns, then merge the
2-rank checkpoint in this process.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from test_fsdp_trainer import (  # noqa: E402
    add_logprobs,
    hf_logprobs,
    make_batch,
    make_tiny_model,
    probe_logits,
    run_ranks,
    trainer_spec,
)

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 120

# --------------------------------------------------------------------------- rank jobs


def _continuation(trainer, batches, probe) -> dict:
    """What a restored trainer must reproduce: RNG draws, logits, the next step, the logits
    after it (a collective)."""
    rng = {"torch": torch.rand(4), "numpy": np.random.rand(4), "python": random.random()}
    logits = probe_logits(trainer, probe)
    step = trainer.train(batches[1])
    return {"rng": rng, "logits": logits, "step": step, "after": probe_logits(trainer, probe)}


def job_save_two(rank, world, path, batches, probe, out, wide):
    """2 ranks: a step, save, go on; then a fresh trainer resumes (2 -> 2)."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    trainer = FSDPTrainer(trainer_spec(path))
    trainer.train(batches[0])
    t0 = time.monotonic()
    trainer.save_checkpoint(os.path.join(out, "ck2"))
    res = {"save_s": time.monotonic() - t0,
           "uninterrupted": _continuation(trainer, batches, probe)}
    restored = FSDPTrainer(trainer_spec(path, seed=1))
    t0 = time.monotonic()
    restored.load_checkpoint(os.path.join(out, "ck2"))
    res["load_s"] = time.monotonic() - t0
    res["restored"] = _continuation(restored, batches, probe)
    return res


def job_one_rank(rank, world, path, batches, probe, out, wide):
    """1 rank: resume from the 2-rank checkpoint (2 -> 1); save a 1-rank checkpoint and go
    on; the refusals; a checkpoint saved before the first step; a frozen ref_policy's."""
    from chatlearn.errors import UserError
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    res = {}
    restored = FSDPTrainer(trainer_spec(path, seed=1))
    restored.load_checkpoint(os.path.join(out, "ck2"))
    res["from_two"] = _continuation(restored, batches, probe)

    trainer = FSDPTrainer(trainer_spec(path))
    trainer.train(batches[0])
    trainer.save_checkpoint(os.path.join(out, "ck1"))
    res["uninterrupted"] = _continuation(trainer, batches, probe)

    refused = []
    for part in ("weights", "optimizer"):
        trainer.offload([part])
        for call in (trainer.save_checkpoint, trainer.load_checkpoint):
            try:
                call(os.path.join(out, "ck1"))
                refused.append(None)
            except RuntimeError as err:
                refused.append(str(err))
        trainer.onload([part])
    res["offload_refusals"] = refused

    # saved before the first step: saving must not change that step, and a trainer that
    # has stepped since goes back to "no optimizer state" on load
    fresh = FSDPTrainer(trainer_spec(path))
    fresh.save_checkpoint(os.path.join(out, "ck_fresh"))
    res["fresh_step"] = (fresh.train(batches[0]), probe_logits(fresh, probe))
    plain = FSDPTrainer(trainer_spec(path))
    res["plain_step"] = (plain.train(batches[0]), probe_logits(plain, probe))
    plain.load_checkpoint(os.path.join(out, "ck_fresh"))
    res["fresh_loaded_step"] = (plain.train(batches[0]), probe_logits(plain, probe))

    ref = FSDPTrainer(trainer_spec(path, trainable=False))
    ref.save_checkpoint(os.path.join(out, "ck_ref"))
    ref_logits = probe_logits(ref, probe)
    ref2 = FSDPTrainer(trainer_spec(path, trainable=False))
    ref2.load_checkpoint(os.path.join(out, "ck2"))  # a policy's checkpoint: weights only
    res["ref_from_policy_logits"] = probe_logits(ref2, probe)
    ref2.load_checkpoint(os.path.join(out, "ck_ref"))
    res["ref_roundtrip"] = torch.equal(probe_logits(ref2, probe), ref_logits)
    try:
        trainer.load_checkpoint(os.path.join(out, "ck_ref"))
        res["ref_into_policy"] = None
    except UserError as err:
        res["ref_into_policy"] = str(err)
    try:  # a model of another shape
        FSDPTrainer(trainer_spec(wide)).load_checkpoint(os.path.join(out, "ck2"))
        res["other_model"] = None
    except UserError as err:
        res["other_model"] = str(err)
    return res


def job_load_one(rank, world, path, batches, probe, out, wide):
    """2 ranks resume from the 1-rank checkpoint (1 -> 2)."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    restored = FSDPTrainer(trainer_spec(path, seed=1))
    restored.load_checkpoint(os.path.join(out, "ck1"))
    return _continuation(restored, batches, probe)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    batches = []
    for seed in (0, 5):
        batch = make_batch(vocab, seed=seed)
        batches.append(add_logprobs(batch, hf_logprobs(path, batch)[0], seed=seed + 1))
    probe = torch.from_numpy(np.random.default_rng(3).integers(0, vocab, (2, 9)))
    # the same model with a wider MLP: checkpoints of the first do not fit it
    config = AutoConfig.from_pretrained(path)
    config.intermediate_size = 512
    wide = str(tmp_path_factory.mktemp("wide"))
    AutoModelForCausalLM.from_config(config).save_pretrained(wide)
    return {"path": path, "batches": batches, "probe": probe, "wide": wide}


@pytest.fixture(scope="module")
def ckpts(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpts")
    args = (assets["path"], assets["batches"], assets["probe"], str(out), assets["wide"])
    timings = {}

    def job(name, fn, world):
        t0 = time.monotonic()
        results = run_ranks(fn, world, tmp_path_factory.mktemp(name), *args,
                            timeout=JOB_TIMEOUT_S)
        timings[name] = round(time.monotonic() - t0, 1)
        return results

    two = job("save_two", job_save_two, 2)
    one = job("one_rank", job_one_rank, 1)[0]
    one_to_two = job("load_one", job_load_one, 2)
    print(timings, {"save_s": round(two[0]["save_s"], 3), "load_s": round(two[0]["load_s"], 3)})
    return {"out": out, "two": two, "one": one, "one_to_two": one_to_two}


# --------------------------------------------------------------------------- helpers


def assert_same_continuation(got, want, exact_step: bool):
    """Logits right after the load equal bit for bit; the next step too with the world
    size it was saved with, else within float32 reduction-order noise."""
    assert torch.equal(got["logits"], want["logits"])
    if exact_step:
        assert got["step"] == want["step"]
        assert torch.equal(got["after"], want["after"])
    else:
        for key, value in want["step"].items():
            # per rank, so they depend on the world size: the micro-steps, and the padding (each rank
            # groups its own samples by length)
            if key in ("micro_steps", "pad_token_frac"):
                continue
            assert got["step"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        torch.testing.assert_close(got["after"], want["after"], rtol=0, atol=1e-6)
    assert not torch.equal(got["after"], got["logits"])  # the step did change the weights


def assert_same_rng(got, want):
    assert torch.equal(got["torch"], want["torch"])
    assert np.array_equal(got["numpy"], want["numpy"])
    assert got["python"] == want["python"]


def merge(ckpt, out, **kw):
    from chatlearn.checkpoint.merge import merge_checkpoint

    return merge_checkpoint(str(ckpt), str(out), **kw)


def hf_logits(folder, probe, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return model(input_ids=probe).logits.float()


def corrupt_copy(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint ``src`` whose DCP metadata ``edit(metadata)`` changed."""
    shutil.copytree(src, dst)
    with open(dst / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    edit(metadata)
    with open(dst / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return dst


def config_copy(src: str, dst: Path, **changes) -> Path:
    """A copy of the model folder ``src`` without weights, config.json changed."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# --------------------------------------------------------------------------- resume


@pytest.mark.timeout(300)
def test_resume_with_the_same_world_size_is_exact(ckpts):
    for res in ckpts["two"]:
        assert_same_continuation(res["restored"], res["uninterrupted"], exact_step=True)
        assert_same_rng(res["restored"]["rng"], res["uninterrupted"]["rng"])
    r0, r1 = ckpts["two"]
    assert not torch.equal(r0["uninterrupted"]["rng"]["torch"], torch.zeros(4))


@pytest.mark.timeout(300)
def test_resume_two_ranks_to_one(ckpts):
    r0 = ckpts["two"][0]
    got = ckpts["one"]["from_two"]
    assert_same_continuation(got, r0["uninterrupted"], exact_step=False)
    assert_same_rng(got["rng"], r0["uninterrupted"]["rng"])  # rank 0 gets rank 0's states


@pytest.mark.timeout(300)
def test_resume_one_rank_to_two(ckpts):
    want = ckpts["one"]["uninterrupted"]
    for res in ckpts["one_to_two"]:  # both ranks take the single saved rank's states
        assert_same_continuation(res, want, exact_step=False)
        assert_same_rng(res["rng"], want["rng"])


@pytest.mark.timeout(300)
def test_checkpoint_files(ckpts):
    ck = ckpts["out"] / "ck2"
    names = sorted(p.name for p in ck.iterdir())
    assert names == sorted([".complete", ".metadata", "__0_0.distcp", "__1_0.distcp",
                            "chatlearn_checkpoint.json", "rng"])
    assert sorted(p.name for p in (ck / "rng").iterdir()) == [
        "rank_00000.safetensors", "rank_00001.safetensors"]
    meta = json.loads((ck / "chatlearn_checkpoint.json").read_text())
    assert meta["world_size"] == 2 and meta["has_optimizer"] and meta["optimizer_stepped"]
    assert meta["hf_config"]["hidden_size"] == 128
    assert meta["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in meta["tensors"]
    assert meta["tensors"]["model.embed_tokens.weight"] == {"shape": [320, 128],
                                                            "dtype": "float32"}
    from chatlearn.checkpoint.sharded import read_dcp_metadata

    keys = read_dcp_metadata(str(ck)).state_dict_metadata
    assert "model.lm_head.weight" not in keys  # tied: stored once
    assert "optimizer.state.model.embed_tokens.weight.exp_avg" in keys
    # a frozen ref_policy's checkpoint and one saved before the first step: no optimizer
    for name in ("ck_ref", "ck_fresh"):
        keys = read_dcp_metadata(str(ckpts["out"] / name)).state_dict_metadata
        assert keys and all(k.startswith("model.") for k in keys), name


@pytest.mark.timeout(300)
def test_refusals_and_special_cases(ckpts):
    one = ckpts["one"]
    assert all(msg and "offloaded" in msg and "onload" in msg for msg in one["offload_refusals"])
    assert len(one["offload_refusals"]) == 4
    # saving before the first step leaves that step unchanged; loading such a checkpoint
    # into a trainer that has stepped since resets its optimizer state
    fresh, plain, loaded = one["fresh_step"], one["plain_step"], one["fresh_loaded_step"]
    assert fresh[0] == plain[0] and torch.equal(fresh[1], plain[1])
    assert loaded[0] == plain[0] and torch.equal(loaded[1], plain[1])
    # a ref_policy loads a policy checkpoint's weights; the reverse is refused
    assert torch.equal(one["ref_from_policy_logits"], ckpts["two"][0]["uninterrupted"]["logits"])
    assert one["ref_roundtrip"]
    assert one["ref_into_policy"] and "no optimizer state" in one["ref_into_policy"]
    assert one["other_model"] and "does not fit this model" in one["other_model"]
    assert "model.layers.0.mlp.gate_proj.weight has shape [512, 128] in this model but " \
           "[256, 128] in the checkpoint" in one["other_model"]


# --------------------------------------------------------------------------- merge


@pytest.mark.timeout(300)
def test_merge_loads_in_transformers_with_the_trainers_logits(assets, ckpts, tmp_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    want = ckpts["two"][0]["uninterrupted"]["logits"]  # the weights saved
    out = tmp_path / "hf"
    summary = merge(ckpts["out"] / "ck2", out)
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    assert {"config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)
    assert summary["shards"] == ["model.safetensors"] and summary["num_tensors"] == 26
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied, as save_pretrained writes it
        assert f.metadata() == {"format": "pt"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    torch.testing.assert_close(hf_logits(out, assets["probe"]), want, rtol=0, atol=1e-6)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False)


@pytest.mark.timeout(300)
def test_merge_into_several_shards(assets, ckpts, tmp_path):
    from safetensors.torch import load_file

    want = ckpts["two"][0]["uninterrupted"]["logits"]
    one = tmp_path / "one"
    merge(ckpts["out"] / "ck2", one)
    many = tmp_path / "many"
    summary = merge(ckpts["out"] / "ck2", many, max_shard_size="100KB")
    shards = summary["shards"]
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (many / "model.safetensors").exists()
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == summary["total_bytes"]
    single = load_file(one / "model.safetensors")
    assert set(index["weight_map"]) == set(single)
    for name in shards:
        part = load_file(many / name)
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= 100_000 or len(part) == 1  # a tensor over the limit is alone
        for key, tensor in part.items():
            assert index["weight_map"][key] == name and torch.equal(tensor, single[key])
    torch.testing.assert_close(hf_logits(many, assets["probe"]), want, rtol=0, atol=1e-6)


@pytest.mark.timeout(300)
def test_merge_to_bfloat16(assets, ckpts, tmp_path):
    from safetensors.torch import load_file

    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    full_bytes = merge(ckpts["out"] / "ck2", fp32)["total_bytes"]
    assert merge(ckpts["out"] / "ck2", bf16, dtype="bfloat16")["total_bytes"] * 2 == full_bytes
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    full, half = load_file(fp32 / "model.safetensors"), load_file(bf16 / "model.safetensors")
    for key, tensor in full.items():
        assert half[key].dtype == torch.bfloat16 and torch.equal(half[key],
                                                                 tensor.to(torch.bfloat16))
    logits = hf_logits(bf16, assets["probe"], dtype=torch.bfloat16)
    want = ckpts["two"][0]["uninterrupted"]["logits"]
    assert (logits - want).abs().max() < 0.1


@pytest.mark.timeout(300)
def test_merge_refuses_a_corrupted_or_mismatched_checkpoint(assets, ckpts, tmp_path):
    from chatlearn.errors import UserError

    ck = ckpts["out"] / "ck2"
    key = "model.model.layers.0.mlp.up_proj.weight"

    def shrink(md):
        md.state_dict_metadata[key].size = torch.Size([255, 128])

    bad = corrupt_copy(ck, tmp_path / "bad_shape", shrink)
    with pytest.raises(UserError) as err:
        merge(bad, tmp_path / "o1")
    msg = str(err.value)
    assert "'model.layers.0.mlp.up_proj.weight'" in msg
    assert "expected shape [256, 128]" in msg and "found [255, 128]" in msg
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o1.partial").exists()

    def retype(md):
        md.state_dict_metadata["model.model.norm.weight"].properties.dtype = torch.int64

    with pytest.raises(UserError, match=r"'model.norm.weight': expected dtype float32, found "
                                        r"int64"):
        merge(corrupt_copy(ck, tmp_path / "retyped", retype), tmp_path / "o2")

    def add_key(md):
        md.state_dict_metadata["model.model.extra.weight"] = md.state_dict_metadata[key]

    with pytest.raises(UserError, match=r"unexpected key 'model.extra.weight'"):
        merge(corrupt_copy(ck, tmp_path / "extra", add_key), tmp_path / "o2")

    # checkpoints that do not fit the model of another config
    wider = config_copy(assets["path"], tmp_path / "wider", intermediate_size=512)
    with pytest.raises(UserError) as err:
        merge(ck, tmp_path / "o3", hf_config=str(wider))
    msg = str(err.value)
    assert "'model.layers.0.mlp.gate_proj.weight': expected shape [512, 128]" in msg
    assert "found [256, 128]" in msg
    deeper = config_copy(assets["path"], tmp_path / "deeper", num_hidden_layers=3,
                         layer_types=["full_attention"] * 3)
    with pytest.raises(UserError, match=r"missing key 'model.layers.2.self_attn.q_proj.weight'"):
        merge(ck, tmp_path / "o4", hf_config=str(deeper))
    invalid = config_copy(assets["path"], tmp_path / "invalid", num_hidden_layers=3)
    with pytest.raises(UserError, match=r"cannot build the model .*layer_types"):
        merge(ck, tmp_path / "o4", hf_config=str(invalid))
    untied = config_copy(assets["path"], tmp_path / "untied", tie_word_embeddings=False)
    with pytest.raises(UserError, match=r"missing key 'lm_head.weight'"):
        merge(ck, tmp_path / "o5", hf_config=str(untied))
    # the model trained from a different config: a 1-layer tiny model
    from tiny_model import make_tiny_model as make_plain

    other = Path(make_plain(str(tmp_path / "other")))
    config = json.loads((other / "config.json").read_text())
    config.update(num_hidden_layers=1, layer_types=["full_attention"])
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"unexpected key 'model.layers.1"):
        merge(ck, tmp_path / "o6", hf_config=str(other))


@pytest.mark.timeout(300)
def test_merge_refuses_bad_input(assets, ckpts, tmp_path):
    from chatlearn.errors import UserError

    ck = ckpts["out"] / "ck2"
    missing = tmp_path / "nope"
    with pytest.raises(UserError, match="does not exist") as err:
        merge(missing, tmp_path / "o")
    assert str(missing) in str(err.value)
    with pytest.raises(UserError, match="not a chatlearn trainer checkpoint"):
        merge(assets["path"], tmp_path / "o")  # a Hugging Face folder, not a checkpoint
    incomplete = tmp_path / "incomplete"
    shutil.copytree(ck, incomplete)
    (incomplete / ".complete").unlink()
    with pytest.raises(UserError, match="incomplete"):
        merge(incomplete, tmp_path / "o")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        merge(ck, busy)
    with pytest.raises(UserError, match="not a size"):
        merge(ck, tmp_path / "o", max_shard_size="big")
    with pytest.raises(UserError, match="--hf-config"):
        merge(ck, tmp_path / "o", hf_config=str(tmp_path))
    # the folder the trainer loaded is gone: --hf-config is the fix
    moved = tmp_path / "moved"
    shutil.copytree(ck, moved)
    meta = json.loads((moved / "chatlearn_checkpoint.json").read_text())
    meta["hf_source"] = str(tmp_path / "gone")
    (moved / "chatlearn_checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="--hf-config"):
        merge(moved, tmp_path / "o")
    merge(moved, tmp_path / "o", hf_config=assets["path"])
    # a run's checkpoint folder holding the trainer state under trainer/
    run_ckpt = tmp_path / "episode_000001"
    shutil.copytree(ck, run_ckpt / "trainer")
    assert merge(run_ckpt, tmp_path / "o7")["num_tensors"] == 26


# --------------------------------------------------------------------------- command line


def _cli(*args, tool=False, process=False):
    """``chatlearn merge ARGS`` (``tool``: tools/merge_checkpoint.py) in a process of its own (``process``,
    ``tool``), or through ``chatlearn.cli.main`` in this one (what the command runs, without the seconds of
    a new interpreter's imports): its exit code, stdout and stderr."""
    if not (tool or process):
        import contextlib
        import io
        import types

        from chatlearn.cli import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["merge", *(str(a) for a in args)])
            except SystemExit as e:  # argparse's usage errors
                code = e.code
        return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    cmd = ([sys.executable, str(REPO / "tools" / "merge_checkpoint.py")] if tool else
           [sys.executable, "-m", "chatlearn.cli", "merge"])
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)


@pytest.mark.slow  # several chatlearn commands in subprocesses: about 10 s
@pytest.mark.timeout(300)
def test_cli_exit_codes(assets, ckpts, tmp_path):
    ck = ckpts["out"] / "ck2"
    ok = _cli(ck, tmp_path / "out", "--dtype", "bfloat16", "--max-shard-size", "200KB", process=True)  # the command
    assert ok.returncode == 0, ok.stderr
    assert "wrote" in ok.stdout and "bfloat16" in ok.stdout
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()

    bad = _cli(tmp_path / "missing", tmp_path / "out2")
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
    assert str(tmp_path / "missing") in bad.stderr.replace("\n", " ")

    incomplete = tmp_path / "incomplete"
    shutil.copytree(ck, incomplete)
    (incomplete / ".complete").unlink()
    bad = _cli(incomplete, tmp_path / "out3", tool=True)
    assert bad.returncode == 2 and "incomplete" in bad.stderr and "Traceback" not in bad.stderr

    usage = _cli(ck, tmp_path / "out4", "--dtype", "int8")
    assert usage.returncode == 2 and "invalid choice" in usage.stderr


class _Payload:
    """A pickle that runs a command when unpickled without restrictions."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.timeout(300)
def test_checkpoint_metadata_is_not_unpickled_blindly(ckpts, tmp_path):
    from chatlearn.errors import UserError

    evil = tmp_path / "evil"
    shutil.copytree(ckpts["out"] / "ck2", evil)
    marker = tmp_path / "pwned"
    with open(evil / ".metadata", "wb") as f:
        pickle.dump(_Payload(marker), f)
    with pytest.raises(UserError, match="not allowed in checkpoint metadata"):
        merge(evil, tmp_path / "o")
    assert not marker.exists()


@pytest.mark.timeout(300)
def test_merge_and_eval_refuse_a_checkpoint_that_does_not_match_its_manifest(ckpts, tmp_path):
    """A run's checkpoint (episode_N/trainer) with a shard truncated after it was written:
    ``chatlearn merge`` exits 2 naming the file, and so does ``chatlearn eval``'s resolution
    of --checkpoint; a damaged hf/ does not stop a merge of the intact trainer/."""
    from chatlearn.checkpoint.manager import write_manifest
    from chatlearn.errors import UserError
    from chatlearn.runtime.driver.evaluate import resolve_model

    run = tmp_path / "episode_000002"
    shutil.copytree(ckpts["out"] / "ck2", run / "trainer")
    (run / "hf").mkdir()
    (run / "hf" / "model.safetensors").write_bytes(b"x" * 64)
    (run / "hf" / "config.json").write_text("{}")
    write_manifest(str(run))
    ok = _cli(run, tmp_path / "merged")
    assert ok.returncode == 0, ok.stderr
    with open(run / "hf" / "model.safetensors", "r+b") as f:
        f.truncate(10)
    assert _cli(run, tmp_path / "merged2").returncode == 0  # only trainer/ is read
    shard = sorted((run / "trainer").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    bad = _cli(run, tmp_path / "merged3")
    text = " ".join(bad.stderr.split())
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert "is damaged" in text and f"trainer/{shard.name}" in text and "(truncated)" in text
    assert not (tmp_path / "merged3").exists()
    for given in (run, run / "hf"):  # --checkpoint: the run's checkpoint, or its hf/ folder
        with pytest.raises(UserError, match="is damaged: hf/model.safetensors is 10 bytes, 64 when written"):
            resolve_model(str(given))
