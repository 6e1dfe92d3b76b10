"""The documentation's shape: README.md fits a screen's reading and links every page of docs/, and the
layout in docs/contributing.md names every module of hvdp (so it cannot drift from the tree unseen)."""

from __future__ import annotations

import re
from pathlib import Path

from test_imports import hvdp_modules

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
#: README.md holds what hvdp is, the two commands, the training script, the launcher and the API in brief;
#: the depth is in docs/*.md
README_MAX_LINES = 300


def layout_block() -> str:
    text = (REPO / "docs" / "contributing.md").read_text(encoding="utf-8")
    section = text[text.index("## Layout"):]
    return section[section.index("```") + 3:section.index("```", section.index("```") + 3)]


def test_readme_is_at_most_300_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the depth to a page of docs/"


def test_readme_links_every_page_of_docs_and_every_link_resolves():
    text = README.read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]+)?\)", text))
    pages = {p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")}
    assert pages - linked == set(), "pages of docs/ README.md does not link"
    assert linked - pages == set(), "README.md links pages that do not exist"
    for page in sorted((REPO / "docs").glob("*.md")):  # the pages' links to each other and to images
        for target in re.findall(r"\]\(([\w./-]+?)(?:#[\w-]+)?\)", page.read_text(encoding="utf-8")):
            if not target.startswith(("http", "#")):
                assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"


def test_the_layout_names_every_module_of_hvdp():
    block = layout_block()
    words = set(re.findall(r"[\w.]+", block))
    missing = []
    for path in hvdp_modules().values():  # the inserted sources (horovod_build/inserted/) are named as a folder
        if path.name == "__init__.py" and path.parent != REPO / "hvdp":
            continue  # a package by its folder
        if path.name not in words and path.stem not in words:
            missing.append(path.relative_to(REPO).as_posix())
    assert missing == [], f"docs/contributing.md's Layout does not name {missing}"

