"""mkdocs hook: links from the docs to files of the repository outside docs/ (the committed reports,
the example ring, a source file) work on the site as they do on GitHub, and a broken one fails
`mkdocs build --strict`.

The pages link such files relatively (`../reports/peers/summary.json` from docs/findings.md), which
is right when the repository is browsed. For the site, every file a page links that lies outside
docs/ (and inside the repository) is copied in as-is under `repo/` (a Markdown file too: it is
shown as text, not rendered), and the page's link is pointed at the copy before mkdocs checks it;
a link to a file that does not exist is left alone, so mkdocs reports it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mkdocs.structure.files import File

# [text](target) and [text](target#anchor), not inside code spans (the pages quote no such links)
LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
PREFIX = "repo"


class RepositoryFile(File):
    """A repository file copied into the site as it is, never rendered as a page."""

    def is_documentation_page(self) -> bool:
        return False


def _outside(config, page_src_uri: str, target: str) -> str | None:
    """The repository path of a link's target when it lies outside docs/ and is a file, else None."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent
    resolved = (docs / page_src_uri).parent.joinpath(target).resolve()
    if resolved.is_relative_to(docs) or not resolved.is_relative_to(root) or not resolved.is_file():
        return None
    return resolved.relative_to(root).as_posix()


def on_files(files, config):
    seen = set()
    for page in list(files.documentation_pages()):
        text = Path(page.abs_src_path).read_text(encoding="utf-8")
        for _, target, _ in LINK.findall(text):
            path = _outside(config, page.src_uri, target)
            if path is not None and path not in seen:
                seen.add(path)
                copy = RepositoryFile(f"{PREFIX}/{path}", src_dir=None, dest_dir=config["site_dir"],
                                      use_directory_urls=config["use_directory_urls"])
                copy.abs_src_path = str(Path(config["docs_dir"]).resolve().parent / path)
                files.append(copy)
    return files


def on_page_markdown(markdown, page, config, files):
    here = os.path.dirname(page.file.src_uri)

    def point_at_copy(match: re.Match) -> str:
        path = _outside(config, page.file.src_uri, match.group(2))
        if path is None:
            return match.group(0)
        return match.group(1) + os.path.relpath(f"{PREFIX}/{path}", here or ".") + match.group(3)

    return LINK.sub(point_at_copy, markdown)
