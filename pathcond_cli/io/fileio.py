"""Safe file writes: staged beside the target, fsynced, renamed into place only when verified.

Every temporary file or directory pathcond creates carries its process id and a tag of its
machine's name in its name (``.<name>.pid<PID>h<HOST>.<random>.pathcond-tmp``), so that one
left behind by a killed process is recognised and removed by the next run on that machine in
that directory, and only when that process is gone. A run on another machine sharing the
folder (a job array) cannot tell whether the process lives, and leaves it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ..errors import OutputError
from .companions import COMPANION_TAG_BYTES

# Every temporary file or directory pathcond creates beside an output ends with this.
TMP_SUFFIX = ".pathcond-tmp"
# Most file systems limit one path component to 255 bytes.
NAME_MAX = 255
# The staging name repeats the target's name; cut it so the staging name stays under NAME_MAX.
_STAGED_NAME_BYTES = 120
# How a failed write ends its message; the CLI replaces it when an earlier output of the run was written.
NOTHING_WRITTEN = "Nothing was written."
# Files renamed into place by this process (the CLI says so when interrupted afterwards).
written_files: list[Path] = []
# A name without the machine's tag (an earlier version's) is taken as this machine's.
_STALE = re.compile(r"^\..*\.pid(\d+)(?:h([0-9a-f]{8}))?\.[^.]*" + re.escape(TMP_SUFFIX) + "$", re.DOTALL)


def describe(path: os.PathLike | str) -> str:
    """A path as it can be printed on any terminal (undecodable bytes shown as escapes)."""
    text = os.fsdecode(path)
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no file-name byte decodes to
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def printable(text: str, *, keep: str = "") -> str:
    """``text`` as it can be shown on a terminal: undecodable bytes and every control or format
    character (ESC, BEL, CR, bidirectional overrides, ...) but those in ``keep`` as backslash
    escapes, so that a name read from a file cannot drive the terminal."""
    shown = describe(text)
    if shown.translate(dict.fromkeys(map(ord, keep))).isprintable():  # the common case, without a loop per character
        return shown
    return "".join(c if c.isprintable() or c in keep else c.encode("unicode_escape").decode("ascii") for c in shown)


# A stream is read this many bytes at a time: what is allocated is what arrived, not the most
# that may (a read of n bytes allocates n at once, which an address-space limit refuses).
STREAM_CHUNK_BYTES = 1 << 24


def read_within(stream: BinaryIO, limit: int) -> bytes | None:
    """Everything ``stream`` holds, or None as soon as more than ``limit`` bytes arrived."""
    chunks, size = [], 0
    while chunk := stream.read(min(STREAM_CHUNK_BYTES, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return None
    return b"".join(chunks)


def resolve_destination(destination: Path) -> Path:
    """Where writing ``destination`` really lands: a symlink to a regular file is written through."""
    with contextlib.suppress(OSError):
        if destination.is_symlink() and stat.S_ISREG(os.stat(destination).st_mode):
            return Path(os.path.realpath(destination))
    return destination


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file: the same resolved path or the same inode."""
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def check_destination(
    destination: Path, *, inputs: Iterable[Path] = (), in_place: bool = False, option: str = "-o", devices: bool = False
) -> None:
    """Refuse before any work: a missing or unwritable directory, a name too long, something that
    is not a regular file (directory, FIFO, device, socket, or a link to one), or an input file.
    With ``devices``, a character device (/dev/null, a terminal) is accepted: it is written
    directly (see :func:`atomic_write`)."""
    if devices and is_character_device(destination):
        return
    shown = describe(destination)
    if len(os.fsencode(destination.name)) > NAME_MAX:
        raise OutputError(f"cannot write '{shown[:80]}...': the file name is longer than {NAME_MAX} bytes.")
    directory = destination.parent if str(destination.parent) else Path(".")
    try:
        if not directory.is_dir():
            raise OutputError(f"cannot write '{shown}': directory '{describe(directory)}' does not exist.")
        if not os.access(directory, os.W_OK):
            raise OutputError(f"cannot write '{shown}': no write permission in directory '{describe(directory)}'.")
        kind = _non_regular_kind(destination)
    except OSError as exc:
        raise OutputError(f"cannot write '{shown}': {_reason(exc)}.") from None
    if kind is not None:
        raise OutputError(
            f"cannot write '{shown}': it is {kind}, not a regular file; pathcond only replaces regular files"
            + (
                " (a checkpoint is read back from its file to be verified)"
                if kind.startswith("a character device") and not devices
                else ""
            )
            + f". Choose another {option} path."
        )
    if not in_place:
        for source in inputs:
            if same_file(destination, source):
                raise OutputError(
                    f"refusing to overwrite '{describe(source)}', a file of the input: choose another -o path, "
                    "or pass --in-place to replace the input deliberately."
                )


