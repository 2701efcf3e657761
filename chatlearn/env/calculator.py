"""``builtin:calculator``: exact arithmetic for tool-use rollouts (the multi-turn demo's tool)."""
from __future__ import annotations

import ast
import operator
from fractions import Fraction

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPONENT = 64
MAX_DIGITS = 100
MAX_LENGTH = 200


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: numbers, + - * / // % ** and parentheses, e.g. "(12 + 3) * 4"
    """
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    value = _eval(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return repr(float(value)) if abs(value) < 10 ** MAX_DIGITS else str(value)


def _eval(node) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
            raise ValueError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        out = OPERATORS[type(node.op)](left, right)
        out = Fraction(out)
        if abs(out.numerator) >= 10 ** MAX_DIGITS:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return out
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")
