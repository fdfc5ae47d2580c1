"""Tools for tests/test_tools.py, loaded as `tests/data/tools_example.py:<function>`: one that works, one that
raises, one that sleeps, one that returns a number, and ones transformers cannot describe."""

from __future__ import annotations

import time

NOT_A_FUNCTION = 3


def add(a: int, b: int, note: str | None = None) -> str:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
        note: Text to put after the sum.
    """
    return f"{a + b}" if note is None else f"{a + b} {note}"


def boom(x: int) -> str:
    """Raise a ValueError.

    Args:
        x: Any integer.
    """
    raise ValueError(f"boom {x}\nsecond line")


def sleepy(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def number(x: int) -> int:
    """Return an integer instead of a string.

    Args:
        x: The integer returned.
    """
    return x


def shout(text: str) -> str:
    """Repeat the text in capitals.

    Args:
        text: What to repeat.
    """
    return text.upper()


def undocumented(x: int) -> str:
    return str(x)


def untyped(x) -> str:
    """A parameter without a type hint.

    Args:
        x: Anything.
    """
    return str(x)


def whereami(x: int) -> str:
    """Say which rank ran the call, and leave a file saying so in the folder $TOOL_MARKS.

    Args:
        x: Any integer.
    """
    import os

    rank = os.environ.get("RANK", "0")
    with open(os.path.join(os.environ["TOOL_MARKS"], f"rank_{rank}"), "a") as f:
        f.write(f"{x}\n")
    return f"ran on rank {rank}"
