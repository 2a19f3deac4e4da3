"""Criterion and solver names and defaults, kept free of heavy imports so that ``pathcond --help`` can show
them without loading torch."""

SOLVERS = ("newton", "block", "lbfgs", "sequential")
BOUNDED_SOLVERS = ("newton", "block", "sequential")
DEFAULT_SOLVER = "newton"
DEFAULT_TOL = 1e-6
DEFAULT_MAX_ITER = 1000

CRITERIA = ("pathcond", "enorm")
DEFAULT_CRITERION = "pathcond"
