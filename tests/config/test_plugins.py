"""runtime_args.plugins: the user's modules register advantage estimators, policy losses and KL estimators of their
own; the config then accepts their names (did-you-mean over the built-in and the plugged ones), and every bad
plugin is one paragraph naming runtime_args.plugins[i] before anything starts. The trainer workers' import is
tests/runtime/cluster/test_worker_plugins.py; a run that trains with a plugin is tests/e2e/test_plugins_e2e.py."""
from __future__ import annotations

import os
import sys
import textwrap

import pytest
from conftest import REPO

from chatlearn.config import registry
from chatlearn.config.load import load_run
from chatlearn.config.plugins import load_plugins
from chatlearn.errors import ConfigError
from chatlearn.models.specs import TrainerSpec

GRPO = "template/grpo_fsdp.yaml"
HF = "runtime_args.rollout_backend=hf"
PLUGIN = os.path.join("tests", "support", "plugins", "range_rl.py")  # relative to the repository
PT = "models.policy_trainer"


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    """Each test plugs into copies of the registries, and the modules it imports are forgotten after it: the
    names it plugs do not outlive it (in this process, every later test would see them)."""
    monkeypatch.chdir(REPO)
    for reg in registry.pluggable():
        monkeypatch.setattr(reg, "_plugged", dict(reg._plugged))
        monkeypatch.setattr(reg, "_impl", dict(reg._impl))
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith(("chatlearn_plugin_", "my_rl", "rl_pkg")):
            del sys.modules[name]


def _write(folder, name: str, body: str) -> str:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return str(path)


def _refused(*overrides) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_run(GRPO, [HF, *overrides])
    return info.value


ESTIMATOR = """
    from chatlearn.plugins import register_advantage_estimator


    @register_advantage_estimator("{name}")
    def estimate(rewards, group_means, group_size, response_lens, keep):
        return rewards - group_means
"""


def test_plugged_names_validate_and_reach_the_trainer_spec():
    cfg, plan = load_run(GRPO, [HF, f"runtime_args.plugins=[{PLUGIN}]", f"{PT}.advantage_estimator=group_range",
                                f"{PT}.policy_loss=unclipped"])
    assert "group_range" in registry.ADVANTAGE_ESTIMATORS and "unclipped" in registry.POLICY_LOSSES
    assert registry.ADVANTAGE_ESTIMATORS.names[-1] == "group_range"  # after the built-in ones
    spec = TrainerSpec.from_config(cfg, "policy_trainer", plan)
    assert spec.policy_loss == "unclipped" and spec.plugins == (PLUGIN,) and spec.plugins_dir == REPO
    fn = registry.ADVANTAGE_ESTIMATORS.get("group_range")
    # loaded again (the worker of a run without Ray, a second validation): the module is not run again
    load_plugins([PLUGIN], base_dir=REPO)
    assert registry.ADVANTAGE_ESTIMATORS.get("group_range") is fn
    # the plugged estimator is called as the built-in ones are, its advantages used as theirs
    import numpy as np

    from chatlearn.algorithms.advantages import compute_advantages

    rewards = np.array([0.0, 1.0, 2.0, 1.0, 1.0, 1.0])
    got = compute_advantages(rewards, 3, "group_range", np.ones(6), np.array([1, 1, 1, 0, 0, 0]))
    np.testing.assert_allclose(got, [-0.5, 0.0, 0.5, 0.0, 0.0, 0.0], atol=1e-6)


