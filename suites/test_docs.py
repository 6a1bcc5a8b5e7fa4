"""The documentation keeps up with the code: the generated reference pages (every command's flags,
the plugin's options, the JSON documents, the catalogue of rings) are what the code gives now,
README stays a front door, and every relative link in README, CONTRIBUTING and docs/ resolves."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import docs_reference

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
# [text](target) and [text](target#anchor), outside fenced code
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_generated_reference_pages_are_up_to_date():
    stale = docs_reference.stale_pages()
    assert not stale, (f"docs/reference/{', docs/reference/'.join(stale)} differ from what the code gives now: "
                       f"regenerate with `.venv/bin/python -m benchmarks.docs_reference`")


def test_the_check_names_a_stale_page(tmp_path, monkeypatch, capsys):
    """A flag's help reworded without regenerating: the check fails and names the page."""
    for name in docs_reference.PAGES:
        shutil.copy(docs_reference.REFERENCE / name, tmp_path / name)
    page = tmp_path / "cli.md"
    page.write_text(page.read_text().replace("query heads (default 4)", "heads of the queries (default 4)", 1))
    monkeypatch.setattr(docs_reference, "REFERENCE", tmp_path)
    assert docs_reference.stale_pages() == ["cli.md"]
    assert docs_reference.main(["--check"]) == 1
    assert "docs/reference/cli.md" in capsys.readouterr().err


def test_the_cli_page_lists_every_command_and_flag():
    from ringcheck.cli import build_parser

    page = docs_reference.cli_page()
    parser = build_parser()
    for name, _, sub in docs_reference.subcommands(parser):
        assert f"## ringcheck {name}" in page
        for action in sub._actions:
            for flag in [] if "--help" in action.option_strings else action.option_strings:
                assert f"`{flag}" in page or f", {flag}" in page, f"ringcheck {name} {flag} is not on the page"
    assert "`--ring-impl MOD:FN|ADAPTER`" in page and "`--ring-mesh DIM=N,...`" in page


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"
    text = "\n".join(lines)
    assert text.index("make validate") < text.index("## Validate your own ring")


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _links(path: Path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks quote commands, not links
    text = re.sub(r"`[^`\n]*`", "", text)
    for target in LINK.findall(text):
        if "://" not in target and not target.startswith(("mailto:", "#")):
            yield target.split("#")[0]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    missing = [target for target in _links(page) if not (page.parent / target).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, or a page left out of the nav, fails (only
    where the docs extra is installed: `pip install -e ".[docs]"`)."""
    pytest.importorskip("mkdocs")
    # no -q: mkdocs counts the warnings that --strict turns into a failure only at its default log level
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
