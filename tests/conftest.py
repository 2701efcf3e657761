"""Shared fixtures: a tiny random model folder and a small arithmetic data set, built offline."""
from __future__ import annotations

import json
import os
import sys

import pytest

# The test tree mirrors the package (tests/<package>/...; e2e/, reliability/ and bench/ hold whole-run
# tests). Shared test code is importable by module name from every test: tests/ (this file),
# tests/support/ (the tiny model and Hub-cache builders, the specs tests build backends from, the strict
# fakes of vLLM and SGLang, the Megatron CPU shim, the metrics-doc reader), and the test modules whose
# helpers other tests reuse.
HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = ("support", os.path.join("models", "trainer"), os.path.join("models", "rollout"), "algorithms")
for _folder in (HERE, *(os.path.join(HERE, f) for f in SHARED)):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Under pytest-xdist (tools/run_tests.sh) each test process gets a temporary folder of its own, and
# with it the runs it starts: their Ray sessions (Ray takes TMPDIR), rendezvous files and leftover
# records, so that a test's checks of what a run left behind see only its own. Short: Ray's socket
# paths live under it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import tempfile

    _tmp = os.path.join(tempfile.gettempdir(), f"clt-{os.environ['PYTEST_XDIST_WORKER']}")
    os.makedirs(_tmp, exist_ok=True)
    os.environ["TMPDIR"] = _tmp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again

# the environment the suite started with, before any test changed it (tests/support/rank_processes.py)
START_ENV = dict(os.environ)


# The files that take longest, longest first (a minute or more each on 2 loaded cores: docs/testing.md).
# Under pytest-xdist (tools/run_tests.sh: --dist loadfile --no-loadscope-reorder) a process that is free
# takes the next file in collection order (and the one after it once fewer than three of its tests are
# left): these start first, then the other files with end-to-end runs (tests marked slow), then the rest,
# so that no long file starts last and keeps one process busy alone at the end.
LONGEST_FIRST = ("e2e/test_ppo_e2e.py", "e2e/test_placement.py", "reliability/test_reliability_e2e.py",
                 "models/rollout/test_rollout_tp.py", "e2e/test_megatron_e2e.py", "e2e/test_no_ray_e2e.py",
                 "e2e/test_sglang_e2e.py", "models/rollout/test_vllm_vision.py")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    slow = {item.path for item in items if item.get_closest_marker("slow")}

    def order(item):
        name = os.path.relpath(item.path, HERE).replace(os.sep, "/")
        return rank.get(name, len(rank) + (item.path not in slow))

    items.sort(key=order)  # stable: a file's tests keep their order


@pytest.fixture(autouse=True, scope="module")
def _environment_per_module():
    """What a test module leaves in ``os.environ`` does not reach the next modules and the runs they
    start: an in-process vLLM engine sets a dozen variables (``LD_PRELOAD``, ``VLLM_DIST_IDENT``, ...)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True, scope="session")
def _shared_runs_folder(tmp_path_factory):
    """Where the suite's shared finished runs live (tests/support/shared_runs.py): one folder for the
    whole session, both test processes included."""
    import shared_runs

    shared_runs.configure(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"), seed=0)


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2.5-VL folder (tests/support/tiny_qwen2_5_vl.py: the toy VLM's language model and
    processor, a Qwen2.5-VL vision tower with windowed attention)."""
    import tiny_qwen2_5_vl

    return tiny_qwen2_5_vl.build(tmp_path_factory.mktemp("models") / "qwen2_5_vl")


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory) -> str:
    """A folder that looks like a sequence-classification reward model (the toy's config, as one with a score
    head, and its tokenizer): enough for validation, which reads no weight."""
    import shutil

    out = tmp_path_factory.mktemp("reward_models") / "rm"
    shutil.copytree(os.path.join(REPO, "assets", "tiny_qwen2"), out)
    conf = json.loads((out / "config.json").read_text())
    conf.update(architectures=["Qwen2ForSequenceClassification"], num_labels=1, pad_token_id=0)
    conf.pop("id2label", None)
    (out / "config.json").write_text(json.dumps(conf))
    return str(out)


def write_arith(path: str, n: int, start: int = 0) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(start, start + n):
            a, b = i % 10, (i * 7) % 10
            f.write(json.dumps({"data_source": "arith",
                                "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                                "reward_model": {"style": "rule", "ground_truth": str(a + b)}}) + "\n")
    return path


@pytest.fixture(scope="session")
def arith_data(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("data")
    return write_arith(str(d / "train.jsonl"), 64), write_arith(str(d / "eval.jsonl"), 16, start=100)


@pytest.fixture
def paths_overrides(tiny_model_dir, arith_data, tmp_path) -> list[str]:
    """Overrides that point the FSDP template at the test model and data."""
    train, evald = arith_data
    return [f"models.policy_trainer.load={tiny_model_dir}", f"runtime_args.data_path={train}",
            f"runtime_args.eval_data_path={evald}", f"runtime_args.output_dir={tmp_path / 'out'}"]
