"""Built-in verifiable tasks small enough for a tiny model on CPU, each with difficulty knobs.

    AdditionTask(min_digits=1, max_digits=2, num_operands=2)   "37+5="        -> "42"
    MultiplicationTask(min_digits=1, max_digits=2)             "12*7="        -> "84"
    CountdownTask(num_numbers=3, max_number=9)                 "3 5 7->56:"   -> "(3+5)*7" (any correct expression)
    ColumnAdditionTask(min_digits=4, max_digits=5)             "4738+2951="   -> "8+1+0=9,3+5+0=8,7+9+0=16,4+2+1=7;7689"
    ColumnAdditionTask(2, 2, checks=1)                         "38+51="       -> "8+1+0=9,3+5+0=8;89|1+8+0=9,5+3+0=8;89"

Rewards are exact (`moe_gspo.rewards.synthetic`): the answer string for arithmetic, and for countdown any
+ - * / expression that uses each given number exactly once and equals the target. Column addition's answer is the
whole worked solution (36 to 121 characters), so its reward is 1.0 only when every column and the sum are right.
"""

from __future__ import annotations

import random
from fractions import Fraction

from moe_gspo.rewards.synthetic import countdown, exact_match
from moe_gspo.tasks.base import Example, Task


def _number(rng: random.Random, min_digits: int, max_digits: int) -> int:
    d = rng.randint(min_digits, max_digits)
    return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)


def _check_digits(name, min_digits, max_digits):
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"{name}: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")


class AdditionTask(Task):
    """Sum of `num_operands` integers with min_digits..max_digits digits each."""

    name = "addition"

    def __init__(self, min_digits: int = 1, max_digits: int = 2, num_operands: int = 2,
                 heldout_fraction: float = 0.1):
        _check_digits(self.name, min_digits, max_digits)
        if num_operands < 2:
            raise ValueError(f"{self.name}: num_operands={num_operands} must be >= 2")
        self.min_digits, self.max_digits, self.num_operands = min_digits, max_digits, num_operands
        self.heldout_fraction = heldout_fraction
        self.reward_fn = exact_match

    def _draw(self, rng):
        xs = [_number(rng, self.min_digits, self.max_digits) for _ in range(self.num_operands)]
        return Example("+".join(map(str, xs)) + "=", str(sum(xs)), {"operands": xs})


class MultiplicationTask(Task):
    """Product of two integers with min_digits..max_digits digits each."""

    name = "multiplication"

    def __init__(self, min_digits: int = 1, max_digits: int = 2, heldout_fraction: float = 0.1):
        _check_digits(self.name, min_digits, max_digits)
        self.min_digits, self.max_digits = min_digits, max_digits
        self.heldout_fraction = heldout_fraction
        self.reward_fn = exact_match

    def _draw(self, rng):
        a, b = _number(rng, self.min_digits, self.max_digits), _number(rng, self.min_digits, self.max_digits)
        return Example(f"{a}*{b}=", str(a * b), {"operands": [a, b]})


class CountdownTask(Task):
    """Reach a target from `num_numbers` numbers in 1..max_number with + - * /, each number used once.

    Targets are built from a random expression over the numbers (so a solution exists; it is the demonstration),
    keeping intermediate values non-negative integers and the target in 1..max_target.
    """

    name = "countdown"

    def __init__(self, num_numbers: int = 3, max_number: int = 9, max_target: int = 100,
                 heldout_fraction: float = 0.1):
        if num_numbers < 2:
            raise ValueError(f"{self.name}: num_numbers={num_numbers} must be >= 2")
        if max_number < 1 or max_target < 1:
            raise ValueError(f"{self.name}: max_number={max_number} and max_target={max_target} must be >= 1")
        self.num_numbers, self.max_number, self.max_target = num_numbers, max_number, max_target
        self.heldout_fraction = heldout_fraction
        self.reward_fn = countdown

    def _combine(self, rng, items):
        """items: list of (expr, value); returns one (expr, value) or None when an op is not integral."""
        items = list(items)
        while len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            (ea, va), (eb, vb) = items[i], items[j]
            op = rng.choice("+-*/")
            if op == "-" and va < vb or op == "/" and (vb == 0 or va % vb):
                return None
            v = {"+": va + vb, "-": va - vb, "*": va * vb, "/": Fraction(va, vb) if op == "/" else 0}[op]
            items = [it for k, it in enumerate(items) if k not in (i, j)] + [(f"({ea}{op}{eb})", int(v))]
        return items[0]

    def _draw(self, rng):
        for _ in range(1000):
            nums = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            out = self._combine(rng, [(str(n), n) for n in nums])
            if out is not None and 1 <= out[1] <= self.max_target:
                expr = out[0][1:-1] if out[0].startswith("(") else out[0]
                prompt = " ".join(map(str, nums)) + f"->{out[1]}:"
                return Example(prompt, str(out[1]), {"numbers": nums, "target": out[1]}, demonstration=expr)
        raise RuntimeError(f"{self.name}: no reachable target found; loosen max_target={self.max_target}")


