"""The files a command writes into its report folder: the JSON document through
`ringcheck.documents.save`, and its presentations beside it."""

from __future__ import annotations

from pathlib import Path

from ..documents import save
from .html import drift_html, validate_html
from .markdown import drift_markdown, validate_markdown
from .train_report import train_html, train_markdown


def write_validate_reports(doc: dict, out_dir: str | Path) -> dict[str, Path]:
    """validate.json, validate.md and validate.html in `out_dir`; returns their paths."""
    out = Path(out_dir)
    paths = {"json": save(doc, out / "validate.json"), "md": out / "validate.md", "html": out / "validate.html"}
    paths["md"].write_text(validate_markdown(doc), encoding="utf-8")
    paths["html"].write_text(validate_html(doc), encoding="utf-8")
    return paths


def write_drift_reports(doc: dict, out_dir: str | Path) -> dict[str, Path]:
    """drift.json, drift.md and drift.html in `out_dir`; returns their paths."""
    out = Path(out_dir)
    paths = {"json": save(doc, out / "drift.json"), "md": out / "drift.md", "html": out / "drift.html"}
    paths["md"].write_text(drift_markdown(doc), encoding="utf-8")
    paths["html"].write_text(drift_html(doc), encoding="utf-8")
    return paths


def write_train_reports(doc: dict, out_dir: str | Path) -> dict[str, Path]:
    """train.json, train.md and train.html in `out_dir`; returns their paths."""
    out = Path(out_dir)
    paths = {"json": save(doc, out / "train.json"), "md": out / "train.md", "html": out / "train.html"}
    paths["md"].write_text(train_markdown(doc), encoding="utf-8")
    paths["html"].write_text(train_html(doc), encoding="utf-8")
    return paths
