"""The API reference, generated from meshfit itself, and the topic fragments (an MkDocs hook).

Every public package (a package under ``meshfit`` with no ``_``-prefixed part) gets a reference page,
``reference/<package>.md``, listing each name of its ``__all__``: the full entry (signature, docstring,
members) on the page of the name's home (its ``__module__``), a link there from every package that
re-exports it. A class or function whose docstring has no ``>>>`` example gets the one kept for it in
``docs/api_examples/<home>.md`` (a ``## Name`` heading over a ``pycon`` block). New public names and
packages appear without editing anything here; ``tests/test_public_homes.py`` fails for one with a
private home or no example, and ``tests/test_docs.py`` runs every example.

Fragments: ``docs/fragments/<topic>.md`` with a ``## Differences`` section (a table with its own
columns, shown under the fragment's ``# Title`` after the main table of the "Where meshfit differs"
page) and a ``## Guide`` section (a page of its own under Guides, titled by the same ``# Title``).
The hook puts both into the site.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pathlib
import re
import types
from typing import Any

DOCS = pathlib.Path(__file__).resolve().parents[1]
ROOT = DOCS.parent
EXAMPLES_DIR = DOCS / "api_examples"
FRAGMENTS_DIR = DOCS / "fragments"
_LAZY = ("meshfit.train", "meshfit.estimator")


@dataclasses.dataclass(frozen=True)
class PublicName:
    """One name in a public package's ``__all__``."""

    package: str
    name: str
    value: Any

    @property
    def path(self) -> str:
        return f"{self.package}.{self.name}"

    @property
    def is_api_object(self) -> bool:
        """A class or function (what gets a home and an example); constants and modules do not."""
        return isinstance(self.value, (type, types.FunctionType))

    @property
    def home(self) -> str:
        return self.value.__module__ if self.is_api_object else self.package


def public_packages() -> list[str]:
    """``meshfit`` and every package under it whose path has no ``_``-prefixed part, sorted."""
    import meshfit

    root = pathlib.Path(meshfit.__file__).parent
    found = ["meshfit"]
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("_"))
        if pathlib.Path(folder) != root and "__init__.py" in files:
            found.append("meshfit." + str(pathlib.Path(folder).relative_to(root)).replace(os.sep, "."))
    return sorted(found)


def public_names() -> list[PublicName]:
    """Every name of every public package's ``__all__`` (modules left out), in package order."""
    names = []
    for package in public_packages():
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            if not isinstance(value, types.ModuleType):
                names.append(PublicName(package, name, value))
    return names


def has_docstring_example(value: Any) -> bool:
    return ">>>" in (inspect.getdoc(value) or "")


_EXAMPLE = re.compile(r"^## (?P<name>\S+)\s*\n(?P<body>.*?)(?=^## |\Z)", re.M | re.S)
_PYCON = re.compile(r"```pycon\n(?P<code>.*?)```", re.S)


def kept_examples() -> dict[str, str]:
    """``{"meshfit.losses.Huber": ">>> ..."}``: the examples kept in ``docs/api_examples/<home>.md``."""
    found = {}
    for file in sorted(EXAMPLES_DIR.glob("*.md")):
        package = file.stem
        for match in _EXAMPLE.finditer(file.read_text()):
            code = _PYCON.search(match["body"])
            if code:
                found[f"{package}.{match['name']}"] = code["code"]
    return found


def example_for(name: PublicName, kept: dict[str, str]) -> str | None:
    """The example of an API object: its docstring's, else the kept one under its home; None if none."""
    if has_docstring_example(name.value):
        return inspect.getdoc(name.value)
    return kept.get(f"{name.home}.{name.value.__qualname__}")


# ---- reference pages ------------------------------------------------------------------------------

def _page_path(package: str) -> str:
    return f"reference/{package}.md"


def _private_base_members(value: Any) -> list[str]:
    """Public members ``value`` inherits from private meshfit classes (no reference page of their own)."""
    if not isinstance(value, type):
        return []
    names: set[str] = set()
    for base in value.__mro__[1:]:
        if base.__module__.startswith("meshfit") and any(p.startswith("_") for p in base.__module__.split(".")):
            names |= {name for name in vars(base) if not name.startswith("_")}
    return sorted(names - set(vars(value)))


