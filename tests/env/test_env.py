"""The environment interface, the built-in tool environment, its Hermes parser and the calculator."""
from __future__ import annotations

import json
import math

import pytest

from chatlearn.config.env_entries import function_schema
from chatlearn.env import Environment, Tool, ToolCall, ToolCallError, ToolEnvironment, parse_hermes
from chatlearn.env.base import BadEnvironmentOutput, as_messages, as_step_result
from chatlearn.env.calculator import calculator


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# ------------------------------------------------------------------------------ parser
def test_hermes_reads_every_call_in_order():
    text = "I will compute. " + call("calculator", expression="1+2") + " and " + call("lookup", key="x", n=3)
    assert parse_hermes(text) == [ToolCall("calculator", {"expression": "1+2"}), ToolCall("lookup", {"key": "x", "n": 3})]
    assert parse_hermes("The answer is \\boxed{3}.") == []
    # arguments given as a JSON string (some models write them so)
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_hermes(text) == [ToolCall("f", {"a": 1})]


@pytest.mark.parametrize("text, message", [
    ("<tool_call>{not json}</tool_call>", "is not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'is not {"name"'),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', 'is not {"name"'),
    ('<tool_call>["f"]</tool_call>', 'is not {"name"'),
    ('<tool_call>{"name": "f", "arguments": {}}', "not closed"),
])
def test_hermes_names_what_is_malformed(text, message):
    with pytest.raises(ToolCallError, match=message.replace("{", r"\{").replace("[", r"\[")):
        parse_hermes(text)


# ------------------------------------------------------------------------------ tools
def test_a_tool_checks_its_arguments_against_the_schema_and_reports_errors_as_text():
    tool = Tool("calculator", calculator, *function_schema(calculator))
    assert tool({"expression": "12 * 3"}) == "36"
    assert tool({}).startswith("error: invalid arguments for calculator: 'expression' is a required property")
    assert tool({"expression": 5}).startswith("error: invalid arguments for calculator (expression): 5 is not of type")
    assert tool({"expression": "1/0"}) == "error: ValueError: division by zero"
    listing = Tool("listing", lambda n: list(range(n)), "list", {"type": "object", "properties": {"n": {"type": "integer"}}})
    assert listing({"n": 3}) == "[0, 1, 2]"  # not a string: JSON
    assert tool.schema() == {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression exactly and return the result.",
        "parameters": {"type": "object", "required": ["expression"], "properties": {"expression": {
            "type": "string", "description": 'numbers, + - * / // % ** and parentheses, e.g. "(12 + 3) * 4"'}}}}}


def test_function_schema_from_signature_and_docstring():
    def f(city: str, days: int, metric: bool = True, extra=None, *, api_key: str = ""):
        """Weather forecast.

        More text.

        Args:
            city: the city's name
            days (int): how many days ahead
        """
    description, params = function_schema(f, skip=("api_key",))
    assert description == "Weather forecast."
    assert params == {"type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "days": {"type": "integer", "description": "how many days ahead"},
        "metric": {"type": "boolean"}, "extra": {}}}


def env_with(max_calls: int = 2, parser=parse_hermes) -> ToolEnvironment:
    tools = [Tool("calculator", calculator, *function_schema(calculator))]
    env = ToolEnvironment(tools, parser, max_calls)
    assert env.reset({"prompt": [], "ground_truth": "3"}) is None
    return env


def test_tool_environment_runs_calls_and_ends_on_a_final_answer():
    env = env_with()
    obs, reward, done, info = env.step(call("calculator", expression="347 * 58"))
    assert obs == [{"role": "tool", "name": "calculator", "content": "20126"}]
    assert (reward, done, info) == (0.0, False, {"tool_calls": 1.0, "tool_errors": 0.0, "tool_parse_errors": 0.0})
    assert env.step("\\boxed{20126}") == (None, 0.0, True,
                                           {"tool_calls": 0.0, "tool_errors": 0.0, "tool_parse_errors": 0.0})


