"""Every relative link in README.md and docs/*.md resolves: the file (or folder) exists in the
repository, and a ``#fragment`` names a heading of the file it points into. Links inside code
blocks and inline code are text, not links; ``http(s)://`` and ``mailto:`` links are not fetched."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def links(text: str) -> list[str]:
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    return LINK.findall(prose)


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors: each heading lower-cased, punctuation but ``-`` and ``_`` dropped,
    spaces made ``-``; a repeated heading gets ``-1``, ``-2``, ..."""
    anchors: set[str] = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def broken_links(doc: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in links(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        resolved = (doc.parent / path_part).resolve() if path_part else doc
        if not resolved.is_relative_to(root) or not resolved.exists():
            broken.append(f"{target}: no such file in the repository")
        elif fragment and resolved.suffix == ".md" and fragment not in heading_anchors(resolved.read_text()):
            broken.append(f"{target}: {resolved.name} has no heading #{fragment}")
    return broken


@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_every_relative_link_resolves(doc: Path) -> None:
    assert not broken_links(doc), broken_links(doc)


def test_docs_readme_links_every_page_of_docs() -> None:
    readme = set(links((ROOT / "README.md").read_text()))
    missing = [p.name for p in documents()[1:] if f"docs/{p.name}" not in readme]
    assert not missing, f"README.md does not link {missing}"


def test_docs_link_check_reports_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# Title\n\n## The `[updates]` table\n")
    doc = tmp_path / "page.md"
    doc.write_text(
        "[ok](there.md) [ok](there.md#the-updates-table) [ok](#own) `[code](nowhere.md)`\n\n"
        "```\n[fenced](nowhere.md)\n```\n\n# Own\n\n"
        "[gone](missing.md) [bad anchor](there.md#nope) [web](https://example.com/x.md)\n"
    )
    assert broken_links(doc, root=tmp_path) == [
        "missing.md: no such file in the repository",
        "there.md#nope: there.md has no heading #nope",
    ]
    outside = tmp_path / "sub"
    outside.mkdir()
    (outside / "page.md").write_text("[up](../there.md)\n")
    assert broken_links(outside / "page.md", root=outside) == ["../there.md: no such file in the repository"]
