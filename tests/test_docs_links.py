"""Every relative link of README.md and docs/*.md points at a file or folder inside the repository.

Pure and fast: reads the Markdown, no network. A link is `[text](target)` (images `![alt](target)` too) or a
reference definition `[label]: target`; links to other sites (any `scheme:`, such as http, https or mailto) and
anchors of the same page (`#...`) are not checked. A target's `#anchor` and `?query` are dropped, `%xx` escapes
decoded, and the rest resolved against the Markdown file's folder (a leading `/` against the repository root, as
GitHub does). Code (fenced blocks and inline spans) is not read for links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# [text](target) or [text](<target>), optionally with a "title"; the text may hold one level of brackets.
INLINE_LINK = re.compile(
    r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text]
    r"\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"  # (target "title")
)
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_targets(text: str) -> list[str]:
    """The link targets of a Markdown text that should name a file of the repository, in order."""

    def blank(match: re.Match[str]) -> str:  # a fenced block becomes its line breaks
        return re.sub(r"[^\n]", " ", match.group(0))

    text = FENCE.sub(blank, text)
    text = INLINE_CODE.sub(lambda m: "x" * len(m.group(0)), text)  # `code` inside a link's text stays text
    targets = [m.group(1) for m in INLINE_LINK.finditer(text)] + [m.group(1) for m in REFERENCE.finditer(text)]
    out = []
    for target in targets:
        target = target.strip("<>").strip()
        if not target or target.startswith("#") or SCHEME.match(target):
            continue
        out.append(target)
    return out


def broken(md: Path, target: str) -> str | None:
    """Why `target`, linked from `md`, names no file or folder inside the repository (None when it does)."""
    path = unquote(re.split(r"[#?]", target, maxsplit=1)[0])
    if not path:
        return None  # `?query` or `#anchor` only: the page itself
    resolved = ((ROOT / path.lstrip("/")) if path.startswith("/") else (md.parent / path)).resolve()
    if not resolved.is_relative_to(ROOT):
        return "outside the repository"
    if not resolved.exists():
        return "no such file or folder"
    return None


def test_relative_links_resolve_inside_the_repository():
    files = markdown_files()
    assert (ROOT / "README.md").is_file() and len(files) > 1, "README.md and docs/*.md should be there"
    problems = []
    checked = 0
    for md in files:
        for target in relative_targets(md.read_text(encoding="utf-8")):
            checked += 1
            why = broken(md, target)
            if why is not None:
                problems.append(f"{md.relative_to(ROOT)}: {target} ({why})")
    assert checked > 0, "no relative link found: the link pattern is broken"
    assert not problems, f"{len(problems)} broken relative link(s):\n" + "\n".join(problems)


def test_readme_links_the_design_doc():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    paths = [unquote(re.split(r"[#?]", t, maxsplit=1)[0]) for t in relative_targets(readme)]
    assert any((ROOT / p).resolve() == ROOT / "docs" / "design.md" for p in paths), (
        "README.md should link docs/design.md (the architecture for newcomers)"
    )


def test_the_link_pattern_finds_what_it_should():
    """The parser itself: inline links, images, titles, angle brackets, references; not code, not other sites."""
    text = (
        "See [a](docs/a.md), ![img](b.png \"title\") and [`code` text](<c d.md#x>).\n"
        "[ref]: e.md\n"
        "Not [web](https://example.org), [mail](mailto:x@y.z), [anchor](#here), `[f](g.md)`.\n"
        "```python\nx = y[0](h.md)\n```\n"
        "[nested [brackets]](i.md)\n"
    )
    assert relative_targets(text) == ["docs/a.md", "b.png", "c d.md#x", "i.md", "e.md"]
