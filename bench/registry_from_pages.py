"""Lift the figures a docs page types by hand into the registry, and name them on the page instead.

For each section (a `##` heading) of a page that states measured figures, one result file,
`bench/results/<page>-<section>.json`, receives:

- each Markdown table that holds a measured figure, as a registry table (`{{ table("...") }}`);
- each figure typed in the prose (a number with ×, tok/s, ms, s or %: `hybridspec.figures.MEASURED`,
  less the design constants of `ALLOWED`), as a registry figure (`{{ fig("...") }}`) whose format
  renders exactly the text the page typed;

with the command, the machine and the date the section states (its first command block, its
**Machine:** and **Date:** lines), and a note that says the entry was lifted from that page. The page
then names the figure, so the built site reads as before, and the next run of the benchmark that
produced it writes the result file with `hybridspec.figures.write_result`.

Run on a page that still types figures: `python bench/registry_from_pages.py docs/x.md ...` (a page
with nothing left to lift is left as it is; a section lifted before gains the new figures in its
result file). Standard library only.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridspec import figures  # noqa: E402

NUMBER = re.compile(r"^(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)(?P<unit>.*)$", re.S)


def slug(text: str, limit: int = 48) -> str:
    text = re.sub(r"\{\{.*?\}\}|\[([^\]]*)\]\([^)]*\)", r"\1", text)
    words = re.findall(r"[a-z0-9]+", text.lower())
    out = "-".join(words)[:limit].strip("-")
    return out or "figure"


def as_figure(typed: str, quantity: str, setup: str) -> figures.Figure:
    """A figure whose rendering is exactly `typed` ("1,469.2 tok/s", "1.29×", "61–72%")."""
    m = NUMBER.match(typed)
    unit_text = m.group("unit") if m else ""
    unit = unit_text.strip().replace("×", "x") or ""
    if m and not re.match(r"\s?[–-]", unit_text):
        num = m.group("num")
        decimals = len(num.split(".")[1]) if "." in num else 0
        value = float(num.replace(",", "")) if decimals else int(num.replace(",", ""))
        comma = "," if "," in num else ""
        fmt = "{:" + comma + f".{decimals}f" + "}" + unit_text
        return figures.Figure(value=value, quantity=quantity, setup=setup, unit=unit, fmt=fmt)
    return figures.Figure(value=typed, quantity=quantity, setup=setup, unit="", fmt="{}")


def sections(lines: list[str]) -> list[tuple[str, int, int]]:
    """(title, first line, end line) for the page's opening and each `##` section."""
    heads, fenced = [], False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"^## ", line):
            heads.append((line[3:].strip(), i))
    starts = [("opening", 0)] + heads
    return [(t, s, starts[k + 1][1] if k + 1 < len(starts) else len(lines)) for k, (t, s) in enumerate(starts)]


