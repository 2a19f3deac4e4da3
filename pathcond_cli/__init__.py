"""pathcond: function-preserving PathCond rescaling of ReLU networks.

    import pathcond_cli as pathcond
    result = pathcond.rescale_module(model, input_shape=(3, 32, 32))

The public names are imported on first use, so that ``pathcond --help`` and ``--version``
start without loading torch. This module imports nothing at all: ``python -m pathcond_cli``
runs it before ``__main__`` installs the Ctrl-C handler, and an import here (``typing`` took
20 ms in a fresh virtual environment) was a window in which Ctrl-C printed a traceback.
"""

_PUBLIC = {
    "Analysis": "analysis",
    "analyse": "analysis",
    "RescaleResult": "rescaling",
    "rescale": "rescaling",
    "rescale_module": "module_route",
    "load": "model_files",
    "save": "model_files",
    "PathcondError": "errors",
    "compare_models": "toolkit",
    "prune": "toolkit",
    "save_pruned": "toolkit",
    "set_threads": "threads",
    "rescale_file": "pipeline",
    "GSGD": "gsgd",
    "__version__": "version",
}

__all__ = sorted(_PUBLIC)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing; type checkers read it as True
if TYPE_CHECKING:
    from .analysis import Analysis, analyse
    from .errors import PathcondError
    from .gsgd import GSGD
    from .model_files import load, save
    from .module_route import rescale_module
    from .pipeline import rescale_file
    from .rescaling import RescaleResult, rescale
    from .threads import set_threads
    from .toolkit import compare_models, prune, save_pruned
    from .version import __version__


def __getattr__(name: str) -> object:
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
