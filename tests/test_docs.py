"""The docs stay short enough to read: README.md and docs/*.md within 2,500 lines, and every
``docs/<page>.md, "<heading>"`` a page, a docstring, a script or a configuration cites
(backticked or not, across a line break or a comment's ``#``) names a page that exists and
a heading on it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET = 2_500
CITED = re.compile(r'`?docs/(?P<page>[\w-]+)\.md`?,\s+"(?P<heading>[^"]+)"')


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def headings(page: Path) -> set[str]:
    """The Markdown headings of ``page``, outside its code blocks."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            found.add(line.lstrip("#").strip())
    return found


def citations() -> set[tuple[str, str, str]]:
    """(citing file, page, heading) over the repository's text files."""
    sources = [*pages(), *(p for p in REPO.rglob("*") if p.suffix in (".py", ".sh", ".yaml")
                           and not {".venv", "results"} & set(p.parts) and p.is_file())]
    return {(str(source.relative_to(REPO)), m["page"],
             " ".join(word for word in m["heading"].split() if word != "#"))
            for source in sources for m in CITED.finditer(source.read_text(errors="replace"))}


def test_the_docs_stay_within_their_line_budget():
    lines = {page.name: len(page.read_text().splitlines()) for page in pages()}
    assert sum(lines.values()) <= BUDGET, f"{sum(lines.values())} lines > {BUDGET}: {lines}"


def test_every_cited_heading_exists():
    on_page = {page.stem: headings(page) for page in pages()}
    found = citations()
    assert len(found) >= 30  # the pattern reads the citations the tree holds
    missing = sorted(f'{source}: docs/{page}.md, "{heading}"' for source, page, heading in found
                     if not any(h.startswith(heading) for h in on_page.get(page, ())))
    assert not missing, "cited headings missing:\n" + "\n".join(missing)
