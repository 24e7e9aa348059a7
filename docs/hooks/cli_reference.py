"""MkDocs hook: the command-line reference, rendered from the argparse parsers at build time.

Each program's `build_parser()` (which registers its options and nothing else: no model, no
socket, no logging) is rendered into one page, docs/reference/PROGRAM.md, that exists only in the
built site. An option added to a parser is therefore on its page the next time the site builds,
and tests/test_docs_reference.py checks that every option is rendered and that the hand-written
pages name no option that does not exist.

mkdocs.yml loads this file (`hooks:`) and lists the pages in its nav under "Reference".
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Iterator, NamedTuple

ROOT = Path(__file__).resolve().parents[2]
USAGE_WIDTH = 100


class Program(NamedTuple):
    name: str        # what the user types
    module: str      # the module whose build_parser() returns its parser
    summary: str     # one line for the page's opening


PROGRAMS = (
    Program("edge-client", "edge_client.cli", "The device's end: draft here, verify on a cloud verifier."),
    Program("cloud-verifier", "cloud_verifier.cli", "The cloud's end: serve a target model to edge clients."),
    Program("netsim", "netsim.cli", "Link emulation, experiments, load tests and the fleet model."),
    Program("hybridspec", "hybridspec.cli", "The demo: both ends and the cloud-only baseline in one command."),
)


class Command(NamedTuple):
    path: str                          # e.g. "edge-client generate"
    parser: argparse.ArgumentParser
    help: str                          # the subcommand's one-line help in its parent ("" at the top)


def build_parser(program: Program) -> argparse.ArgumentParser:
    if str(ROOT) not in sys.path:      # mkdocs run from a checkout without the package installed
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(program.module).build_parser()


def commands(program: Program, parser: argparse.ArgumentParser | None = None) -> list[Command]:
    """The program and each of its subcommands (depth first), with their parsers."""
    return list(_walk(program.name, parser or build_parser(program), ""))


def _walk(path: str, parser: argparse.ArgumentParser, help_text: str) -> Iterator[Command]:
    yield Command(path, parser, help_text)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield from _walk(f"{path} {name}", sub, helps.get(name, ""))


def options(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string a parser takes (--help aside)."""
    return [s for a in parser._actions if not isinstance(a, argparse._HelpAction) for s in a.option_strings]


def anchor(path: str) -> str:
    """The heading id of a command's section (set explicitly, so links do not depend on slug rules)."""
    return path.replace(" ", "-")


def render(program: Program, parser: argparse.ArgumentParser | None = None) -> str:
    """The reference page of one program (from `parser`, default its build_parser()), in Markdown."""
    cmds = commands(program, parser)
    top = cmds[0].parser
    lines = [f"# {program.name}", "",
             f"{program.summary} This page is generated from the program's parser when the site is built "
             f"(`{program.module}.build_parser`), so it lists every option; `{program.name} COMMAND --help` "
             "prints the same.", ""]
    if len(cmds) > 1:
        lines += ["| command | what it does |", "| --- | --- |"]
        lines += [f"| [`{c.path}`](#{anchor(c.path)}) | {_cell(c.help)} |" for c in cmds[1:]]
        lines.append("")
    for c in cmds:
        if c.parser is top and len(cmds) > 1 and not _own_actions(c.parser):
            continue
        lines += _section(c, level=1 if c.parser is top else 2)
    return "\n".join(lines).rstrip() + "\n"


def _own_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def _section(command: Command, level: int) -> list[str]:
    parser = command.parser
    lines = []
    if level > 1:
        lines += [f"## `{command.path}` {{#{anchor(command.path)}}}", ""]
        text = (parser.description or command.help or "").strip()
        if text:
            lines += [_fenced(text) if "\n" in text else text, ""]
    else:
        lines += ["## Options of every command", ""] if _own_actions(parser) else []
    fmt = argparse.HelpFormatter(command.path, width=USAGE_WIDTH)
    fmt.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    lines += ["```text", fmt.format_help().strip(), "```", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if not actions:
            continue
        title = group.title or "options"
        lines += [f"**{title}**" + (f": {group.description}" if group.description else ""), "",
                  "| option | default | meaning |", "| --- | --- | --- |"]
        lines += [_row(a, fmt) for a in actions]
        lines.append("")
    return lines


def _row(action: argparse.Action, fmt: argparse.HelpFormatter) -> str:
    if action.option_strings:
        metavar = "" if action.nargs == 0 else " " + fmt._format_args(action, action.dest.upper())
        name = ", ".join(f"`{s}{metavar}`" for s in action.option_strings)
    else:
        name = f"`{fmt._format_args(action, action.dest)}`"
    meaning = fmt._expand_help(action) if action.help else ""
    if action.required:
        meaning = "**Required.** " + meaning
    if isinstance(action, argparse._AppendAction):
        meaning += " Repeatable."
    return f"| {name} | {_default(action)} | {_cell(meaning)} |"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0:       # a switch: what leaving it out means
        return "off" if isinstance(action, argparse._StoreTrueAction) else ""
    if action.default in (None, argparse.SUPPRESS) or action.default == []:
        return ""
    return f"`{action.default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _fenced(text: str) -> str:
    return f"```text\n{text}\n```"


def page_path(program: Program) -> str:
    return f"reference/{program.name}.md"


# --- the MkDocs hook ---------------------------------------------------------------------------

def on_files(files, config):
    """The site's reference pages are rendered from the parsers at build time, always. The copies
    committed in docs/reference/ (every option readable and greppable in the repository) are checked
    against the same render by tests/test_docs_reference.py."""
    from mkdocs.structure.files import File
    for program in PROGRAMS:
        committed = files.get_file_from_path(page_path(program)) if hasattr(files, "get_file_from_path") else None
        if committed is not None:
            files.remove(committed)
        files.append(File.generated(config, page_path(program), content=render(program)))
    return files


def write_pages(docs_dir: Path) -> None:
    for program in PROGRAMS:
        path = docs_dir / page_path(program)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(program), encoding="utf-8")


if __name__ == "__main__":
    # python docs/hooks/cli_reference.py [PROGRAM ...]   print the pages
    # python docs/hooks/cli_reference.py --write         refresh docs/reference/ (committed)
    wanted = sys.argv[1:]
    if wanted == ["--write"]:
        write_pages(Path(__file__).resolve().parents[1])
        sys.exit(0)
    for program in PROGRAMS:
        if not wanted or program.name in wanted:
            sys.stdout.write(render(program))