def test_a_module_name_on_the_path_and_a_file_given_twice(tmp_path, monkeypatch):
    _write(tmp_path, "rl_pkg/__init__.py", "")
    _write(tmp_path, "rl_pkg/my_rl.py", ESTIMATOR.format(name="from_module"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    load_run(GRPO, [HF, f"runtime_args.plugins=[rl_pkg.my_rl,{PLUGIN},{PLUGIN}]",
                    f"{PT}.advantage_estimator=from_module"])
    assert registry.ADVANTAGE_ESTIMATORS.plugged().keys() >= {"from_module", "group_range"}


def test_unknown_names_suggest_the_nearest_built_in_or_plugged_one():
    # without the plugin the name is unknown: the message says how to add one
    err = _refused(f"{PT}.advantage_estimator=group_range")
    assert "plugged in" not in str(err)
    assert "register your own advantage estimator in a module named in runtime_args.plugins" in str(err)
    plugins = f"runtime_args.plugins=[{PLUGIN}]"
    err = _refused(plugins, f"{PT}.advantage_estimator=group_rnage")
    assert err.key == f"{PT}.advantage_estimator"
    assert "Did you mean 'group_range'?" in str(err) and "built in: grpo, dr_grpo, rloo" in str(err)
    assert "plugged in by runtime_args.plugins: group_range" in str(err)
    err = _refused(plugins, f"{PT}.policy_loss=gpso")
    assert err.key == f"{PT}.policy_loss" and "Did you mean 'gspo'?" in str(err)
    err = _refused(f"{PT}.kl_estimator=low_var")
    assert err.key == f"{PT}.kl_estimator" and "Did you mean 'low_var_kl'?" in str(err)



def test_a_module_that_is_not_found(tmp_path):
    err = _refused("runtime_args.plugins=[no_such_pkg.my_rl]")
    assert err.key == "runtime_args.plugins[0]"
    assert "no module 'no_such_pkg' on the Python path" in str(err) and "PYTHONPATH" in str(err)
    assert "path/to/my_rl.py" in str(err)
    err = _refused(f"runtime_args.plugins=[{PLUGIN},nowhere/my_rl.py]")
    assert err.key == "runtime_args.plugins[1]" and "'nowhere/my_rl.py' does not exist" in str(err)
    err = _refused("runtime_args.plugins=['not a module']")
    assert err.key == "runtime_args.plugins[0]" and "neither a module name" in str(err)


def test_a_module_that_raises_on_import(tmp_path):
    bad = _write(tmp_path, "my_rl_bad.py", """
        import os

        raise RuntimeError("needs MY_SETTING\\nsecond line")
    """)
    err = _refused(f"runtime_args.plugins=[{bad}]")
    assert err.key == "runtime_args.plugins[0]"
    assert f"failed with RuntimeError: needs MY_SETTING at {bad}:4." in str(err) and "second line" not in str(err)
    dep = _write(tmp_path, "my_rl_dep.py", "import not_installed_dependency\n")
    err = _refused(f"runtime_args.plugins=[{dep}]")
    assert "failed with ModuleNotFoundError: No module named 'not_installed_dependency'" in str(err)
    assert dep not in sys.modules and not any(n.startswith("chatlearn_plugin_my_rl_bad") for n in sys.modules)


def test_a_name_registered_twice(tmp_path):
    builtin = _write(tmp_path, "my_rl_builtin.py", ESTIMATOR.format(name="grpo"))
    err = _refused(f"runtime_args.plugins=[{builtin}]")
    assert err.key == "runtime_args.plugins[0]"
    assert f"registers the advantage estimator 'grpo' (estimate ({builtin}:5))" in str(err)
    assert "'grpo' is built in (chatlearn's chatlearn.algorithms.advantages)" in str(err)
    a = _write(tmp_path, "a/my_rl.py", ESTIMATOR.format(name="mine"))
    b = _write(tmp_path, "b/my_rl.py", ESTIMATOR.format(name="mine"))
    err = _refused(f"runtime_args.plugins=[{a},{b}]")
    assert err.key == "runtime_args.plugins[1]"
    assert f"(estimate ({b}:5)), which estimate ({a}:5) registered already" in str(err)
    assert "list only one of their modules in runtime_args.plugins" in str(err)


def test_a_module_that_registers_nothing(tmp_path):
    empty = _write(tmp_path, "my_rl_empty.py", "def estimate(rewards):\n    return rewards\n")
    err = _refused(f"runtime_args.plugins=[{empty}]")
    assert err.key == "runtime_args.plugins[0]" and "registers nothing" in str(err)
    assert "register_advantage_estimator" in str(err)


def test_policy_loss_null_follows_use_group_sequence_policy():
    def loss(*overrides):
        cfg, plan = load_run(GRPO, [HF, *overrides])
        return TrainerSpec.from_config(cfg, "policy_trainer", plan).policy_loss

    assert loss() == "vanilla" and loss(f"{PT}.use_group_sequence_policy=true") == "gspo"
    assert loss(f"{PT}.policy_loss=gspo") == "gspo"
    assert loss(f"{PT}.policy_loss=gspo", f"{PT}.use_group_sequence_policy=true") == "gspo"
    err = _refused(f"{PT}.policy_loss=vanilla", f"{PT}.use_group_sequence_policy=true")
    assert err.key == f"{PT}.policy_loss" and "Set one of the two" in str(err)


ALGORITHM = """
    from chatlearn.plugins import register_algorithm
    from chatlearn.runtime.driver.algorithm import ComposedAlgorithm, CriticUpdate, GAEAdvantages, GroupAdvantages
    from chatlearn.runtime.driver.algorithm import PolicyUpdate


    @register_algorithm("grpo_plain")
    def grpo_plain(cfg, plan, calls, steps):
        \"\"\"GRPO's parts under a name of the plugin's own.\"\"\"
        return ComposedAlgorithm("grpo_plain", PolicyUpdate(cfg, plan, calls, steps, GroupAdvantages.column),
                                 GroupAdvantages(cfg, plan))


    @register_algorithm("ppo_mine", needs=("critic",), estimators=("gae",))
    def ppo_mine(cfg, plan, calls, steps):
        \"\"\"PPO's parts under a name of the plugin's own.\"\"\"
        return ComposedAlgorithm("ppo_mine", PolicyUpdate(cfg, plan, calls, steps, GAEAdvantages.column),
                                 GAEAdvantages(cfg), CriticUpdate(cfg, calls, steps))
"""


def test_a_plugged_algorithm_is_chosen_placed_and_built(tmp_path):
    """An algorithm of the user's own (chatlearn.plugins.register_algorithm): the config names it, its
    declaration places the models it needs (a critic), the estimator it takes is checked, the driver builds it
    with its function; a plugged name is offered by did-you-mean and a built-in one is refused."""
    from chatlearn.runtime.driver.algorithm import make_algorithm

    plugin = _write(tmp_path, "my_rl_alg.py", ALGORITHM)
    plugins = f"runtime_args.plugins=[{plugin}]"
    cfg, plan = load_run(GRPO, [HF, plugins, f"{PT}.algorithm=grpo_plain"])
    assert plan.algorithm == "grpo_plain" and not plan.uses_critic
    built = make_algorithm(cfg, plan, calls=None, steps=None)
    assert built.name == "grpo_plain" and built.trained == ("policy_trainer",)
    cfg, plan = load_run(GRPO, [HF, plugins, f"{PT}.algorithm=ppo_mine"])  # its own estimator, gae
    assert cfg.models.policy_trainer.advantage_estimator == "gae" and "critic" in plan.placements
    assert make_algorithm(cfg, plan, calls=None, steps=None).trained == ("critic", "policy_trainer")
    err = _refused(plugins, f"{PT}.algorithm=ppo_mien")
    assert err.key == f"{PT}.algorithm" and "Did you mean 'ppo_mine'" in str(err)
    err = _refused(plugins, f"{PT}.algorithm=ppo_mine", f"{PT}.advantage_estimator=rloo")
    assert err.key == f"{PT}.advantage_estimator" and "its estimator is gae" in str(err)
    clash = _write(tmp_path, "my_rl_clash.py", ALGORITHM.replace('"grpo_plain"', '"ppo"'))
    err = _refused(f"runtime_args.plugins=[{clash}]")
    assert err.key == "runtime_args.plugins[0]" and "'ppo' is built in" in str(err), str(err)
