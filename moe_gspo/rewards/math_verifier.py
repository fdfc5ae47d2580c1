"""Math answers in LaTeX / boxed form, verified with Hugging Face `math-verify` (symbolic equivalence).

    math_verify_reward("so the answer is \\\\boxed{\\\\frac12}", example)   # example.answer == "0.5" -> 1.0

The gold answer (`example.answer`) is parsed as LaTeX (wrapped in $...$ unless it already has delimiters or a
\\boxed), then as a plain expression. A gold answer that cannot be parsed at all is a data error and raises
(the scorer reports it for that sample); a response with no parseable answer scores 0.0.
"""

from __future__ import annotations

from functools import lru_cache


def _mv():
    try:
        import math_verify
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ImportError("the math verifier needs `math-verify` (pip install 'math-verify[antlr4_13_2]')") from e
    return math_verify


@lru_cache(maxsize=4096)
def parse_gold(answer: str):
    """Parsed gold answer (a tuple of math-verify candidates); raises ValueError when nothing parses."""
    mv = _mv()
    answer = str(answer).strip()
    forms = [answer] if ("$" in answer or "\\boxed" in answer) else [f"${answer}$", answer]
    for form in forms:
        parsed = mv.parse(form)
        if any(not isinstance(x, str) for x in parsed):  # a bare string is math-verify's unparsed fallback
            return tuple(parsed)
    raise ValueError(f"gold answer {answer!r} cannot be parsed by math-verify")


def math_verify_reward(response: str, example) -> float:
    """1.0 when the response's final answer is mathematically equivalent to the gold answer, else 0.0."""
    mv = _mv()
    gold = list(parse_gold(str(example.answer)))
    pred = mv.parse(response)
    if not pred:
        return 0.0
    return 1.0 if mv.verify(gold, pred) else 0.0
