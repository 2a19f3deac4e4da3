"""The options of a solve, validated once: the command line, the API and the solvers all take a
:class:`SolveOptions`. Kept free of heavy imports so that ``pathcond --help`` can show the names
and defaults without loading torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UsageError

SOLVERS = ("newton", "block", "lbfgs", "sequential")
BOUNDED_SOLVERS = ("newton", "block", "sequential")
DEFAULT_SOLVER = "newton"
DEFAULT_TOL = 1e-6
DEFAULT_MAX_ITER = 1000

CRITERIA = ("pathcond", "enorm")
DEFAULT_CRITERION = "pathcond"
# prune's criteria, here so that the command line checks them without loading torch.
PRUNING_CRITERIA = ("path-magnitude", "magnitude")

# How the bound on |u_h| is chosen: the largest the checkpoint's dtypes can store (auto), none, or the user's.
AUTO, NONE, USER = "auto", "none", "user"


class InvalidOption(UsageError, ValueError):
    """An option outside its domain (exit 2). ``option`` is its command-line spelling."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def parse_bound(value: float | str | None) -> tuple[str, float | None]:
    """The rule and the fixed bound of ``max_log_scale``: ``'auto'``, ``'none'`` or None, or a number ≥ 0."""
    if value is None:
        return NONE, None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in (AUTO, NONE):
            return text, None
        try:
            value = float(text)
        except ValueError:
            raise InvalidOption(
                "--max-log-scale", f"max_log_scale must be 'auto', 'none' or a number ≥ 0, not {value!r}"
            ) from None
    bound = float(value)
    if not (math.isfinite(bound) and bound >= 0):
        raise InvalidOption(
            "--max-log-scale", f"max_log_scale must be 'auto', 'none' or a finite number ≥ 0, not {value!r}"
        )
    return USER, bound


@dataclass(frozen=True)
class SolveOptions:
    """What to minimise and how: the criterion, PathCond's solver, the stopping rule and the bound on
    every |u_h| (``max_log_scale``: ``'auto'``, ``'none'``/None or a number ≥ 0, see :mod:`.bounds`).
    Constructing one validates it (:class:`InvalidOption`); ``dataclasses.replace`` validates again."""

    criterion: str = DEFAULT_CRITERION
    solver: str = DEFAULT_SOLVER
    tol: float = DEFAULT_TOL
    max_iter: int = DEFAULT_MAX_ITER
    max_log_scale: float | str | None = AUTO

    def __post_init__(self) -> None:
        if self.criterion not in CRITERIA:
            raise InvalidOption(
                "--criterion", f"unknown criterion '{self.criterion}'; choose one of {', '.join(CRITERIA)}"
            )
        if self.solver not in SOLVERS:
            raise InvalidOption("--solver", f"unknown solver '{self.solver}'; choose one of {', '.join(SOLVERS)}")
        if self.criterion == "enorm" and self.solver != DEFAULT_SOLVER:
            raise InvalidOption(
                "--solver",
                f"solver '{self.solver}' minimises PathCond; ENorm (criterion 'enorm') has "
                "its own closed-form block updates",
            )
        if not (isinstance(self.tol, (int, float)) and math.isfinite(self.tol) and self.tol >= 0):
            raise InvalidOption("--tol", f"{self.tol} is not a finite tolerance ≥ 0")
        if not (isinstance(self.max_iter, int) and self.max_iter >= 0):
            raise InvalidOption("--max-iter", f"{self.max_iter} is not an iteration count ≥ 0")
        rule, bound = parse_bound(self.max_log_scale)
        if rule == USER and self.criterion == "enorm":
            raise InvalidOption(
                "--max-log-scale",
                "max_log_scale bounds PathCond's solvers; ENorm's closed-form updates "
                "(criterion 'enorm') take no bound",
            )
        if rule == USER and self.solver not in BOUNDED_SOLVERS:
            raise InvalidOption(
                "--solver",
                f"solver '{self.solver}' is unconstrained; with a maximum log scale use one "
                f"of {', '.join(BOUNDED_SOLVERS)}",
            )

    @property
    def bound_rule(self) -> str:
        """``auto``, ``none`` or ``user``; ENorm takes no bound, so its rule is always ``none``."""
        return NONE if self.criterion == "enorm" else parse_bound(self.max_log_scale)[0]

    @property
    def bound(self) -> float | None:
        """The user's bound on every |u_h|, or None."""
        return parse_bound(self.max_log_scale)[1]
