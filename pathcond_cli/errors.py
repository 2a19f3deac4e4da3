"""Errors pathcond raises, each with the process exit code the CLI maps it to."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Problems a message lists before it counts the others: a long list would bury the lines that
# close the message (why, and what to do). ``complete`` lists them all; --json prints it.
PROBLEMS_SHOWN = 10


class PathcondError(Exception):
    """Base class: a clear, one-paragraph message for the user and a distinct exit code.

    ``message`` says what is wrong; ``problems`` (one line each) are its instances, of which
    the first :data:`PROBLEMS_SHOWN` are listed and the others counted; ``note`` closes the
    paragraph (why, and what would help) and is always given whole. ``follow_on`` are problems
    that only follow from those (counted, never listed). ``complete`` is the paragraph with
    every problem listed, as --json prints it.
    """

    exit_code = 1

    def __init__(
        self,
        message: str,
        problems: Sequence[str] = (),
        note: str | None = None,
        *,
        follow_on: Sequence[str] = (),
        follow_on_meaning: str = "",
    ):
        root = list(problems)
        self.message, self.note, self.follow_on = message, note, list(follow_on)
        self.problems = root + self.follow_on
        closing = [note] if note else []
        self.complete = "\n".join([message, *(f"  - {p}" for p in self.problems), *closing])
        lines = [f"  - {p}" for p in root[:PROBLEMS_SHOWN]]
        if len(root) > PROBLEMS_SHOWN:
            lines.append(
                f"  and {len(root) - PROBLEMS_SHOWN} more problem(s) (all listed with --json; "
                "in the API, the error's problems)"
            )
        if self.follow_on:
            lines.append(
                f"  and {len(self.follow_on)} more problem(s){follow_on_meaning} (listed with --json; in "
                "the API, the error's follow_on)"
            )
        super().__init__("\n".join([message, *lines, *closing]))


class UsageError(PathcondError):
    """The call itself is wrong (an option, an argument, two outputs naming one file), whatever the files hold:
    exit 2, like the CLI's own."""

    exit_code = 2


class InputError(PathcondError):
    """The model file, spec or checkpoint cannot be read or does not match its description."""

    exit_code = 3


class UnsupportedModelError(PathcondError):
    """The network is readable but is not a ReLU DAG that pathcond can rescale exactly."""

    exit_code = 4

    def __init__(
        self,
        message: str,
        problems: list[str] | None = None,
        follow_on: list[str] | None = None,
        note: str | None = None,
    ):
        """``problems`` are the root causes; ``follow_on`` the problems of nodes that only read
        the output of a refused node (counted in the message; ``complete`` lists them all);
        ``note`` a paragraph closing the message (why, and what would help), given once."""
        super().__init__(
            message,
            problems or [],
            note,
            follow_on=follow_on or [],
            follow_on_meaning=" in nodes that read the output of those above, consequences of them",
        )


class VerificationError(PathcondError):
    """The rescaled model does not compute the original function within tolerance."""

    exit_code = 5


class OutputError(PathcondError):
    """The output cannot be written (missing directory, permissions, disk full, input clash)."""

    exit_code = 6


class InvalidWeightsError(PathcondError):
    """A parameter tensor holds NaN or Inf."""

    exit_code = 7


class StorageError(PathcondError):
    """The rescaled tensors cannot be held by the checkpoint's dtypes (values would overflow or be
    flushed below the smallest normal): with ``--max-log-scale none`` or a bound of the user's."""

    exit_code = 8


class SingularBasisError(PathcondError):
    """G-SGD's basis-path coordinates are singular: a skeleton-path value is (or a step would make
    it) 0, or a product of skeleton weights leaves the dtype's range."""


class MismatchError(PathcondError):
    """Two models that must share one architecture (``compare``) do not: another DAG, other
    tensor names or shapes."""

    exit_code = 10


EXIT_CODES = {
    "success": 0,
    "usage": UsageError.exit_code,
    "unreadable_input": InputError.exit_code,
    "unsupported_model": UnsupportedModelError.exit_code,
    "verification_failed": VerificationError.exit_code,
    "output_not_written": OutputError.exit_code,
    "invalid_weights": InvalidWeightsError.exit_code,
    "not_storable": StorageError.exit_code,
    "models_differ": MismatchError.exit_code,
    "interrupted": 130,
    "terminated": 143,
    "several_failures": 9,
}


def batch_exit_code(failures: Iterable[int]) -> int:
    """The exit status of a run over several files, from the exit codes of those that failed:
    0 when none failed, the code they share when every failure has the same one, else 9."""
    codes = set(failures)
    if not codes:
        return EXIT_CODES["success"]
    if len(codes) == 1:
        return codes.pop()
    return EXIT_CODES["several_failures"]
