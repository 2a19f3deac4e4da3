"""pathcond: function-preserving PathCond rescaling of ReLU networks.

    import pathcond_cli as pathcond
    result = pathcond.rescale_module(model, input_shape=(3, 32, 32))
"""

__version__ = "0.1.0"

from .errors import PathcondError  # noqa: E402

_API = ("Analysis", "RescaleResult", "analyse", "load", "rescale", "rescale_module", "save")


def __getattr__(name: str):
    # The API (and torch) is imported on first use, so that ``pathcond`` starts light and its
    # Ctrl-C handling is in place before the heavy imports.
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'pathcond_cli' has no attribute {name!r}")

__all__ = ["Analysis", "PathcondError", "RescaleResult", "analyse", "load", "rescale", "rescale_module", "save", "__version__"]
