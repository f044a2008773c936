"""Checks the relative links of Markdown files: every `](path)` target exists, every `#anchor` is a heading.

    python docs/check_links.py                 # README.md, DEVELOPERS.md and docs/*.md
    python docs/check_links.py FILE.md ...     # those files

Anchors are GitHub's: the heading lowercased, punctuation but hyphens and underscores dropped, spaces
as hyphens, a repeated heading suffixed -1, -2, ... Links to http(s) and mailto are not checked.
Exits 1 and lists what is broken.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    out = []
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.extend(LINK.findall(line))
    return out


def broken(path: Path) -> list[str]:
    wrong = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            wrong.append(f"{path.relative_to(REPO)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            wrong.append(f"{path.relative_to(REPO)}: {target}: no heading #{anchor}")
    return wrong


def main(argv: list[str]) -> int:
    files = [Path(a).resolve() for a in argv] or [
        REPO / "README.md",
        REPO / "DEVELOPERS.md",
        *sorted((REPO / "docs").glob("*.md")),
    ]
    wrong = [w for f in files for w in broken(f)]
    count = sum(len(links(f)) for f in files)
    for w in wrong:
        print(w)
    print(f"{len(files)} files, {count} links, {len(wrong)} broken")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
