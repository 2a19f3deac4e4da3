"""Every path a run writes, checked in one place before any work.

The rule: a path the run writes is named by the user as that output (``-o``, ``--report``,
``--plot``) or is a companion pathcond creates beside the checkpoint (its external data, its
shards). It never is, nor is a companion of, a file the run reads: the checkpoint, its shards
or external data, the spec (``--arch`` or a sidecar), the Python source of ``--arch
module:factory`` (exit 6; ``--in-place`` lets the checkpoint, and only it, be replaced). Nor
is it another output of the same run or one of that output's companions (exit 2: the command
line contradicts itself).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError, UsageError
from .companions import SHARD_INDEX_SUFFIX, TAKEN_TAG, TAKEN_TAG_CHARS, preferred_companion
from .fileio import NAME_MAX, check_destination, describe, resolve_destination, same_file

# Messages quote this many characters of a path at most.
SHOWN_CHARS = 200
# Stands for the shard numbers in a shard name (a byte no file name holds).
_NUMBER = "\x00"


@dataclass(frozen=True)
class Written:
    """A file the run will write: the option that names it, the name as typed, and the names
    of the companions pathcond may create beside it (``companion`` matches each; ``longest``
    is the longest such name, or None when the format writes none)."""

    option: str
    name: str
    companion: re.Pattern | None = None
    longest: str | None = None
    # Whether a character device (/dev/null, a terminal) may take the output: text written
    # once (a spec, a report), never a checkpoint, which is read back to be verified.
    devices: bool = False

    @property
    def path(self) -> Path:
        return Path(self.name)


def default_output(path: Path, tag: str = "pathcond") -> Path:
    """``<stem>.<tag><suffix>`` beside ``path``, where a run writes when no output is named (a
    shard index keeps its double suffix)."""
    if path.name.endswith(SHARD_INDEX_SUFFIX):
        return path.with_name(path.name[: -len(SHARD_INDEX_SUFFIX)] + f".{tag}" + SHARD_INDEX_SUFFIX)
    return path.with_name(f"{path.stem}.{tag}{path.suffix}")


def written(
    option: str, name: str | os.PathLike | None, kind: str | None = None, *, devices: bool = False
) -> Written | None:
    """The :class:`Written` for ``name`` given to ``option`` (None when not given); ``kind``
    is the checkpoint format for ``-o`` (its companions follow from it); ``devices``: whether a
    character device may take it."""
    if name is None:
        return None
    text = os.fsdecode(name)
    if kind is None or text in ("", "-"):
        return Written(option, text, devices=devices)
    preferred = preferred_companion(kind, Path(text).name, _NUMBER)
    if preferred is None:
        return Written(option, text)
    stem, dot, suffix = preferred.partition(".")
    pattern = (re.escape(stem) + f"(?:{TAKEN_TAG})?" + re.escape(dot + suffix)).replace(re.escape(_NUMBER), r"\d{5,}")
    longest = preferred.replace(_NUMBER, "0" * 5)
    return Written(option, text, re.compile(pattern, re.DOTALL), longest)


def check_destinations(
    outputs: Sequence[Written | None], reads: Sequence[Path], *, in_place: bool = False, offers_in_place: bool = True
) -> list[Path | None]:
    """Refuse, before any work, every path of ``outputs`` that breaks the rule of this module;
    ``reads`` are the files the run reads, the checkpoint first. Returns each output's path as
    it will be written (a link to a regular file is written through; None where not given).
    ``offers_in_place`` is false for a command without ``--in-place``, whose messages do not offer it."""
    given = [o for o in outputs if o is not None]
    for item in given:
        _check_name(item)
    resolved: dict[int, Path] = {}
    for item in given:
        path = resolve_destination(item.path)
        is_output = item.option == "-o"
        check_destination(
            path, inputs=reads[:1] if is_output else (), in_place=in_place, option=item.option, devices=item.devices
        )
        for source in reads[1:] if is_output else reads:
            if same_file(path, source):
                raise OutputError(
                    f"refusing to overwrite '{_shown(source)}', a file this run reads: choose another "
                    f"{item.option} path"
                    + (
                        " (--in-place lets the output replace the checkpoint, nothing else)."
                        if is_output and offers_in_place
                        else "."
                    )
                )
        for earlier in given[: given.index(item)]:
            clash = _clash(earlier, resolved[id(earlier)], path)
            if clash:
                raise UsageError(
                    f"{item.option} '{_shown(item.name)}' would overwrite {clash}; choose another {item.option} path."
                )
        resolved[id(item)] = path
    return [resolved[id(o)] if o is not None else None for o in outputs]


def _check_name(item: Written) -> None:
    if item.name == "-" and item.option != "-o":
        raise UsageError(
            f"{item.option} - would write to stdout; pathcond writes {item.option} to a file "
            "(--json prints the report on stdout)."
        )
    if item.name.endswith(("/", os.sep)) or item.name in ("", ".", ".."):
        raise OutputError(
            f"cannot write '{_shown(item.name)}': that names a directory; {item.option} takes a file "
            "name (no directory is created)."
        )
    if item.longest is not None and len(os.fsencode(item.longest)) + TAKEN_TAG_CHARS > NAME_MAX:
        raise OutputError(
            f"cannot write '{_shown(item.name)}': the files written beside it ('{_shown(item.longest)}' "
            f"or a tagged variant) would have names longer than {NAME_MAX} bytes; choose a shorter name."
        )


def _clash(earlier: Written, earlier_path: Path, path: Path) -> str | None:
    """What writing ``path`` would overwrite of ``earlier`` (the output itself or a companion)."""
    if same_file(path, earlier_path):
        return f"the file {earlier.option} writes"
    if (
        earlier.companion is not None
        and same_file(path.parent, earlier_path.parent)
        and earlier.companion.fullmatch(path.name)
    ):
        return f"a file written beside the checkpoint ({earlier.option}'s external data or shards)"
    return None


def _shown(path: str | os.PathLike) -> str:
    text = describe(path)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
