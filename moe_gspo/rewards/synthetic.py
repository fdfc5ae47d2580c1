"""Exact rewards for the built-in synthetic tasks (addition, multiplication, countdown).

A reward function is `fn(response: str, example) -> float`: `response` is the decoded response text (special
tokens dropped), `example` anything with `.answer: str` and `.meta: dict` (a `moe_gspo.tasks.Example`).
A wrong or unparseable response scores 0.0; only a bug in the function itself raises (the scorer catches it).
"""

from __future__ import annotations

import ast
from collections import Counter
from fractions import Fraction


def exact_match(response: str, example) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the gold answer exactly."""
    return 1.0 if response.strip() == str(example.answer).strip() else 0.0


_ALLOWED_CHARS = set("0123456789+-*/() ")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def _eval_expr(node, used: list[int]) -> Fraction:
    """Evaluate + - * / over non-negative integer literals exactly; anything else raises ValueError."""
    if isinstance(node, ast.Expression):
        return _eval_expr(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval_expr(node.left, used), _eval_expr(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def countdown_value(expr: str, numbers: list[int]) -> Fraction | None:
    """Exact value of `expr` if it is a + - * / ( ) expression using each of `numbers` exactly once, else None."""
    expr = expr.strip()
    if not expr or not set(expr) <= _ALLOWED_CHARS:
        return None
    try:
        tree = ast.parse(expr, mode="eval")
        used: list[int] = []
        value = _eval_expr(tree, used)
    except (SyntaxError, ValueError, RecursionError):
        return None
    if Counter(used) != Counter(numbers):
        return None
    return value


def countdown(response: str, example) -> float:
    """1.0 when the response is an expression over example.meta['numbers'] (each once) equal to meta['target']."""
    value = countdown_value(response, list(example.meta["numbers"]))
    return 1.0 if value is not None and value == example.meta["target"] else 0.0