def test_tool_environment_answers_mistakes_with_errors_not_exceptions():
    env = env_with(max_calls=2)
    obs, _, done, info = env.step(call("calculator", expression="1") + call("nope") + call("calculator", expression="2"))
    assert not done and info["tool_calls"] == 3 and info["tool_errors"] == 2
    assert [m["content"] for m in obs] == ["1", "error: unknown tool 'nope'; the tools are calculator",
                                           "error: more than 2 tool calls in one turn; this one was not run"]
    obs, _, done, info = env.step("<tool_call>{oops</tool_call>")
    assert not done and info["tool_parse_errors"] == 1
    assert obs[0]["role"] == "tool" and obs[0]["content"].startswith("error: the tool call '{oops' is not JSON")


def test_a_subclass_rewards_the_final_answer():
    class Graded(ToolEnvironment):
        def final_reward(self, action):
            return 1.0 if self.row["ground_truth"] in action else 0.0

    env = Graded([Tool("calculator", calculator, *function_schema(calculator))], parse_hermes, 1)
    env.reset({"ground_truth": "7"})
    assert env.step("it is 7")[1:3] == (1.0, True)


# ------------------------------------------------------------------------------ calculator
@pytest.mark.parametrize("expression, result", [
    ("347 * 58", "20126"), ("(12 + 3) * 4", "60"), ("7 / 2", "3.5"), ("-2 ** 3", "-8"), ("10 // 3", "3"),
    ("10 % 4", "2"), ("2 ** 10", "1024"), ("1.5 * 2", "3"), ("1 / 3", repr(1 / 3)),
])
def test_calculator_is_exact(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "only numbers"), ("x + 1", "only numbers"), ("2 ** 100", "exponents"),
    ("1 / 0", "division by zero"), ("1 +", "cannot parse"), ("9" * 90 + " * " + "9" * 90, "more than 100 digits"),
    ("1" * 300, "longer than"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


# ------------------------------------------------------------------------------ the interface
def test_observations_become_messages():
    assert as_messages("hi", "user", "x") == [{"role": "user", "content": "hi"}]
    assert as_messages({"role": "tool", "content": "3"}, "user", "x") == [{"role": "tool", "content": "3"}]
    assert as_messages(None, "user", "x") is None
    for bad in (3, [], [{"role": "user"}], {"content": "x"}):
        with pytest.raises(BadEnvironmentOutput, match="it must be a string"):
            as_messages(bad, "user", "the observation")


def test_step_results_are_checked():
    r = as_step_result(("ok", 1, False, {"n": 2}), "user")
    assert (r.observation, r.reward, r.done, r.info) == ([{"role": "user", "content": "ok"}], 1.0, False, {"n": 2.0})
    assert as_step_result((None, 0.5, True, None), "user").info == {}
    for bad, message in [(("x", 0.0, False), "must return a tuple"), (("x", math.nan, False, {}), "finite number"),
                         (("x", "1", False, {}), "finite number"), (("x", 0.0, "no", {}), "True or False"),
                         (("x", 0.0, False, {"a": "b"}), "dict of names"), ((None, 0.0, False, {}), "without done")]:
        with pytest.raises(BadEnvironmentOutput, match=message):
            as_step_result(bad, "user")


def test_the_base_class_needs_a_step():
    env = Environment()
    assert env.reset({}) is None and env.close() is None
    with pytest.raises(NotImplementedError):
        env.step("x")


def test_an_async_tool_is_awaited():
    async def lookup(key: str) -> dict:
        """Look a key up."""
        import asyncio

        await asyncio.sleep(0)
        if key == "bad":
            raise KeyError(key)
        return {"key": key, "value": 1}

    tool = Tool("lookup", lookup, *function_schema(lookup))
    assert json.loads(tool({"key": "x"})) == {"key": "x", "value": 1}
    assert tool({"key": "bad"}) == "error: KeyError: 'bad'"
