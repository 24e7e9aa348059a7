"""Reading a command line that was recorded (a load run's verifier arguments), not parsing our own."""
from __future__ import annotations

from typing import Sequence


def option_value(args: Sequence[str], name: str) -> str | None:
    """The value of option `name` in a command line (`--name V` or `--name=V`; the last one wins)."""
    args = [str(a) for a in args]
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value
