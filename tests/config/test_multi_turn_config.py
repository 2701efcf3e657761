"""models.policy.multi_turn: every mistake is refused when the config is loaded, naming the key."""
from __future__ import annotations

import pytest

from chatlearn.config.load import load_run
from chatlearn.errors import ConfigError

TEMPLATE = "template/grpo_fsdp.yaml"
MT = "models.policy.multi_turn"
SCRIPTED = [f"{MT}.environment=multiturn_envs:ScriptedEnv", f"{MT}.environment_kwargs={{script: {{}}}}"]
TOOLS = [f"{MT}.environment=builtin:tools", f"{MT}.tools=[{{name: calculator, path: 'builtin:calculator'}}]"]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)


def refused(overrides: list[str], paths_overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_run(TEMPLATE, paths_overrides + overrides)
    return info.value


def test_a_valid_multi_turn_config_loads_and_the_plan_says_so(paths_overrides):
    cfg, plan = load_run(TEMPLATE, paths_overrides + TOOLS + [f"{MT}.max_turns=3", f"{MT}.max_turn_tokens=8"])
    assert cfg.models.policy.multi_turn.max_turns == 3
    assert ("rollouts: multi-turn, environment builtin:tools (tools: calculator; parser hermes): up to 3 model turns "
            "of at most 8 tokens, 16 tokens after the prompt in all") in "\n".join(plan.describe())
    _, plan = load_run(TEMPLATE, paths_overrides + SCRIPTED)
    assert "environment multiturn_envs:ScriptedEnv: up to 4 model turns" in "\n".join(plan.describe())
    _, plain = load_run(TEMPLATE, paths_overrides)
    assert plain.multi_turn is None and not any("multi-turn" in line for line in plain.describe())


@pytest.mark.parametrize("overrides, key, message", [
    ([f"{MT}.max_turns=2"], f"{MT}.max_turns", "environment is null"),
    ([f"{MT}.tools=[{{name: c, path: 'builtin:calculator'}}]"], f"{MT}.tools", "would have no effect"),
    ([f"{MT}.environment=no_such_module:Env"], f"{MT}.environment", "cannot import module 'no_such_module'"),
    ([f"{MT}.environment=missing/env.py:Env"], f"{MT}.environment", "missing/env.py' does not exist (cwd: "),
    ([f"{MT}.environment=multiturn_envs:Nope"], f"{MT}.environment", "has no class 'Nope' (it defines: "),
    ([f"{MT}.environment=multiturn_envs:RECORD"], f"{MT}.environment", "is a list, not a class"),
    ([f"{MT}.environment=builtins:object"], f"{MT}.environment", "has no method reset()"),
    ([f"{MT}.environment=builtin:nope"], f"{MT}.environment", "is not a built-in one; the built-ins are builtin:tools"),
    ([f"{MT}.environment=multiturn_envs:ScriptedEnv"], f"{MT}.environment_kwargs",
     "cannot be built with the keyword arguments (none): TypeError: missing a required argument: 'script'"),
    (SCRIPTED + [f"{MT}.environment_kwargs.colour=1"], f"{MT}.environment_kwargs", "unexpected keyword argument"),
    (SCRIPTED + [f"{MT}.tools=[{{name: c, path: 'builtin:calculator'}}]"], f"{MT}.tools", "does not use tools"),
    ([f"{MT}.environment=builtin:tools"], f"{MT}.tools", "calls tools, and none is given"),
    (TOOLS + [f"{MT}.tools=[{{name: c, path: 'builtin:calculator'}}, {{name: c, path: 'builtin:calculator'}}]"],
     f"{MT}.tools[1].name", "names two tools"),
    (TOOLS + [f"{MT}.tools=[{{name: 'a b', path: 'builtin:calculator'}}]"], f"{MT}.tools[0].name", "not a tool name"),
    (TOOLS + [f"{MT}.tools=[{{name: c, path: 'builtin:nope'}}]"], f"{MT}.tools[0].path",
     "the built-ins are builtin:calculator"),
    (TOOLS + [f"{MT}.tools=[{{name: c, path: 'builtin:calculator', parameters: {{type: string}}}}]"],
     f"{MT}.tools[0].parameters", "JSON schema of an object"),
    (TOOLS + [f"{MT}.tools=[{{name: c, path: 'builtin:calculator', parameters: {{type: object, properties: 3}}}}]"],
     f"{MT}.tools[0].parameters", "is not a valid JSON schema"),
    (TOOLS + [f"{MT}.tools=[{{name: c, path: 'builtin:calculator', parameters: {{type: object, properties: "
              "{x: {type: string}}}}]"], f"{MT}.tools[0].path", "cannot take the arguments of its schema (x)"),
    (TOOLS + [f"{MT}.tools=[{{name: c, path: 'builtin:calculator', kwargs: {{y: 1}}}}]"], f"{MT}.tools[0].path",
     "and its kwargs (y)"),
    (TOOLS + [f"{MT}.tool_parser=nowhere:parse"], f"{MT}.tool_parser", "cannot import module 'nowhere'"),
    (SCRIPTED + [f"{MT}.max_turns=0"], f"{MT}.max_turns", "at least 1"),
    (SCRIPTED + [f"{MT}.num_workers=0"], f"{MT}.num_workers", "at least 1"),
    (SCRIPTED + [f"{MT}.max_observation_tokens=0"], f"{MT}.max_observation_tokens", "at least 1"),
    (SCRIPTED + [f"{MT}.max_turn_tokens=17"], f"{MT}.max_turn_tokens", "max_response_tokens_length (16)"),
    (SCRIPTED + [f"{MT}.step_timeout_s=0"], f"{MT}.step_timeout_s", "> 0"),
    (SCRIPTED + [f"{MT}.reward_discount=1.5"], f"{MT}.reward_discount", "(0, 1]"),
    (SCRIPTED + [f"{MT}.observation_role=' '"], f"{MT}.observation_role", "is empty"),
])
def test_mistakes_are_refused_naming_the_key(paths_overrides, overrides, key, message):
    err = refused(overrides, paths_overrides)
    assert err.key == key, str(err)
    assert message in str(err), str(err)


def test_with_an_environment_the_reward_functions_are_explicit(paths_overrides):
    """Without functions a multi-turn run is rewarded by its environment alone (no builtin:math)."""
    from chatlearn.models.specs import RewardSpec

    cfg, _ = load_run(TEMPLATE, paths_overrides + SCRIPTED)
    assert RewardSpec.from_config(cfg).functions == ()
    cfg, _ = load_run(TEMPLATE, paths_overrides)
    assert [f["path"] for f in RewardSpec.from_config(cfg).functions] == ["builtin:math"]


def test_the_multi_turn_template_is_valid():
    cfg, plan = load_run("template/grpo_multiturn.yaml", [])
    assert cfg.models.policy.multi_turn.environment == "builtin:tools"
    assert plan.multi_turn is not None
