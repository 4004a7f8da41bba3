"""MkDocs hook: the lists that code can produce are made from the code at build time.

A page asks for one with a marker on a line of its own, replaced by markdown:

* ``<!-- generated:stages -->``: every stage a pipeline file may use, with its parameters
  (:func:`feedgpu.stages.params.describe_stage`, what ``feedgpu stages --json`` prints);
* ``<!-- generated:schema -->``: the sections of a pipeline file, one settings class each
  (:data:`feedgpu.settings.SECTIONS`), with every key's type, default and description;
* ``<!-- generated:cli -->``: the help of every ``feedgpu`` command (click's own text);
* ``<!-- generated:results -->``: the index of current benchmark results
  (``bench/results/README.md``, its links pointed at the copies this hook adds to the site).

The current results (``bench/results/*.md`` and ``*.json``, not ``archive/``) are added to the
site under ``bench-results/`` so that pages can link to them. An unknown marker fails the build.
"""
from __future__ import annotations

import inspect
import re
import sys
import typing
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
SITE_RESULTS = "bench-results"
if str(REPO) not in sys.path:   # this checkout's feedgpu, however mkdocs was started
    sys.path.insert(0, str(REPO))

_MARKER = re.compile(r"^<!-- generated:([a-z]+) -->$", re.M)


def on_files(files, config):
    for path in sorted(RESULTS.rglob("*")):
        rel = path.relative_to(RESULTS)
        if (path.is_file() and path.suffix in (".md", ".json") and rel.parts[0] != "archive"
                and rel.as_posix() != "README.md"):
            files.append(File.generated(config, f"{SITE_RESULTS}/{rel.as_posix()}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    def replace(m: re.Match) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_uri}: unknown generated list {name!r} "
                             f"(known: {', '.join(sorted(GENERATORS))})")
        return GENERATORS[name](page)

    return _MARKER.sub(replace, markdown)


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def stages_md(page=None) -> str:
    """Markdown of every registered stage: a summary table, then each stage's parameters."""
    from feedgpu.stages.params import describe_stage
    from feedgpu.stages.registry import BUILTIN, stage_classes

    found = [dict(describe_stage(cls), builtin=BUILTIN.get(name) is cls) for name, cls in stage_classes().items()]
    out = ["| stage | kind | random | engines | what it does |", "| --- | --- | --- | --- | --- |"]
    for d in found:
        random = {True: "no", False: "yes (reproducible from the seed)", None: "depends on its parameters"}[
            d["deterministic"]]
        engines = "python, dali" if d["dali"] else "python"
        out.append(f"| [`{d['name']}`](#{d['name'].replace('_', '-')}) | {d['kind']} | {random} | {engines} | "
                   f"{_cell(_rst_to_md(d['summary']))} |")
    for d in found:
        out += ["", f"### `{d['name']}` {{#{d['name'].replace('_', '-')}}}", ""]
        origin = "built in" if d["builtin"] else "plugin"
        out += [f"`{d['class']}` ({origin}). {_cell(_rst_to_md(d['summary']))}", ""]
        if d["params"]:
            out += ["| parameter | type | default |", "| --- | --- | --- |"]
            for prm in d["params"]:
                default = "required" if prm["required"] else f"`{prm['default']!r}`"
                out.append(f"| `{prm['name']}` | {_cell(prm['type'])} | {default} |")
        else:
            out.append("No parameters.")
        if d["set_from_output"]:
            out += ["", f"Set from the `output:` section: {', '.join(f'`{k}`' for k in d['set_from_output'])}."]
    return "\n".join(out) + "\n"


def _args_doc(cls) -> dict[str, str]:
    """``{name: description}`` from the ``Args:`` sections of the Google-style docstrings of
    ``cls`` and its bases (the class's own first)."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        found.update(_own_args_doc(klass))
    return found


def _own_args_doc(cls) -> dict[str, str]:
    doc = cls.__dict__.get("__doc__") or ""
    doc = inspect.cleandoc(doc)
    m = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)*)", doc, re.M)
    if not m:
        return {}
    found: dict[str, str] = {}
    names: list[str] = []
    for line in m.group(1).splitlines():
        head = _arg_head(line)
        if head:   # keys documented together: the text on the first, a pointer on the others
            names, text = head
            found[names[0]] = text
            for name in names[1:]:
                found[name] = f"see `{names[0]}`"
        elif names and line.strip():
            found[names[0]] += " " + line.strip()
    return found


def _arg_head(line: str) -> tuple[list[str], str] | None:
    """``(names, text)`` of an ``Args:`` entry's first line (``a (int), b (str): text``), else None."""
    if not re.match(r"^ {4}\w", line):
        return None
    depth = 0
    for i, ch in enumerate(line):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ":" and depth == 0:
            prefix = re.sub(r"\([^()]*(?:\([^()]*\)[^()]*)*\)", "", line[:i])
            names = [n.strip() for n in prefix.split(",")]
            if all(n.isidentifier() for n in names):
                return names, line[i + 1:].strip()
            return None
    return None


def _rst_to_md(text: str) -> str:
    text = re.sub(r":(?:class|func|mod|meth|data|attr|exc):`~?([^`]+)`", lambda m: f"`{m.group(1)}`", text)
    return text.replace("``", "`")


def schema_md(page=None) -> str:
    """Markdown of every section of a pipeline file: each key's type, default and meaning."""
    from feedgpu.settings import SECTIONS
    from feedgpu.stages.params import _type_text

    out = []
    for section, cls in SECTIONS.items():
        doc = inspect.getdoc(cls) or ""
        first = _rst_to_md(" ".join(doc.split("\n\n")[0].split()))
        described = _args_doc(cls)
        out += [f"### `{section}:`", "", f"{first} Python: `{cls.__module__}.{cls.__name__}`.", "",
                "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for name, field in cls.__pydantic_fields__.items():
            ann = field.annotation
            if field.metadata:
                ann = typing.Annotated[(ann, *field.metadata)]
            default = "required" if field.is_required() else f"`{field.default!r}`"
            out.append(f"| `{name}` | {_cell(_type_text(ann))} | {default} | "
                       f"{_cell(_rst_to_md(described.get(name, '')))} |")
        out.append("")
    return "\n".join(out)


def cli_md(page=None) -> str:
    """Markdown of every ``feedgpu`` command's help, as click prints it."""
    import click

    from feedgpu.cli.main import main

    out: list[str] = []

    def walk(cmd: click.Command, path: list[str], parent: click.Context | None) -> None:
        ctx = click.Context(cmd, info_name=path[-1], parent=parent, terminal_width=100, max_content_width=100)
        name = " ".join(path)
        out.extend([f"### `{name}`", "", "```text", cmd.get_help(ctx).rstrip(), "```", ""])
        if isinstance(cmd, click.Group):
            for sub in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, sub), path + [sub], ctx)

    walk(main, ["feedgpu"], None)
    return "\n".join(out)


