"""pathcond: function-preserving PathCond rescaling of ReLU networks.

    import pathcond_cli as pathcond
    result = pathcond.rescale_module(model, input_shape=(3, 32, 32))
"""

__version__ = "0.1.0"

from .api import Analysis, RescaleResult, analyse, load, rescale, rescale_module, save  # noqa: E402
from .errors import PathcondError  # noqa: E402

__all__ = ["Analysis", "PathcondError", "RescaleResult", "analyse", "load", "rescale", "rescale_module", "save", "__version__"]
