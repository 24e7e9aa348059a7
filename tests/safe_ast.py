"""ast.parse for tests that read the repository's sources, shielded from a CPython 3.11 bug.

CPython before 3.11.8 / 3.12.1 can raise a spurious `SystemError: AST constructor recursion depth
mismatch` from ast.parse (python/cpython#106905): the depth it checks is kept in the ast module's
state, which another thread's parse, an earlier failed conversion or code run in between (a
collection's finalizers) can move, late in a long test session full of threads. The source is fine;
the parse is repeated, with the collector paused.
"""
from __future__ import annotations

import ast
import gc


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    for attempt in range(3):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return ast.parse(source, filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 2:
                raise
        finally:
            if enabled:
                gc.enable()
    raise AssertionError("unreachable")
