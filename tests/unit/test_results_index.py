"""``bench/results/README.md`` indexes every current result, and the README and the docs cite
only current results (superseded runs live in ``bench/results/archive/``)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
INDEX = RESULTS / "README.md"


def _index_links() -> list[str]:
    text = INDEX.read_text()
    table = text[text.index("<!-- index -->"):text.index("<!-- /index -->")]
    return re.findall(r"\]\(([^)]+\.md)\)", table)


def _current() -> set[str]:
    return {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*.md")
            if p != INDEX and p.relative_to(RESULTS).parts[0] != "archive"}


def test_every_current_result_is_indexed_once_and_exists():
    links = _index_links()
    assert len(links) == len(set(links)), "a results file is indexed twice"
    assert set(links) == _current(), (f"not indexed: {sorted(_current() - set(links))}; "
                                      f"indexed but missing: {sorted(set(links) - _current())}")
    for link in links:   # each has its figures beside it (or, for a folder, inside it)
        md = RESULTS / link
        assert md.with_suffix(".json").exists(), f"{link} has no {md.with_suffix('.json').name}"


def test_readme_and_docs_cite_only_current_results():
    current = _current() | {"README.md"}   # the index itself
    cited = []
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for page in pages:
        if "_incoming" in page.parts or page.parent.name == "design":
            continue   # design notes tell the history, naming archived runs on purpose
        for name in re.findall(r"(?:bench/results/|bench-results/)([\w/]+\.md)", page.read_text()):
            cited.append(name)
            assert name in current, f"{page.relative_to(REPO)} cites {name}, which is not a current result"
    assert cited, "no page cites a result: the pattern above no longer matches how pages link them"