class ColumnAdditionTask(Task):
    """Addition of two d-digit numbers written out column by column, right to left: a long-response task.

    Each column is written `a+b+c=s` (the two digits, the carry in, their sum 0..19), columns are separated by
    commas, then `;` and the sum: "4738+2951=" -> "8+1+0=9,3+5+0=8,7+9+0=16,4+2+1=7;7689". The format leaves one
    way to write a correct solution, so the gold answer is that whole text and the reward is exact match (no
    partial credit): a right sum after wrong work, or the sum alone, scores 0, and responses cannot get shorter
    than the work. A solution of d digits is 9d to 10d+1 characters (one token each with the character tokenizer);
    d is drawn uniformly from min_digits..max_digits: 9..11 characters at d = 1, 36..41 at d = 4, 108..121 at
    d = 12. The digits knob changes length and difficulty together.

    `checks` changes the length alone: after the solution the response writes `checks` checks, each `|` and the
    worked solution with the operands swapped (b + a: the same columns, the same sums, the same answer). The
    problem, and so its difficulty, is the same at every value: (checks + 1) (9d..10d+1) + checks characters, e.g.
    at d = 2: 18..21 with no check, 56..65 with 2, 151..175 with 7.
    """

    name = "column_addition"
    MIN_DIGITS, MAX_DIGITS = 1, 12
    MAX_CHECKS = 15

    def __init__(self, min_digits: int = 4, max_digits: int = 5, heldout_fraction: float = 0.1, checks: int = 0):
        _check_digits(self.name, min_digits, max_digits)
        if not self.MIN_DIGITS <= min_digits <= max_digits <= self.MAX_DIGITS:
            raise ValueError(f"{self.name}: min_digits={min_digits}, max_digits={max_digits} must lie in "
                             f"{self.MIN_DIGITS}..{self.MAX_DIGITS} (solutions of 9..121 characters)")
        if not (isinstance(checks, int) and 0 <= checks <= self.MAX_CHECKS):
            raise ValueError(f"{self.name}: checks={checks!r} must be an int in 0..{self.MAX_CHECKS}")
        self.min_digits, self.max_digits, self.checks = min_digits, max_digits, checks
        self.heldout_fraction = heldout_fraction
        self.reward_fn = exact_match

    @staticmethod
    def solution(a: int, b: int) -> str:
        """The worked solution of a + b for two numbers of the same number of digits."""
        da, db = str(a)[::-1], str(b)[::-1]  # least significant digit first
        steps, carry = [], 0
        for x, y in zip(da, db):
            s = int(x) + int(y) + carry
            steps.append(f"{x}+{y}+{carry}={s}")
            carry = s // 10
        return ",".join(steps) + f";{a + b}"

    def _draw(self, rng):
        d = rng.randint(self.min_digits, self.max_digits)
        a, b = (rng.randint(10 ** (d - 1), 10**d - 1) for _ in range(2))
        answer = "|".join([self.solution(a, b)] + [self.solution(b, a)] * self.checks)
        return Example(f"{a}+{b}=", answer, {"operands": [a, b], "sum": a + b, "digits": d, "checks": self.checks})
