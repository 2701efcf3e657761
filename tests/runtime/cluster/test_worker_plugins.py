"""The trainer workers import runtime_args.plugins (TrainerSpec.plugins) before they build their backend: a
worker in a process of its own (the Worker.setup a Ray actor runs too) finds the plugged names in its
registries when its backend is built; a relative file and a module name are found from the driver's directory
(``plugins_dir``)."""
from __future__ import annotations

import os

import pytest
from backend_specs import trainer_spec
from conftest import REPO

from chatlearn.calls import get
from chatlearn.runtime.cluster.group import create_group

SUPPORT = os.path.join(REPO, "tests", "support", "plugins")


@pytest.mark.timeout(120)
def test_a_trainer_worker_imports_the_plugins_of_its_spec_before_building(tmp_path):
    (tmp_path / "my_rl_kl.py").write_text(
        "from chatlearn.plugins import register_kl_estimator\n\n\n"
        "@register_kl_estimator('half_k1')\n"
        "def half_k1(logp, ref_logp):\n"
        "    return (logp - ref_logp) / 2\n")
    (tmp_path / "rl").symlink_to(SUPPORT)
    # the driver ran from tmp_path: a file relative to it, and a module only it holds (not on the worker's path)
    spec = trainer_spec(policy_loss="unclipped", plugins=("rl/range_rl.py", "my_rl_kl"), plugins_dir=str(tmp_path))
    env = {"PYTHONPATH": os.pathsep.join([SUPPORT, os.environ.get("PYTHONPATH", "")])}  # the backend's module
    group = create_group("policy_trainer", "probe_backend:Probe", spec, num_actors=1, pg=None, bundles=[],
                         gpu_fraction=0, cpus=0, threads=1, distributed=False, env=env, place="process")
    try:
        seen, _ = get(group.actors[0].call.remote("report"))
    finally:
        for actor in group.actors:
            actor.stop()
    assert seen["pid"] != os.getpid() and seen["loss"] == "unclipped"
    assert seen["policy loss"] == ["vanilla", "gspo", "unclipped"]
    assert seen["advantage estimator"][-1] == "group_range" and seen["KL estimator"][-1] == "half_k1"
