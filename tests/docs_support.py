"""The documentation as data: README.md and docs/*.md, their sections and fenced blocks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.S | re.M)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    text: str
    followed_by: Block | None = None  # the block right after this one, with only blank lines between

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.language})"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, in order, each knowing the block that follows it."""
    source = page.read_text(encoding="utf-8")
    matches = list(FENCE.finditer(source))
    built: list[Block] = []  # from the last block back, so the next one is built first
    for match, after in reversed(list(zip(matches, [*matches[1:], None]))):
        indent = len(match.group(1))
        text = "".join(line[indent:] + "\n" for line in match.group(3).splitlines())
        adjacent = after is not None and not source[match.end() : after.start()].strip()
        built.append(
            Block(page, source.count("\n", 0, match.start()) + 1, match.group(2), text, built[-1] if adjacent else None)
        )
    return built[::-1]


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


def section(heading: str) -> str:
    """The text under the first heading (any level) named ``heading`` in the README or docs/,
    up to the next heading of the same or a higher level."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        match = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.M)
        if match:
            rest = text[match.end() :]
            end = re.search(rf"^#{{1,{len(match.group(1))}}} ", rest, re.M)
            return rest[: end.start()] if end else rest
    raise AssertionError(f"no section {heading!r} in README.md or docs/")
