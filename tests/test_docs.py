"""The documentation: the API examples run, the README is a front page, the reference and the helpers'
fragments reach the site, and a strict build fails on a broken link or a missing name.

``make docs`` (run by ``make test``) builds the whole site strictly; the tests here cover the parts a
full build does not check: the examples kept in docs/api_examples run (docstring examples run in
tests/test_public_api.py), and the strictness itself.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
from _procs import child_env, finish, start

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import reference  # noqa: E402  (docs/hooks/reference.py, the MkDocs hook)

USER_TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_RUN_KEPT = textwrap.dedent("""
    import doctest, sys
    sys.path.insert(0, sys.argv[1])
    import reference
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for name, code in reference.kept_examples().items():
        runner.run(parser.get_doctest(code, {}, name, name, 0))
    failed, attempted = runner.summarize(verbose=False)
    print(f"attempted={attempted} failed={failed}")
""")


def test_kept_api_examples_run(tmp_path):
    # In a process of its own (forked from the warm interpreter): the examples form one-process meshes and
    # change the global policy.
    script = tmp_path / "run_kept.py"
    script.write_text(_RUN_KEPT)
    code, out = finish(start([str(script), str(ROOT / "docs" / "hooks")], child_env(HOME=str(tmp_path),
                                                                                  TMPDIR=str(tmp_path)),
                             cwd=str(tmp_path)), timeout=600)
    summary = re.search(r"attempted=(\d+) failed=(\d+)", out)
    assert code == 0 and summary, out[-6000:]
    assert summary.group(2) == "0", out[-6000:]
    assert int(summary.group(1)) >= len(reference.kept_examples()) * 3


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, len(lines)
    assert lines[3].startswith("make demo") and lines[4].startswith("make test"), lines[:6]
    # the short example is examples/quickstart.py's (which tests/test_examples.py runs), line for line
    shown = re.search(r"```python\n(.*?)```", text, re.S).group(1).strip()
    quickstart = (ROOT / "examples" / "quickstart.py").read_text()
    kept = re.search(r"# --8<-- \[start:example\]\n(.*?)# --8<-- \[end:example\]", quickstart, re.S).group(1)
    assert shown == kept.strip()
    assert "## Dependencies" in text  # one line of justification per dependency


@pytest.mark.parametrize("path", USER_TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_internal_history_in_user_texts(path):
    text = path.read_text()
    for pattern in [r"\b[Ii]ssue #?\d+", r"(?<![\w/&])#\d{2,}\b", r"\b[Ss]eed \d{3}\b", r"\bcommit [0-9a-f]{7,}\b"]:
        found = re.findall(pattern, text)
        assert not found, f"{path.relative_to(ROOT)}: {found} (internal history: say what it does instead)"


def test_reference_pages_document_every_public_name_once():
    names = reference.public_names()
    kept = reference.kept_examples()
    pages = {p: reference.reference_page(p, names, kept) for p in reference.public_packages()}
    entries = [line[4:] for page in pages.values() for line in page.splitlines() if line.startswith("::: ")]
    objects = {id(n.value): f"{n.home}.{n.value.__qualname__}" for n in names if n.is_api_object}
    assert sorted(entries) == sorted(objects.values())  # each class and function once, at its home
    assert "::: meshfit.Model" in pages["meshfit"]
    assert "[`meshfit.distribute.MirroredStrategy`][meshfit.distribute.MirroredStrategy]" in pages["meshfit"]
    assert "**Examples:**" in pages["meshfit.losses"]  # a kept example under its name
    index = reference.reference_index(reference.public_packages())
    assert "[`meshfit.callbacks`](meshfit.callbacks.md)" in index


def test_fragments_join_the_differences_page_and_the_guides(tmp_path, monkeypatch):
    (tmp_path / "replicas.md").write_text(textwrap.dedent("""\
        # Verifying replicas

        ## Differences
        | meshfit | Keras / TensorFlow | why |
        |---|---|---|
        | `VerifyReplicas` compares the replicas' weights | no such check | silent divergence is wrong data |

        ## Guide
        Add `mf.callbacks.VerifyReplicas()` to `fit`.
        """))
    monkeypatch.setattr(reference, "FRAGMENTS_DIR", tmp_path)
    assert reference.fragment_differences() == [
        "### Verifying replicas\n\n| meshfit | Keras / TensorFlow | why |\n|---|---|---|\n"
        "| `VerifyReplicas` compares the replicas' weights | no such check | silent divergence is wrong data |\n"]
    assert reference.fragment_guides() == [
        ("guides/more/replicas.md", "Verifying replicas",
         "# Verifying replicas\n\nAdd `mf.callbacks.VerifyReplicas()` to `fit`.\n")]
    page = (ROOT / "docs" / "guides" / "differences.md").read_text()
    merged = reference.on_page_markdown(page, None, None, None)
    assert "| `VerifyReplicas` compares the replicas' weights |" in merged
    section = merged.index("### Verifying replicas")
    assert merged[section - 2:section] == "\n\n"  # its own table, after the main one
    assert "<!-- fragments" not in merged
    config = {"nav": [{"Guides": ["guides/index.md"]}, {"API reference": []}]}
    nav = reference.on_config(config)["nav"]
    assert {"Verifying replicas": "guides/more/replicas.md"} in nav[0]["Guides"]
    assert {"meshfit.callbacks": "reference/meshfit.callbacks.md"} in nav[1]["API reference"]


@pytest.mark.parametrize("page, error", [
    ("[a link](nowhere.md)", "contains a link 'nowhere.md'"),
    ("::: meshfit.NoSuchName", "Could not collect 'meshfit.NoSuchName'"),
    ("See [meshfit.NoSuchName][].", "Could not find cross-reference target 'meshfit.NoSuchName'"),
])
def test_a_strict_build_fails_on_a_broken_link_or_a_missing_name(tmp_path, page, error):
    config = (ROOT / "mkdocs.yml").read_text()
    config = re.sub(r"(?ms)^nav:.*", "nav:\n  - index.md\n", config)
    config = re.sub(r"(?ms)^hooks:\n(  - .*?\n)+", "", config)
    config = config.replace("docs_dir: docs", f"docs_dir: {tmp_path / 'docs'}")
    config = config.replace("site_dir: site", f"site_dir: {tmp_path / 'site'}")
    config = config.replace("paths: [.]", f"paths: [{ROOT}]").replace("docs/hooks/", f"{ROOT}/docs/hooks/")
    config = re.sub(r"(?ms)^extra_css:\n  - .*?\n", "", config)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(f"# Page\n\n{page}\n")
    (tmp_path / "mkdocs.yml").write_text(config)
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1",
                              "HOME": str(tmp_path)})
    assert out.returncode != 0, out.stderr[-2000:]
    assert error in out.stderr, out.stderr[-2000:]
