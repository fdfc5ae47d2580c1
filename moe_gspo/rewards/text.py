"""Rewards that read a final answer out of free text by a fixed convention: GSM8K's `#### 72`, LaTeX's `\\boxed{..}`,
the last number.

    gsm8k_reward("... so she has 72 apples.\\n#### 72", example)     # example.answer == "72" -> 1.0
    boxed_reward("... hence $\\\\boxed{\\\\frac{1}{2}}$.", example)   # example.answer == "\\\\frac{1}{2}" -> 1.0

Each compares one extracted answer with `example.answer`: 1.0 when they agree, 0.0 otherwise, including a response
that holds no answer in the expected form. Unlike the `math` reward they check no symbolic equivalence: `1/2` and
`0.5` differ, while numbers written differently (`1,234` and `1234`, `0.50` and `0.5`) agree.
"""

from __future__ import annotations

import re
from fractions import Fraction

# `####`, optional `$`, then a number with optional thousands commas and decimals; a trailing `.` is not taken
_GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(-?\s*\$?\s*\d[\d,]*(?:\.\d+)?)")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")


def _as_number(text: str) -> Fraction | None:
    """Exact value of a plain decimal number (`-3`, `0.50`, `1,234.5`), or None for anything else."""
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    return Fraction(text)


def gsm8k_answer(response: str) -> Fraction | None:
    """The number after the last `####` followed by one (commas and `$` dropped), or None when there is none."""
    found = _GSM8K_ANSWER.findall(response)
    if not found:
        return None
    return _as_number(re.sub(r"[\s$,]", "", found[-1]))


def gsm8k_reward(response: str, example) -> float:
    """1.0 when the number after the response's last `####` equals example.answer numerically, else 0.0.

    A response without `####` scores 0.0 (no answer is read from elsewhere in the text). A gold answer that is
    not a number is a data error and raises (the scorer reports it for that sample)."""
    gold = _as_number(re.sub(r"[\s$,]", "", str(example.answer)).rstrip("."))
    if gold is None:
        raise ValueError(f"gold answer {example.answer!r} is not a number")
    pred = gsm8k_answer(response)
    return 1.0 if pred is not None and pred == gold else 0.0


# a number standing alone: not glued to a letter or another digit's word (`x2`, `3rd` are not read)
_LAST_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w])")


def last_number(response: str) -> Fraction | None:
    """The value of the last number in the response (`-3`, `0.50`, `1,234`), or None when it holds none."""
    found = _LAST_NUMBER.findall(response)
    return _as_number(found[-1].lstrip("+")) if found else None


def last_number_reward(response: str, example) -> float:
    """1.0 when the last number in the response equals example.answer numerically, else 0.0: for short answers
    asked as "answer with just the number", where a model that stops early or talks on past its answer scores 0.
    A gold answer that is not a number raises, as gsm8k_reward's does."""
    gold = _as_number(re.sub(r"[\s$,]", "", str(example.answer)).rstrip("."))
    if gold is None:
        raise ValueError(f"gold answer {example.answer!r} is not a number")
    pred = last_number(response)
    return 1.0 if pred is not None and pred == gold else 0.0


def _braced(text: str, start: int) -> str | None:
    """Content of the brace group opening at text[start] == '{', nested groups included; None if unclosed."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (balanced braces) or `\\boxed x` (one token) in `text`, or None."""
    at = text.rfind("\\boxed")
    if at < 0:
        return None
    rest = at + len("\\boxed")
    if text.startswith("{", rest):
        return _braced(text, rest)
    if text.startswith(" ", rest):  # `\boxed 5`: the token up to the next space or `$`
        token = re.match(r"\s*([^\s$]+)", text[rest:])
        return token.group(1) if token else None
    return None  # `\boxeds`, or `\boxed` at the very end


_LATEX_NOISE = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |\$|\s")


def normalize_answer(answer: str) -> str:
    """`answer` without spaces, `$`, `\\left`/`\\right`, LaTeX spacing or a trailing `.`; `\\dfrac` is `\\frac`."""
    answer = _LATEX_NOISE.sub("", answer)
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return answer.rstrip(".")


def boxed_reward(response: str, example) -> float:
    """1.0 when the response's last `\\boxed{}` equals example.answer after normalize_answer (or numerically, when
    both are plain numbers), else 0.0. A gold answer that is itself boxed is compared by its box's content; an
    empty gold answer is a data error and raises."""
    pred = last_boxed(response)
    if pred is None:
        return 0.0
    gold = str(example.answer)
    gold = last_boxed(gold) if "\\boxed" in gold else gold
    pred, gold = normalize_answer(pred), normalize_answer(gold or "")
    if not gold:
        raise ValueError(f"gold answer {example.answer!r} is empty once normalized")
    if pred == gold:
        return 1.0
    pred_value, gold_value = _as_number(pred), _as_number(gold)
    return 1.0 if pred_value is not None and pred_value == gold_value else 0.0


def overlong_penalty(lengths, max_new_tokens: int, buffer: int, factor: float = 1.0):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 for a response of at most max_new_tokens - buffer
    tokens, then falling linearly to -factor at max_new_tokens. `lengths` is a float tensor of response lengths."""
    import torch

    if buffer <= 0:
        return torch.zeros_like(lengths)
    start = max_new_tokens - buffer
    return torch.clamp(-(lengths - start) / buffer * factor, max=0.0)