def file_state(path: Path) -> tuple[int, int, int, int] | None:
    """Device, inode, size and modification time of the file ``path`` names (None if it names
    none): what tells that a file was written or replaced since it was read."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def check_unchanged(states: dict[Path, tuple[int, int, int, int] | None]) -> None:
    """Refuse to replace input files that another process wrote or replaced since they were read
    (``states``: :func:`file_state` of each when read): replacing them would lose that write."""
    for path, state in states.items():
        if file_state(path) != state:
            raise OutputError(
                f"refusing to replace '{describe(path)}': another process wrote or replaced it since pathcond read "
                f"it, so it is left as it is. {NOTHING_WRITTEN}"
            )


def check_output_directory(directory: Path) -> None:
    """Refuse before any work an ``--output-dir`` that is missing, not a directory or not writable."""
    shown = describe(directory)
    try:
        if not directory.is_dir():
            reason = "is not a directory" if os.path.lexists(directory) else "does not exist (create it first)"
            raise OutputError(f"cannot write into '{shown}': it {reason}. Nothing was written.")
        if not os.access(directory, os.W_OK):
            raise OutputError(f"cannot write into '{shown}': no write permission. Nothing was written.")
    except OSError as exc:
        raise OutputError(f"cannot write into '{shown}': {_reason(exc)}. Nothing was written.") from None


@dataclass
class PlannedOutput:
    """One file of a run over several: the input as named, every file it reads, where it goes."""

    source: Path
    inputs: list[Path]
    destination: Path


def check_batch_destinations(planned: Sequence[PlannedOutput], *, in_place: bool = False) -> None:
    """Refuse before any work a run over several files whose outputs collide: two inputs written
    to one file, or an output that is a file some other input reads (or, without ``in_place``,
    its own input). Files are compared as :func:`same_file` does, by resolved path and by inode."""
    owners: dict[tuple, int] = {}
    for index, plan in enumerate(planned):
        for key in _identities(plan.destination):
            other = owners.setdefault(key, index)
            if other != index and same_file(planned[other].source, plan.source):
                raise OutputError(
                    f"refusing to write: '{describe(plan.source)}' is given twice (also as "
                    f"'{describe(planned[other].source)}'). Nothing was written; give each file once."
                )
            if other != index:
                raise OutputError(
                    f"refusing to write: '{describe(planned[other].source)}' and '{describe(plan.source)}' would "
                    f"both be written to '{describe(plan.destination)}'. Nothing was written; rename one of them "
                    "or process them into different output directories."
                )
    for index, plan in enumerate(planned):
        for path in plan.inputs:
            owner = next((owners[key] for key in _identities(path) if key in owners), None)
            if owner is None or (in_place and owner == index):
                continue
            whose = "its own input" if owner == index else f"an input of '{describe(plan.source)}'"
            raise OutputError(
                f"refusing to overwrite '{describe(path)}', {whose}, with the output of "
                f"'{describe(planned[owner].source)}'. Nothing was written; choose another output directory."
            )


def _identities(path: Path) -> list[tuple]:
    """What makes two names one file: the resolved path and, for a file that exists, its inode."""
    keys: list[tuple] = [("path", os.path.realpath(path))]
    with contextlib.suppress(OSError, ValueError):
        status = os.stat(path)
        keys.append(("inode", status.st_dev, status.st_ino))
    return keys


def _non_regular_kind(path: Path) -> str | None:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a dangling symbolic link" if os.path.islink(path) else None
    if stat.S_ISREG(mode):
        return None
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind + (" (through a symbolic link)" if os.path.islink(path) else "")
    return "not a regular file"


def remove_stale_staging(directory: Path) -> None:
    """Delete pathcond staging files and directories in ``directory`` whose process is gone."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        match = _STALE.match(entry.name)
        if match is None or match.group(2) not in (None, _host_tag()) or _process_alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _host_tag() -> str:
    """This machine's name, hashed to 8 hex digits: a process id only means something there."""
    return hashlib.sha256(socket.gethostname().encode("utf-8", "surrogateescape")).hexdigest()[:8]