def reference_page(package: str, names: list[PublicName], kept: dict[str, str]) -> str:
    module = importlib.import_module(package)
    summary = (inspect.getdoc(module) or "").split("\n\n")[0]
    lines = [f"# `{package}`", "", summary, "", f"```python\nimport {package}\n```", ""]
    own = [n for n in names if n.package == package]
    homed = [n for n in own if n.home == package]
    reexported = [n for n in own if n.home != package]
    constants = [n for n in homed if not n.is_api_object]
    for name in sorted((n for n in homed if n.is_api_object), key=lambda n: n.name.lower()):
        lines += [f"::: {name.path}", "    options:", "      heading_level: 2"]
        inherited = _private_base_members(name.value)
        if inherited:  # members a private mixin gives (Model.save): shown here, their only public home
            lines.append(f"      inherited_members: {inherited}")
        lines.append("")
        if not has_docstring_example(name.value):
            example = kept.get(name.path)
            if example:
                lines += ["**Examples:**", "", "```pycon", example.rstrip(), "```", ""]
    if constants:
        lines += ["## Constants", "", "| name | value |", "|---|---|"]
        lines += [f"| `{n.path}` | `{n.value!r}` |" for n in constants]
        lines.append("")
    if reexported:
        lines += ["## Also importable from here", "",
                  "The same objects as at their home (`is` holds); documented there.", ""]
        lines += [f"- `{n.path}`: [`{n.home}.{n.name}`][{n.home}.{n.name}]" for n in reexported]
        lines.append("")
    return "\n".join(lines)


def reference_index(packages: list[str]) -> str:
    lines = ["# API reference", "",
             "Every public name, under the path you import it from. Generated from the docstrings; "
             "each class and function has a runnable example (the test suite runs them).", "",
             "| package | what it holds |", "|---|---|"]
    for package in packages:
        doc = (inspect.getdoc(importlib.import_module(package)) or "").split("\n\n")[0].replace("\n", " ")
        lines.append(f"| [`{package}`]({package}.md) | {doc.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


# ---- fragments ------------------------------------------------------------------------------------

def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {title}\s*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    return match.group(1).strip() if match else ""


def _title(file: pathlib.Path, text: str) -> str:
    heading = re.search(r"^# (.+)$", text, re.M)
    return heading.group(1).strip() if heading else file.stem.replace("_", " ").capitalize()


def fragment_differences() -> list[str]:
    """One markdown section per fragment with a Differences section: its title, then the section as
    written (its own table, with its own columns, and any paragraph around it)."""
    sections = []
    for file in sorted(FRAGMENTS_DIR.glob("*.md")):
        text = file.read_text()
        differences = _section(text, "Differences")
        if differences:
            sections.append(f"### {_title(file, text)}\n\n{differences}\n")
    return sections


def fragment_guides() -> list[tuple[str, str, str]]:
    """``(page path, title, markdown)`` for each fragment with a Guide section."""
    pages = []
    for file in sorted(FRAGMENTS_DIR.glob("*.md")):
        text = file.read_text()
        guide = _section(text, "Guide")
        if guide:
            title = _title(file, text)
            pages.append((f"guides/more/{file.stem}.md", title, f"# {title}\n\n{guide}\n"))
    return pages


# ---- MkDocs hooks ---------------------------------------------------------------------------------

def on_config(config: Any) -> Any:
    nav = config["nav"]
    reference = [{"Overview": "reference/index.md"}] + [{p: _page_path(p)} for p in public_packages()]
    for entry in nav:
        if isinstance(entry, dict) and "API reference" in entry:
            entry["API reference"] = reference
        if isinstance(entry, dict) and "Guides" in entry:
            extra = [{title: path} for path, title, _ in fragment_guides()]
            entry["Guides"] = [e for e in entry["Guides"] if not str(e).count("guides/more/")] + extra
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    names = public_names()
    kept = kept_examples()
    packages = public_packages()
    files.append(File.generated(config, "reference/index.md", content=reference_index(packages)))
    for package in packages:
        files.append(File.generated(config, _page_path(package), content=reference_page(package, names, kept)))
    for path, _, text in fragment_guides():
        files.append(File.generated(config, path, content=text))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- fragments: differences -->" in markdown:
        markdown = markdown.replace("<!-- fragments: differences -->",
                                    "\n\n" + "\n".join(fragment_differences()))
    return markdown
