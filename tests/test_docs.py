"""The README is a front page and the docs hold the reference: every link between them resolves (the file, and the
heading an anchor names), and the README stays short enough to read in five minutes."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 200
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[str]:
    """Every markdown page of the project, as paths from the repository's root."""
    docs = sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
    return ["README.md", "bench/RESULTS.md", "bench/README.md"] + docs


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """The anchors of a page's headings (those outside code blocks)."""
    found, in_code = set(), False
    for line in open(path).read().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            found.add(slug(line.lstrip("#")))
    return found


def broken_links(page: str, text: str) -> list[str]:
    """Each link of ``text`` (the content of ``page``) whose file or heading does not exist, with the reason."""
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue  # nothing outside the repository is linked to be checked offline
        path, _, anchor = target.partition("#")
        resolved = (
            os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
        )
        if not os.path.exists(resolved):
            broken.append(f"{page}: {target}: no such file")
        elif anchor and (not resolved.endswith(".md") or anchor not in anchors(resolved)):
            broken.append(f"{page}: {target}: no heading #{anchor}")
    return broken


def test_every_docs_link_resolves():
    broken = [b for page in pages() for b in broken_links(page, open(os.path.join(ROOT, page)).read())]
    assert broken == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading():
    text = "[a](docs/training.md) [b](docs/nowhere.md) [c](docs/training.md#no-such-heading) [d](#dependencies)"
    assert broken_links("README.md", text) == [
        "README.md: docs/nowhere.md: no such file",
        "README.md: docs/training.md#no-such-heading: no heading #no-such-heading",
    ]


def test_slug_follows_github():
    assert slug(" Loader (`python -m bench.loader`)") == "loader-python--m-benchloader"
    assert slug(" Memory planner: the rtx5080 preset") == "memory-planner-the-rtx5080-preset"


def test_the_readme_is_a_front_page():
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    assert len(lines) <= README_MAX_LINES
    linked = set(LINK.findall("\n".join(lines)))
    for page in pages()[2:]:
        assert any(target.split("#")[0] == page for target in linked), f"the README does not link {page}"