def _staging_prefix(destination: Path) -> str:
    # Cut in bytes (a character of the name may take four); undecodable bytes are dropped.
    name = os.fsencode(destination.name)[:_STAGED_NAME_BYTES].decode("utf-8", "ignore")
    return f".{name}.pid{os.getpid()}h{_host_tag()}."


@contextlib.contextmanager
def atomic_path(destination: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``destination``; rename it into place only on success.

    Any exception (a failed write, a full disk, Ctrl-C) removes the temporary file and leaves
    ``destination`` as it was.
    """
    destination = Path(destination)
    directory = destination.parent if str(destination.parent) else Path(".")
    remove_stale_staging(directory)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=_staging_prefix(destination), suffix=TMP_SUFFIX, dir=directory)
        os.close(fd)
    except OSError as exc:
        raise output_error_from(exc, destination) from None
    tmp = Path(tmp_name)
    try:
        yield tmp
        _fsync_file(tmp)
        _set_mode(tmp, destination)
        with interrupts_deferred():
            os.replace(tmp, destination)
            if not directory.name.endswith(TMP_SUFFIX):
                written_files.append(destination)
        _fsync_directory(directory)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise output_error_from(exc, destination) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass
class Stage:
    """A hidden staging directory beside ``destination`` (see :func:`staged_output`).

    ``path`` is where the main file is written. A format that writes companion files (shards,
    ONNX external data) names them with :meth:`companion_name`, which never picks a name
    already present in the destination's directory: companions never replace anything, so the
    file on disk that names them (the index, the ``.onnx``) is the only thing swapped.
    ``obsolete`` lists files to delete once the swap is done (the companions of the checkpoint
    that was replaced).
    """

    destination: Path
    directory: Path
    path: Path
    obsolete: list[Path] = field(default_factory=list)
    keep: list[Path] = field(default_factory=list)
    committed: bool = False

    def companion_name(self, preferred: str) -> str:
        taken = {p.name for p in self.path.parent.iterdir()}
        if preferred not in taken and not os.path.lexists(self.directory / preferred):
            return preferred
        stem, dot, suffix = preferred.partition(".")
        while True:
            candidate = f"{stem}-{secrets.token_hex(COMPANION_TAG_BYTES)}{dot}{suffix}"
            if candidate not in taken and not os.path.lexists(self.directory / candidate):
                return candidate


# What a user or a scheduler sends to stop a run: Ctrl-C, and Slurm, Kubernetes or `kill` at a time limit.
INTERRUPTING_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) and SIGTERM back for the block; a signal that arrives is delivered,
    not lost, when the block ends.

    Used where an interrupt must not land: between renaming a file into place and recording it
    as written (the report of what is on disk stays true), and inside the C++ initialisation of
    torch and onnxruntime, where a KeyboardInterrupt raised by the handler was measured to abort
    the process (pybind11 terminate) or to be swallowed by an import fallback. The Python-level
    handlers are swapped for ones that only take note, rather than the signals masked: a signal
    sent to the process goes to any thread that does not mask it, and torch runs threads of its
    own. Only the main thread handles signals, so elsewhere there is nothing to hold back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = {
        signum: signal.signal(signum, lambda received, frame: held.append(received)) for signum in INTERRUPTING_SIGNALS
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if held:
            signal.raise_signal(held[0])


# Open blocks of :func:`interrupts_held_once_written`, innermost last: each is its held signals
# and, once an output was committed inside it, the handlers to restore (None until then).
_holding: list[dict] = []


@contextlib.contextmanager
def interrupts_held_once_written() -> Iterator[None]:
    """Within the block, from the moment a staged output is renamed into place, Ctrl-C and
    SIGTERM are held back until the block ends (then delivered, not lost): a run over several
    files reports each file it completely wrote (its JSON line) before an interrupt stops it."""
    state: dict = {"held": [], "previous": None}
    _holding.append(state)
    try:
        yield
    finally:
        _holding.remove(state)
        if state["previous"] is not None:
            for signum, handler in state["previous"].items():
                signal.signal(signum, handler)
            if state["held"]:
                signal.raise_signal(state["held"][0])


def _hold_from_now() -> None:
    """Start holding interrupts until the innermost :func:`interrupts_held_once_written` ends."""
    if not _holding or threading.current_thread() is not threading.main_thread():
        return
    state = _holding[-1]
    if state["previous"] is None:
        held = state["held"]
        state["previous"] = {
            signum: signal.signal(signum, lambda received, frame: held.append(received))
            for signum in INTERRUPTING_SIGNALS
        }


@contextlib.contextmanager
def staged_output(destination: Path) -> Iterator[Stage]:
    """Yield a :class:`Stage` for ``destination`` inside a fresh hidden directory beside it.

    The caller writes ``stage.path`` (and companions) and checks what it wrote; only when the
    block succeeds is every staged file fsynced and renamed into ``destination``'s directory,
    companions first (under names no file has there) and ``destination`` last; then the files
    in ``stage.obsolete`` are deleted. On any failure (an exception, a failed verification,
    Ctrl-C) before the last rename, the staging directory and any companion already moved are
    deleted and ``destination`` — which may be the input itself with ``--in-place`` — is left
    untouched. At every instant, ``destination`` names a complete checkpoint.
    """
    destination = Path(destination)
    directory = destination.parent if str(destination.parent) else Path(".")
    remove_stale_staging(directory)
    try:
        stage_dir = Path(tempfile.mkdtemp(prefix=_staging_prefix(destination), suffix=TMP_SUFFIX, dir=directory))
    except OSError as exc:
        raise output_error_from(exc, destination) from None
    stage = Stage(destination, directory, stage_dir / destination.name)
    moved: list[Path] = []
    try:
        yield stage
        companions = sorted(p for p in stage_dir.iterdir() if p != stage.path and not p.name.endswith(TMP_SUFFIX))
        try:
            for path in [*companions, stage.path]:
                _fsync_file(path)
            for path in companions:
                final = directory / path.name
                if os.path.lexists(final):
                    raise OSError(errno.EEXIST, f"'{describe(final)}' appeared while writing")
                _set_mode(path, final)
                os.replace(path, final)
                moved.append(final)
            _fsync_directory(directory)
            _set_mode(stage.path, destination)
            _hold_from_now()  # first: the deferral below restores the handlers it found
            with interrupts_deferred():
                os.replace(stage.path, destination)
                stage.committed = True
                if not directory.name.endswith(TMP_SUFFIX):
                    written_files.append(destination)
            _fsync_directory(directory)
        except OSError as exc:
            raise output_error_from(exc, destination) from None
        keep = {os.path.realpath(p) for p in [*moved, destination, *stage.keep]}
        for old in stage.obsolete:
            if os.path.realpath(old) not in keep:
                with contextlib.suppress(OSError):
                    os.unlink(old)
    except OutputError as exc:
        # Name the file the user asked for, not the hidden staging directory.
        raise OutputError(str(exc).replace(str(stage.path), describe(destination))) from None
    finally:
        if not stage.committed:
            for path in moved:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        shutil.rmtree(stage_dir, ignore_errors=True)


def atomic_write(destination: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp_path)`` and move the result onto ``destination`` atomically; a character
    device (/dev/null, a terminal), which cannot be replaced, is written directly."""
    if is_character_device(destination):
        try:
            write(Path(destination))
        except OSError as exc:
            raise output_error_from(exc, Path(destination)) from None
        return
    with atomic_path(destination) as tmp:
        write(tmp)


def is_character_device(path: Path | str) -> bool:
    """Whether ``path`` names a character device (through links)."""
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def output_error_from(exc: OSError, destination: Path) -> OutputError:
    """An OSError met while writing ``destination``, as the exit-6 error users read."""
    return OutputError(f"cannot write '{describe(destination)}': {_reason(exc)}. {NOTHING_WRITTEN}")


def _set_mode(path: Path, final: Path) -> None:
    """Keep an existing file's permissions; a new file gets the umask's."""
    try:
        mode = os.stat(final).st_mode & 0o777 if os.path.isfile(final) else 0o666 & ~_umask()
    except OSError:
        mode = 0o666 & ~_umask()
    os.chmod(path, mode)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable; some file systems cannot fsync a directory, which is harmless."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "the disk is full"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.ENAMETOOLONG:
        return "the file name is too long"
    return exc.strerror or str(exc)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
