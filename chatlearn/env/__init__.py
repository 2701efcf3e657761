"""Environments and tools for multi-turn rollouts (``models.policy.multi_turn``); see
:mod:`chatlearn.env.base` for the interface and docs/multiturn.md for a guide."""
from chatlearn.env.base import Environment, StepResult  # noqa: F401
from chatlearn.env.tools import Tool, ToolCall, ToolCallError, ToolEnvironment, parse_hermes  # noqa: F401