def results_md(page=None) -> str:
    """The index of ``bench/results/README.md`` for the site: benchmark (with what it measures),
    headline, machine and date, and a link to the site's copy of the file."""
    text = (RESULTS / "README.md").read_text()
    table = text[text.index("<!-- index -->") + len("<!-- index -->"):text.index("<!-- /index -->")]
    base = "../" * page.file.src_uri.count("/") if page is not None else ""
    out = ["| benchmark | headline | machine, date | file |", "| --- | --- | --- | --- |"]
    rows = [line for line in table.strip().splitlines()[2:] if line.startswith("|")]
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
        if len(cells) != 6:
            raise ValueError(f"bench/results/README.md: a row of the index has {len(cells)} cells, not 6: {row}")
        bench, measures, machine, date, headline, link = cells
        m = re.fullmatch(r"\[([^\]]+)\]\(([^)]+)\)", link)
        if not m:
            raise ValueError(f"bench/results/README.md: the file cell is not a link: {link}")
        name = m.group(1).removesuffix(".md")
        out.append(f"| **{bench}**: {measures} | {headline} | {machine}, {date} | "
                   f"[{name}]({base}{SITE_RESULTS}/{m.group(2)}) |")
    return "\n".join(out) + "\n"


_ROLE = re.compile(r":(?:class|func|mod|meth|data|attr|exc|obj):<code>~?([^<]*)</code>")


def on_page_content(html, page, config, files):
    """Docstrings use reST roles (``:class:`~feedgpu.Pipeline```); shown as plain code."""
    return _ROLE.sub(lambda m: f"<code>{m.group(1)}</code>", html)


GENERATORS = {"stages": stages_md, "schema": schema_md, "cli": cli_md, "results": results_md}
