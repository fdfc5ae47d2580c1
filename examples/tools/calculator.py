"""Tools for rollout.tools: a calculator a math task can give the policy.

    rollout:
      tools: [examples/tools/calculator.py:calculate, examples/tools/calculator.py:add]
      max_turns: 3
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    raise ValueError("only numbers, + - * / and parentheses")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers combined with +, -, *, / and parentheses, e.g. "(12 + 30) / 7".
    """
    v = _value(ast.parse(expression, mode="eval").body)
    return str(v.numerator) if v.denominator == 1 else f"{float(v):.6g}"


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return str(a + b)
