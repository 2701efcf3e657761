"""The registries of chatlearn/config/registry.py: the names the config accepts, declared once;
implementations attach from the layers above."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
from conftest import REPO

from chatlearn.config import registry
from chatlearn.config.registry import Registry


def test_register_get_and_the_errors():
    reg = Registry("colour", ("red", "green"), declared_as="COLOURS", implemented_in="some.module")
    assert reg.names == ("red", "green") and "red" in reg and "blue" not in reg and list(reg) == ["red", "green"]

    @reg.register("red")
    def red():
        return "r"

    assert reg.get("red") is red and reg.implemented() == ("red",)
    with pytest.raises(ValueError, match=r"unknown colour 'gren'; one of \('red', 'green'\)\. Did you mean 'green'\?"):
        reg.get("gren")
    with pytest.raises(LookupError, match="'green' is declared .* no implementation registered: import some.module"):
        reg.get("green")
    # an undeclared name fails when the registering module is imported, saying where to declare it
    with pytest.raises(ValueError, match=r"cannot register colour 'blue': it is not declared\. Add it to COLOURS in "
                                         r"chatlearn/config/registry\.py"):
        reg.register("blue")
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("red")(lambda: "other")
    assert reg.register("red")(red) is red  # the same object again (a module reloaded) is fine


def test_plug_adds_names_and_names_both_definitions_of_a_clash():
    reg = Registry("colour", ("red",), declared_as="COLOURS", implemented_in="some.module", pluggable=True)

    def blue():
        return "b"

    assert reg.plug("blue")(blue) is blue
    assert reg.names == ("red", "blue") and reg.declared == ("red",) and "blue" in reg and reg.get("blue") is blue
    assert list(reg.plugged()) == ["blue"] and "test_registry.py" in reg.plugged()["blue"]
    assert reg.plug("blue")(blue) is blue  # the same definition again (a module imported twice) is fine
    with pytest.raises(ValueError, match=r"unknown colour 'bleu'.*Did you mean 'blue'\?"):
        reg.get("bleu")

    def other():
        return "o"

    with pytest.raises(registry.NameClash) as clash:
        reg.plug("blue")(other)
    assert clash.value.first.startswith("test_plug_adds_names_and_names_both_definitions_of_a_clash.<locals>.blue (")
    assert clash.value.second.startswith("test_plug_adds_names_and_names_both_definitions_of_a_clash.<locals>.other (")
    assert "is registered twice: by" in str(clash.value) and reg.get("blue") is blue
    with pytest.raises(registry.NameClash, match=r"colour 'red' is built in \(chatlearn's some.module\), and "):
        reg.plug("red")(other)
    with pytest.raises(ValueError, match="a plugin cannot add one"):
        Registry("backend", ("a",), declared_as="X").plug("b")


def test_the_pluggable_registries():
    assert registry.pluggable() == (registry.ADVANTAGE_ESTIMATORS, registry.KL_ESTIMATORS, registry.POLICY_LOSSES,
                                    registry.ALGORITHMS)


def test_declared_with_implementations():
    reg = Registry("backend", {"a": "pkg.mod:A"}, declared_as="X")
    assert reg.names == ("a",) and reg.get("a") == "pkg.mod:A"


def test_every_declared_algorithm_name_is_implemented_after_importing_the_trainer_modules():
    # in a fresh interpreter: the loss module (it imports the advantages and the KL estimators) and the schedule
    # register everything
    code = ("import chatlearn.algorithms.grpo, chatlearn.algorithms.lr_schedule\n"
            "from chatlearn.config import registry\n"
            "for reg in registry.ALGORITHM_PARTS:\n"
            "    missing = [n for n in reg.names if n not in reg.implemented()]\n"
            "    assert not missing, (reg.kind, missing)\n"
            "    assert all(callable(reg.get(n)) for n in reg.names)\n"
            "print('ok', sum(len(r) for r in registry.ALGORITHM_PARTS))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", str(5 + 4 + 2 + 4 + 3)]


ADVANTAGE_ESTIMATORS_GROUP = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus")


def test_the_algorithm_modules_keep_their_name_tuples():
    from chatlearn.algorithms import advantages, grpo, kl, lr_schedule

    assert advantages.ADVANTAGE_ESTIMATORS == ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae")
    assert advantages.GROUP_ESTIMATORS == ADVANTAGE_ESTIMATORS_GROUP
    assert kl.KL_ESTIMATORS == ("k1", "k2", "k3", "low_var_kl")
    assert grpo.POLICY_LOSSES == ("vanilla", "gspo")
    assert grpo.LOSS_AGG_MODES == ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                   "seq-mean-token-sum-norm")
    assert lr_schedule.LR_DECAY_STYLES == ("constant", "linear", "cosine")


def test_backends_and_builtin_rewards_name_real_objects():
    from chatlearn.config.schema import ROLLOUT_BACKENDS, TRAIN_BACKENDS

    assert TRAIN_BACKENDS == registry.TRAIN_BACKENDS.names == ("fsdp", "megatron")
    assert ROLLOUT_BACKENDS == registry.ROLLOUT_BACKENDS.names == ("vllm", "sglang", "hf")
    factories = registry.backend_factories()
    assert set(factories) == {"fsdp", "megatron", "vllm", "sglang", "hf", "reward", "reward_model", "judge"}
    targets = list(factories.values()) + [registry.BUILTIN_REWARDS.get(n) for n in registry.BUILTIN_REWARDS]
    for target in targets:  # the backends import their engines lazily: importable without them
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), target
