"""docs/troubleshooting.md answers every refusal the code gives a user.

The messages are read from the source with `ast`, over whole packages (modules come and go as the
code is refactored): every call to a helper that carries a message to a user — the verifier's gRPC
statuses (RequestError, _bad, Refused, context.abort, ...), the OpenAI endpoint's HTTP errors
(APIError), the edge's option refusals (OptionError, OptionConflict) and its own refusals
(EdgeError), the checks of the wire's fields whose words the verifier sends on (QError, TreeError,
SamplingError), and the start-up refusals of the commands (SystemExit) — and every `self.message = ...`
of an exception class. A message's stable fragment is the longest constant part of it (an f-string's
text between the placeholders); the page must contain it. A message built wholly at run time
(`str(e)`) has no fragment: the message it passes on is caught where that one is raised.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, NamedTuple

from safe_ast import parse

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "troubleshooting.md"
PACKAGES = ("spec_core", "cloud_verifier", "edge_client", "hybridspec", "llama_runtime", "netsim", "scripts")

# Callee name -> the position of its message argument (keyword: one of MESSAGE_KEYWORDS).
MESSAGE_ARGS = {
    # the verifier's gRPC statuses (status details)
    "RequestError": 1, "_bad": 0, "bad": 0, "Refused": 0, "abort": 1, "_refusing": 2, "_stream_error": 1,
    # the OpenAI endpoint's HTTP errors
    "APIError": 1, "unsupported": 1,
    # the edge: option values and conflicts refused before the first round, and its own refusals
    "OptionError": 1, "OptionConflict": 2, "EdgeError": 1, "bad_reply": 0,
    # the commands' start-up refusals (one line, exit status 1 or 2), and what they pass on: a model
    # file missing or unloadable, plain text off loopback, a bad token file, a port not bound
    "SystemExit": 0, "ModelMissing": 0, "ModelUnloadable": 0, "FileNotFoundError": 0, "InsecureBindError": 0,
    "TokenFileError": 0, "NoChatTemplate": 0, "OSError": 0,
    # the backend's words inside a RESOURCE_EXHAUSTED or NOT_FOUND (a full KV cache, parked cells lost)
    "NoFreeState": 0, "StateLost": 0,
    # the checks of the wire's q payload, trees and sampling settings, whose words the verifier sends
    # on as INVALID_ARGUMENT (and the OpenAI endpoint as a 400)
    "QError": 0, "TreeError": 0, "SamplingError": 1,
    # set-up's own steps (scripts/llama_build.py)
    "SetupError": 0,
}
MESSAGE_KEYWORDS = ("message", "problem", "why")
MIN_FRAGMENT = 10   # shorter constant parts ("sampling.", ": ") say nothing a reader could search for


class Message(NamedTuple):
    where: str          # file:line
    helper: str         # the callee, or "self.message"
    fragment: str       # the longest constant part


def _pieces(node: ast.AST) -> list[list[str]] | None:
    """The constant text of a message expression as alternatives (an `a if c else b` has two),
    each a list of the parts between run-time values; None when it is not built from strings."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [[node.value]]
    if isinstance(node, ast.JoinedStr):
        parts, text = [], ""
        for v in node.values:
            if isinstance(v, ast.Constant):
                text += v.value
            else:
                parts.append(text)
                text = ""
        return [parts + [text]]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _pieces(node.left), _pieces(node.right)
        if left is None or right is None:
            return left or right
        # the join of two constant ends is one piece of text
        return [a[:-1] + [a[-1] + b[0]] + b[1:] for a in left for b in right]
    if isinstance(node, ast.IfExp):
        body, orelse = _pieces(node.body), _pieces(node.orelse)
        return (body or []) + (orelse or []) or None
    return None


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _message_arg(call: ast.Call, position: int) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg in MESSAGE_KEYWORDS:
            return kw.value
    return call.args[position] if len(call.args) > position else None


