"""pathcond: function-preserving PathCond rescaling of ReLU networks."""

__version__ = "0.1.0"
