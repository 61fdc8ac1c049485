"""Links between the project's Markdown files: every relative link names a file that exists, and an
anchor (``file.md#heading``) a heading of that file, as GitHub turns headings into anchors."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DOCUMENTS = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md"), *(REPO / "web" / "docs").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor of a document; a repeated heading gets -1, -2... as on GitHub."""
    found, seen = set(), {}
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = anchor(heading)
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return found


def broken_links(document: Path) -> list[str]:
    text = document.read_text()
    broken = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, fragment = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(REPO) if linked.is_relative_to(REPO) else linked}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked.read_text()):
            broken.append(f"{target}: no heading of {linked.name} has the anchor #{fragment}")
    return broken


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_link_reaches_its_file_and_heading(document):
    assert not broken_links(document)


def test_anchors_follow_github(tmp_path):
    assert anchor("Soak (`python -m sdopt soak`)") == "soak-python--m-sdopt-soak"
    assert anchor("Why compile + graph stops at 130 it/s") == "why-compile--graph-stops-at-130-its"
    assert anchors("# A\n\n## A\n\n```\n# not a heading\n```\n") == {"a", "a-1"}
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](#nothing) [file](missing.md) [web](https://example.com/x)\n")
    assert broken_links(page) == ["#nothing: no heading of page.md has the anchor #nothing", "missing.md: no file " + str(tmp_path / "missing.md")]