def messages_in(source: str, where: str) -> Iterator[Message]:
    """The messages `source` gives users, with their stable fragments."""
    for node in ast.walk(parse(source)):
        arg, helper = None, ""
        if isinstance(node, ast.Call) and _callee(node) in MESSAGE_ARGS:
            helper = _callee(node)
            arg = _message_arg(node, MESSAGE_ARGS[helper])
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "message"
                                                  and isinstance(t.value, ast.Name) and t.value.id == "self"
                                                  for t in node.targets):
            helper, arg = "self.message", node.value
        if arg is None:
            continue
        for alternative in _pieces(arg) or []:
            # a bare word ("cloud-verifier" of f"cloud-verifier: {e}") is a prefix, not the message
            lines = [line.strip(" :;,.()") for p in alternative for line in p.split("\n")]
            fragment = max((line for line in lines if " " in line), key=len, default="")
            if len(fragment) >= MIN_FRAGMENT:
                yield Message(f"{where}:{node.lineno}", helper, fragment)


def all_messages() -> list[Message]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" in path.name:   # generated protobuf code
                continue
            if path.parent.name == "testing":   # hybridspec.testing: harnesses' injected faults, not shown to users
                continue
            out += messages_in(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "scripts").glob("*.sh")):
        out += shell_messages_in(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    return out


# Set-up's shell refusals: `fail "WHAT" "WHAT TO DO"` (scripts/*.sh); $VAR and $(...) are the run-time parts.
SHELL_FAIL = re.compile(r'\bfail "((?:[^"$]|\$\w+|\$\{\w+\})*)"')
SHELL_VALUE = re.compile(r"\$\w+|\$\{\w+\}")


def shell_messages_in(source: str, where: str) -> Iterator[Message]:
    for m in SHELL_FAIL.finditer(source):
        pieces = [p.strip(" :;,.()") for p in SHELL_VALUE.split(m.group(1))]
        fragment = max((p for p in pieces if " " in p), key=len, default="")
        if len(fragment) >= MIN_FRAGMENT:
            yield Message(f"{where}:{source[:m.start()].count(chr(10)) + 1}", "fail", fragment)


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def missing_from(page: str, messages: list[Message]) -> list[Message]:
    text = normalise(page)
    return [m for m in messages if normalise(m.fragment) not in text]


def test_every_refusal_message_is_on_the_troubleshooting_page():
    messages = all_messages()
    helpers = {m.helper for m in messages}
    # The extraction finds each kind of refusal (a rename of a helper must not empty the check).
    assert {"RequestError", "bad", "Refused", "APIError", "OptionConflict", "EdgeError", "SystemExit",
            "self.message", "_refusing", "QError", "SetupError", "fail"} <= helpers, helpers
    assert len(messages) > 80, len(messages)
    missing = missing_from(PAGE.read_text(encoding="utf-8"), messages)
    assert not missing, "not on docs/troubleshooting.md:\n" + "\n".join(
        f"  {m.where} ({m.helper}): {m.fragment!r}" for m in missing)


def test_a_new_message_not_on_the_page_fails():
    """The control: a refusal added to the code without a line on the page is caught."""
    source = '''
def check(n):
    if n > 3:
        raise _bad(f"the frobnication depth {n} exceeds what this verifier allows")
    raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "verifier full of unlisted widgets", retry_after_s=2)
'''
    found = list(messages_in(source, "new.py"))
    assert sorted(m.fragment for m in found) == ["exceeds what this verifier allows", "verifier full of unlisted widgets"]
    assert missing_from(PAGE.read_text(encoding="utf-8"), found) == found   # both reported
    # ... and once the page has them, they pass.
    page = PAGE.read_text(encoding="utf-8") + "\n| `the frobnication depth N exceeds what this verifier allows` |" \
                                                 "\n| `verifier full of unlisted widgets` |"
    assert missing_from(page, found) == []


def test_set_up_failures_are_read_from_the_shell_scripts():
    source = 'x || fail "could not create $VENV" "install the venv module"\nfail "$("$PY" --version) is too old" "y"\n'
    assert [(m.where, m.fragment) for m in shell_messages_in(source, "s.sh")] == [("s.sh:1", "could not create")]


def test_fragments_are_the_constant_text_between_placeholders():
    source = '''
raise _bad("open.sampling is missing")
raise OptionConflict("fuse", "window", "a window sends the next rounds " + "as rounds in flight")
raise APIError(400, f"this model's maximum context length is {n} tokens; the prompt has {m}", param="x")
raise SystemExit("a" if x else f"cloud-verifier: refusing plain text on {host}: give --tls-cert")
'''
    assert sorted(m.fragment for m in messages_in(source, "x.py")) == sorted([
        "open.sampling is missing", "a window sends the next rounds as rounds in flight",
        "this model's maximum context length is", "cloud-verifier: refusing plain text on"])
