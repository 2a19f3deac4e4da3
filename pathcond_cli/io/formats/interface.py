"""What a checkpoint format provides: the :class:`Format` protocol that ONNX and safetensors
implement, and through which :mod:`pathcond_cli.io.formats` dispatches."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ...engine.model import LoadedModel
    from .common import InputShape


@runtime_checkable
class Format(Protocol):
    """A checkpoint format: which files it reads, its loader, its writer and the files besides
    the checkpoint that it reads or replaces.

    ``name`` is :attr:`LoadedModel.format` for the models it loads (and :data:`~.detection.FORMAT_OF_KIND`
    of the kinds its :meth:`detect` tells); which format's companions a file so named may have is
    told by :func:`pathcond_cli.io.companions.companion_format`, the policy the formats share.
    """

    name: str

    def detect(self, path: Path | None, structure: str | None) -> str | None:
        """The kind of checkpoint (:data:`~.detection.FORMAT_OF_KIND`) the file at ``path`` (None:
        bytes from stdin), whose structure :func:`~.detection.checked_structure` found, is in this
        format, or None when this format does not read it. Formats are asked in a fixed order."""

    def load(
        self,
        source: Path | bytes,
        *,
        arch: str | None,
        input_shape: InputShape | None,
        name: str | None,
        allow_unused: bool,
    ) -> LoadedModel:
        """The model at ``source`` (a path, or the bytes of stdin), its weights checked."""

    def write(
        self,
        model: LoadedModel,
        changed: Mapping[str, torch.Tensor],
        destination: Path,
        metadata: Mapping[str, str],
        *,
        companion_name: Callable[[str], str],
        self_contained: bool,
    ) -> None:
        """``model`` with ``changed`` tensors replaced, written atomically to ``destination``, its
        companions under the names ``companion_name`` gives for those the format prefers."""

    def check_streamable(self, model: LoadedModel) -> None:
        """Refuse, before any work, a model that cannot be sent to stdout as one file."""

    def companions(self, path: Path) -> list[Path]:
        """The companion files the checkpoint at ``path`` names (its shards, its external data);
        none when it cannot be read. Never raises."""

    def architecture_files(self, path: Path | None, arch: str | None) -> list[Path]:
        """The files besides the checkpoint at ``path`` (None for stdin) and its companions that
        finding its architecture with ``--arch arch`` may read, known before loading. Never raises."""

    def own_companions(self, path: Path) -> list[Path]:
        """The companions provably the checkpoint's own, which replacing it deletes. Never raises."""
