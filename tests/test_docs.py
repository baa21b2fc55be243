"""The docs stay short enough to read: README.md and docs/*.md within 2,500 lines, and every
page a page or a docstring cites as ``docs/<page>.md, "<heading>"`` has that heading."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET = 2_500
CITED = re.compile(r'docs/(?P<page>[\w-]+)\.md,\s+"(?P<heading>[^"]+)"')


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_the_docs_stay_within_their_line_budget():
    lines = {page.name: len(page.read_text().splitlines()) for page in pages()}
    assert sum(lines.values()) <= BUDGET, f"{sum(lines.values())} lines > {BUDGET}: {lines}"


def test_every_cited_heading_exists():
    sources = [*pages(), *(p for p in REPO.rglob("*") if p.suffix in (".py", ".sh", ".yaml")
                           and ".venv" not in p.parts and "bench/results" not in str(p))]
    headings = {page.stem: {line.lstrip("#").strip() for line in page.read_text().splitlines()
                            if line.startswith("#")} for page in pages()}
    cited = {(source, m["page"], " ".join(w for w in m["heading"].split() if w != "#"))
             for source in sources if source.is_file()
             for m in CITED.finditer(source.read_text(errors="replace"))}  # across lines too
    missing = sorted(f'{source.relative_to(REPO)}: docs/{page}.md, "{heading}"'
                     for source, page, heading in cited if page in headings
                     and not any(h.startswith(heading) for h in headings[page]))
    assert not missing, "cited headings missing:\n" + "\n".join(missing)