def provenance(block: list[str], page: str, title: str) -> tuple[str, dict, str]:
    """(command, machine, date) as the section states them: its **Command:** line or first command
    block, its **Machine:** line, its first date."""
    text = "\n".join(block)
    command = ""
    stated = re.search(r"\*\*Commands?:?\*\*:?\s*(.+?)(?:\s{2,}\n|\n\*\*|\n\n)", text, flags=re.S)
    if stated:
        command = " ".join(stated.group(1).split())[:400]
    fence = re.search(r"^```(?:bash|sh|console)?\n(.*?)^```", text, flags=re.M | re.S)
    body = [ln for ln in fence.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")] if fence else []
    machine = re.search(r"\*\*Machine:?\*\*:?\s*(.+?)(?:\*\*Date|$)", text, flags=re.M)
    date = re.search(r"\b20\d\d-\d\d-\d\d\b", text)
    if body and not command:      # no **Command:** line: the section's first command block, said as such
        command = ("the section's first command block: "
                   + " ".join(ln.strip().rstrip("\\").strip() for ln in body[:4])[:400])
    machine_text = (machine.group(1).strip().rstrip(".") if machine else
                    "not stated in the section (the project's 2-vCPU VMs unless its text says otherwise)")
    return (command or f"not stated on docs/{page} § {title}",
            {"as_stated": machine_text},
            date.group(0) if date else "undated (the section gives no date)")


def refresh(results_dir: Path) -> int:
    """Re-read command, machine and date for every lifted entry from its page section as it reads now."""
    registry = figures.load(results_dir)
    n = 0
    for path in sorted(results_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        m = re.match(r"lifted from docs/(\S+) § (.+): the figures as", doc.get("note", ""))
        if not m:
            continue
        page, title = m.group(1), m.group(2)
        lines = figures.render((ROOT / "docs" / page).read_text(encoding="utf-8"), registry).splitlines()
        for t, start, end in sections(lines):
            if t == title:
                doc["command"], doc["machine"], doc["date"] = provenance(lines[start:end], page, title)
                path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
                n += 1
    return n


def table_rows(lines: list[str]) -> tuple[list[str], list[list[str]]]:
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", ln.strip().strip("|"))] for ln in lines]
    return cells[0], [r for r in cells[2:]]


def lift_section(page: str, title: str, block: list[str], name: str, taken: set[str] = frozenset()):
    """The section with its figures named, and the result (figures, tables) they go to; `taken`: the
    keys its result file already holds (a page lifted again after the pattern grew)."""
    figs: dict[str, figures.Figure] = {}
    tables: dict[str, figures.Table] = {}
    out, i, fenced = [], 0, False
    setup = f"docs/{page} § {title}"
    while i < len(block):
        line = block[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("|") and i + 1 < len(block) and re.match(r"^\|[-:| ]+\|\s*$", block[i + 1]):
            j = i
            while j < len(block) and block[j].startswith("|"):
                j += 1
            rows = block[i:j]
            if any(figures.measured_spans(r) or re.search(r"(?<![\w.])\d+\.\d+", figures._masked(r))
                   for r in rows[2:]):
                key = f"table-{len(tables) + 1}"
                while key in taken:
                    key += "b"
                cols, body = table_rows(rows)
                tables[key] = figures.Table(columns=cols, rows=body)
                out.append(f'{{{{ table("{name}/{key}") }}}}')
            else:
                out.extend(rows)
            i = j
            continue
        if not fenced and not line.startswith("#"):
            spans = figures.measured_spans(line)
            for a, b in reversed(spans):
                typed = line[a:b]
                before = figures._masked(line[:a])
                words = re.findall(r"[A-Za-z][\w-]*", before)[-4:]
                key = base = slug(" ".join(words) + " " + typed.split()[-1] if typed.split() else typed, 40)
                n = 2
                while key in figs or key in taken:
                    key, n = f"{base}-{n}", n + 1
                quantity = (line[:a] + "…" + line[b:]).strip()
                figs[key] = as_figure(typed, quantity[:300], setup)
                line = line[:a] + f'{{{{ fig("{name}/{key}") }}}}' + line[b:]
        out.append(line)
        i += 1
    return out, figs, tables


def lift_page(path: Path, results_dir: Path) -> int:
    page = path.relative_to(ROOT / "docs").as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    new, lifted = [], 0
    for title, start, end in sections(lines):
        block = lines[start:end]
        name = f"{Path(page).stem}-{slug(title, 40)}"
        target = results_dir / f"{name}.json"
        old = json.loads(target.read_text()) if target.exists() else None
        taken = set(old["figures"]) | set(old["tables"]) if old else set()
        body, figs, tables = lift_section(page, title, block, name, taken)
        if (figs or tables) and old:          # lifted before: add what the wider pattern finds
            old["figures"].update({k: vars(f) for k, f in figs.items()})
            old["tables"].update({k: {"columns": t.columns, "rows": t.rows, "fmt": t.fmt} for k, t in tables.items()})
            target.write_text(json.dumps(old, indent=1, ensure_ascii=False) + "\n")
            lifted += len(figs) + len(tables)
        elif figs or tables:
            command, machine, date = provenance(block, page, title)
            doc = {"name": name, "command": command, "machine": machine, "load": {"start": None, "end": None},
                   "date": date,
                   "note": f"lifted from docs/{page} § {title}: the figures as that page stated them, with the "
                           "command, machine and date it gave; the benchmark's next run replaces this file",
                   "figures": {k: vars(f) for k, f in figs.items()},
                   "tables": {k: {"columns": t.columns, "rows": t.rows, "fmt": t.fmt} for k, t in tables.items()}}
            target.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
            lifted += len(figs) + len(tables)
        new.extend(body)
    if lifted:
        path.write_text("\n".join(new) + "\n", encoding="utf-8")
    return lifted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", type=Path)
    parser.add_argument("--refresh", action="store_true",
                        help="re-read command, machine and date of every lifted entry from its page")
    args = parser.parse_args()
    if args.refresh:
        print(f"{refresh(figures.RESULTS)} entries refreshed")
    for page in args.pages:
        print(f"{page}: {lift_page(page.resolve(), figures.RESULTS)} figures and tables lifted")


if __name__ == "__main__":
    main()
