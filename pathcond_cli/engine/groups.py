"""Rescaling groups (SPEC §2): which neurons must share one scale, and what that does to θ.

Neurons are tracked per channel: all spatial positions of a conv channel share one scale
(weight sharing), and fixed edges (pooling, identity skips, flatten, concat) tie a channel
to the channels it reads. A union-find over these ties gives the groups. Groups touching an
input or an output are fixed; the rest are the unknowns ``u`` (``u_h = ln λ_h``).

B is never materialised: each DAG parameter tensor carries ``dst``/``src`` group maps laid out
so that ``(Bu)`` for the tensor is ``u[dst] − u[src]`` by broadcasting. Index ``H`` (one past
the free groups) stands for "fixed" and always holds 0.
"""

from __future__ import annotations

from collections import ChainMap, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from math import prod
from types import EllipsisType

import torch

from .evaluate import infer_shapes
from .graph import Graph, Node
from .layouts import reads_from_file, stand_ins
from .rules import Affine, AffineLayer, Fold, Ties, rule_for

# Elements per block when a layer-sized pass runs block by block: bounded float64 transients.
BLOCK_ELEMENTS = 2**22


def blocks(length: int, per_item: int) -> list[slice]:
    """Consecutive slices of an axis of ``length`` items of ``per_item`` elements each, at most
    ``BLOCK_ELEMENTS`` elements per slice (at least one item; one empty slice for an empty axis)."""
    step = max(1, BLOCK_ELEMENTS // max(1, per_item))
    return [slice(start, start + step) for start in range(0, max(length, 1), step)]


@dataclass(frozen=True)
class Reread:
    """A DAG parameter's value computed from the checkpoint's tensors each time it is asked
    for: the analysis reads each layer when it uses it and never holds the network's weights."""

    read: Callable[[], torch.Tensor]
    shape: tuple[int, ...]

    def to(self, device: torch.device | str) -> Reread:
        read = self.read
        return Reread(lambda: read().to(device), self.shape)


@dataclass
class DagParam:
    """One DAG parameter tensor (BatchNorm folded), in torch's canonical layout.

    ``value`` is ``[O, I/groups, *kernel]`` for weights and ``[O]`` for biases, in the
    checkpoint's dtype (float64 when BatchNorm is folded in); passes cast one at a time. It is
    held in ``source`` as a tensor, or as a :class:`Reread` that computes it when asked (each
    access reads it again: read it once per pass). ``view`` is the shape ``(G, O/G, I/G, K)``
    every reduction uses; ``dst`` is ``[G, O/G]`` and ``src`` ``[G, I/G]`` group indices
    (``src`` of a bias is a single fixed entry). ``is_bias``: the layer's bias, not its weight
    (a layer has at most one of each, and may have a bias alone). ``fold`` reads how a value
    with a BatchNorm folded in was computed (:class:`~.rules.Fold`); None for a stored tensor.
    """

    name: str
    layer: str
    source: torch.Tensor | Reread
    dst: torch.Tensor
    src: torch.Tensor
    view: tuple[int, int, int, int]
    self_loops: torch.Tensor | None = None
    is_bias: bool = False
    fold: Callable[[], Fold] | None = None

    @property
    def value(self) -> torch.Tensor:
        return self.source.read() if isinstance(self.source, Reread) else self.source

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape)

    @property
    def numel(self) -> int:
        return prod(self.view)

    def exponent(self, u_ext: torch.Tensor) -> torch.Tensor:
        """``(Bu)`` for this tensor, broadcastable to :attr:`view`."""
        return u_ext[self.dst][:, :, None, None] - u_ext[self.src][:, None, :, None]

    def accumulate(self, w4: torch.Tensor, incoming: torch.Tensor, outgoing: torch.Tensor) -> None:
        """Add this tensor's per-parameter ``w4`` (shaped :attr:`view`) to the groups it enters and leaves.

        Parameters whose two ends lie in one group have a zero row of B and count in neither.
        """
        if self.self_loops is not None:
            w4 = w4 * ~self.self_loops
        incoming.index_add_(0, self.dst.reshape(-1), w4.sum((2, 3)).reshape(-1))
        outgoing.index_add_(0, self.src.reshape(-1), w4.sum((1, 3)).reshape(-1))

    def accumulate_outer(
        self, rows: torch.Tensor, cols: torch.Tensor, incoming: torch.Tensor, outgoing: torch.Tensor
    ) -> None:
        """:meth:`accumulate` for w = rows ⊗ cols per conv group (``[G, O/G]``, ``[G, I/G]``, a
        kernel of one), without building w: a row's sum is its factor times the columns' total,
        less the columns in its own free group when the tensor has self-loops."""
        row_sums = rows * cols.sum(1, keepdim=True)
        col_sums = cols * rows.sum(1, keepdim=True)
        if self.self_loops is not None:
            free = len(incoming) - 1
            # Group h of conv group c is slot c·(H + 1) + h, so that only one conv group's columns meet.
            offsets = torch.arange(self.view[0], device=rows.device)[:, None] * (free + 1)
            slots, sources = self.dst + offsets, self.src + offsets
            cols_by_group = rows.new_zeros(self.view[0] * (free + 1)).index_add_(
                0, sources.reshape(-1), cols.reshape(-1)
            )
            rows_by_group = rows.new_zeros(self.view[0] * (free + 1)).index_add_(0, slots.reshape(-1), rows.reshape(-1))
            row_sums = row_sums - rows * torch.where(self.dst < free, cols_by_group[slots], 0.0)
            col_sums = col_sums - cols * torch.where(self.src < free, rows_by_group[sources], 0.0)
        incoming.index_add_(0, self.dst.reshape(-1), row_sums.reshape(-1))
        outgoing.index_add_(0, self.src.reshape(-1), col_sums.reshape(-1))


@dataclass
class WriteBack:
    """How one checkpoint tensor changes under ``u``: ``t · exp(u[dst] − u[src])``.

    ``layout`` says how the stored tensor's axes relate to the maps: ``weight`` (``[O, I/G,
    *kernel]``, grouped convs reading input channels of their own group), ``weight_t`` (a
    Linear stored ``[in, out]``), ``conv_transpose`` (``[I, O/G, *kernel]``) or ``vector``
    (per output channel: biases, BatchNorm γ, β,
    a per-channel scale, whose input channel c is output channel c's).
    A missing map means that side is not rescaled here (a conv before BatchNorm has no
    output-side factor: BatchNorm's γ and β carry it).
    """

    key: str
    layout: str
    dst: torch.Tensor | None
    src: torch.Tensor | None
    out_channels: int
    groups: int = 1

    def changes(self, u_ext: torch.Tensor) -> torch.Tensor:
        """Whether some entry of :meth:`factor` differs from 1, without building it (a 0-dim
        boolean on ``u_ext``'s device).

        Rounded subtraction is monotone, so the factor's extreme logs are the differences of
        the extremes of each group's two sides, and exp is monotone too.
        """
        if self.layout == "vector":
            logs = self.log_factor(u_ext, u_ext, (len(self.dst),))
        else:
            dst = u_ext[self.dst].reshape(self.groups, -1) if self.dst is not None else u_ext.new_zeros(self.groups, 1)
            src = u_ext[self.src].reshape(self.groups, -1) if self.src is not None else u_ext.new_zeros(self.groups, 1)
            logs = torch.cat([dst.amax(1) - src.amin(1), dst.amin(1) - src.amax(1)])
        return (torch.exp(torch.stack([logs.amax(), logs.amin()])) != 1.0).any()

    def factor(
        self, u_ext: torch.Tensor, shape: tuple[int, ...], rows: slice | EllipsisType = slice(None)
    ) -> torch.Tensor:
        """``exp(u[dst] − u[src])`` shaped to broadcast against a stored tensor of ``shape`` (its
        ``rows`` along the first axis)."""
        return self.log_factor(u_ext, u_ext, shape, rows).exp_()

    def log_factor(
        self,
        dst_values: torch.Tensor,
        src_values: torch.Tensor,
        shape: tuple[int, ...],
        rows: slice | EllipsisType = slice(None),
    ) -> torch.Tensor:
        """``dst_values[dst] − src_values[src]`` per stored element, shaped like :meth:`factor`
        (two value vectors, so that per-element facts such as how many free groups move an
        element come from the same layout code as the rescaling itself); a fresh tensor.
        ``rows`` restricts it to those indices of the stored tensor's first axis."""
        if self.layout == "vector":
            log = dst_values[self.dst] if self.src is None else dst_values[self.dst] - src_values[self.src]
            return log.reshape(shape)[rows]
        if self.layout == "weight_t":
            log = self._canonical_log(dst_values, src_values, slice(None), rows).t()
        elif self.layout == "conv_transpose":
            log = self._transposed_log(dst_values, src_values, rows)
        else:
            log = self._canonical_log(dst_values, src_values, rows, slice(None))
        return log.reshape(*log.shape, *([1] * (len(shape) - 2)))

    def _transposed_log(self, dst_values: torch.Tensor, src_values: torch.Tensor, in_rows: slice) -> torch.Tensor:
        """dst − src on a transposed convolution's stored ``[I, O/G]`` grid, restricted to the input
        channels ``in_rows``: input channel i of group g reads outputs g·O/G ... (g + 1)·O/G − 1, so
        the block's entries are gathered directly, never the whole grid (the weight's input side
        is always rescaled: ``src`` is set)."""
        out_per_group = self.out_channels // self.groups
        channels = torch.arange(len(self.src), device=dst_values.device)[in_rows]
        group = torch.div(channels, len(self.src) // self.groups, rounding_mode="floor")
        outputs = group[:, None] * out_per_group + torch.arange(out_per_group, device=dst_values.device)
        log = torch.zeros(outputs.shape, dtype=dst_values.dtype, device=dst_values.device)
        if self.dst is not None:
            log += dst_values[self.dst][outputs]
        return log.sub_(src_values[self.src][channels][:, None])

    def _canonical_log(
        self, dst_values: torch.Tensor, src_values: torch.Tensor, out_rows: slice, in_columns: slice
    ) -> torch.Tensor:
        """dst − src on the ``[O, I/G]`` grid (one column when the input side is not rescaled),
        restricted to ``out_rows`` × ``in_columns``."""
        in_per_group = 1 if self.src is None else len(self.src) // self.groups
        outputs = torch.arange(self.out_channels, device=dst_values.device)[out_rows]
        columns = torch.arange(in_per_group, device=dst_values.device)[
            in_columns if self.src is not None else slice(None)
        ]
        log = torch.zeros(len(outputs), len(columns), dtype=dst_values.dtype, device=dst_values.device)
        if self.dst is not None:
            log += dst_values[self.dst][out_rows][:, None]
        if self.src is not None:
            by_group = src_values[self.src].reshape(self.groups, in_per_group)[:, columns]
            if self.groups == 1:
                log -= by_group  # every row reads the same input groups: broadcast, no row-sized gather
            else:
                log -= by_group[torch.div(outputs, self.out_channels // self.groups, rounding_mode="floor")]
        return log


@dataclass
class RescalingGroups:
    """The group structure of a network and everything the solvers and writers need.

    ``node_groups`` gives each node's output its group per channel, or per element (shaped like
    the output, batch-free) where its elements need not share one scale (Ties).
    """

    graph: Graph
    num_free: int
    num_fixed: int
    dag_params: list[DagParam]
    writebacks: list[WriteBack]
    labels: list[str]
    colours: torch.Tensor
    node_groups: dict[str, torch.Tensor] = field(repr=False)
    shapes: dict[str, tuple[int, ...]] = field(repr=False)
    # The write-back maps as built, on the CPU, kept by :meth:`to`: a checkpoint read from a file
    # lives there, and its rescaled tensors are computed there (see :meth:`apply`).
    host_writebacks: list[WriteBack] | None = field(default=None, repr=False)
    # how many colours ``colours`` uses, counted where they were computed (the CPU)
    num_colours: int = 0

    @property
    def p(self) -> int:
        """Number of DAG parameters, the ``p`` of the objective."""
        return sum(dp.numel for dp in self.dag_params)

    def extend(self, u: torch.Tensor) -> torch.Tensor:
        """``u`` with the fixed slot (index H, value 0) appended."""
        return torch.cat([u, u.new_zeros(1)])

    def incidence_sums(self, weights: Iterable[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per free group: sum of ``weights`` over parameters entering it (A) and leaving it (C).

        ``weights`` has one entry per DAG parameter: a tensor shaped like its value or summed
        over the kernel (``[G, O/G, I/G]``, as ḡ is), or a pair ``(rows, cols)`` standing for
        their outer product (a kernel of one), which is never built. It is read one entry at a
        time (a generator holds one); the sums are float64 where the maps live. Parameters
        whose two ends lie in the same group have a zero row of B and count in neither sum.
        """
        incoming = torch.zeros(self.num_free + 1, dtype=torch.float64, device=self.device)
        outgoing = torch.zeros(self.num_free + 1, dtype=torch.float64, device=self.device)
        for dp, w in zip(self.dag_params, weights):
            if isinstance(w, tuple):
                rows, cols = w
                dp.accumulate_outer(
                    rows.to(torch.float64).reshape(dp.dst.shape),
                    cols.to(torch.float64).reshape(dp.src.shape),
                    incoming,
                    outgoing,
                )
            else:
                dp.accumulate(w.to(torch.float64).reshape(*dp.view[:3], -1), incoming, outgoing)
        return incoming[:-1], outgoing[:-1]

    @property
    def device(self) -> torch.device:
        return self.colours.device

    def to(self, device: torch.device | str) -> RescalingGroups:
        """A copy whose maps, parameter values and write-back maps all live on ``device``."""
        moved = [
            DagParam(
                dp.name,
                dp.layer,
                dp.source.to(device),
                dp.dst.to(device),
                dp.src.to(device),
                dp.view,
                None if dp.self_loops is None else dp.self_loops.to(device),
                dp.is_bias,
                dp.fold,
            )
            for dp in self.dag_params
        ]
        writebacks = [
            WriteBack(
                wb.key,
                wb.layout,
                None if wb.dst is None else wb.dst.to(device),
                None if wb.src is None else wb.src.to(device),
                wb.out_channels,
                wb.groups,
            )
            for wb in self.writebacks
        ]
        return RescalingGroups(
            self.graph,
            self.num_free,
            self.num_fixed,
            moved,
            writebacks,
            self.labels,
            self.colours.to(device),
            {name: ids.to(device) for name, ids in self.node_groups.items()},
            self.shapes,
            self.writebacks if self.device.type == "cpu" else self.host_writebacks,
            self.num_colours,
        )

    def apply(self, params: Mapping[str, torch.Tensor], u: torch.Tensor) -> RescaledTensors:
        """The checkpoint tensors rescaled by ``λ = exp(u)``, in their original dtypes.

        Only tensors the rescaling actually changes are listed; every other tensor of the
        checkpoint is to be kept bit-identical. Each is computed when read (see
        :class:`RescaledTensors`), where its original lives: a checkpoint tensor on the CPU is
        rescaled there by the CPU's copy of its write-back map and of ``u`` (read once), not
        copied to the device and back, one host round trip per tensor.
        """
        u_ext = self.extend(u.detach().to(self.device, torch.float64))
        # One read of the device for every tensor's answer.
        changes = torch.stack([wb.changes(u_ext) for wb in self.writebacks]).tolist() if self.writebacks else []
        changed = {wb.key: wb for wb, change in zip(self.writebacks, changes) if change}
        on_host = {wb.key: wb for wb in self.host_writebacks or () if wb.key in changed}
        return RescaledTensors(params, changed, u_ext, on_host)


class RescaledTensors(MutableMapping[str, torch.Tensor]):
    """The rescaled checkpoint tensors by key, each computed from the original when read and
    not kept, so that checking, verifying and writing a large network hold one rescaled
    tensor at a time instead of a second copy of the checkpoint. A tensor assigned here
    replaces the computed one.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        writebacks: dict[str, WriteBack],
        u_ext: torch.Tensor,
        host_writebacks: Mapping[str, WriteBack] | None = None,
    ):
        self._params, self._writebacks, self._u_ext = params, writebacks, u_ext
        self._host_writebacks = host_writebacks or {}
        self._u_host: torch.Tensor | None = None
        self._assigned: dict[str, torch.Tensor] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._assigned:
            return self._assigned[key]
        writeback = self._writebacks[key]  # an unchanged key is a KeyError before its tensor is read
        u_ext = self._u_ext
        original = self._params[key]
        if original.device.type == "cpu" and key in self._host_writebacks:
            if self._u_host is None:
                self._u_host = u_ext.cpu()  # u itself when the groups are on the CPU
            writeback, u_ext = self._host_writebacks[key], self._u_host
        shape = tuple(original.shape)
        rescaled = torch.empty(shape, dtype=original.dtype, device=u_ext.device)
        # Block by block along the first axis, so that the float64 transients are a block's; a
        # copy even of a float64 original (it may be a view of the mapped checkpoint), returned
        # where the checkpoint tensor lives.
        for rows in blocks(shape[0], prod(shape[1:])) if shape else [...]:
            factor = writeback.factor(u_ext, shape, rows)
            rescaled[rows] = original[rows].to(u_ext.device, torch.float64, copy=True).mul_(factor)
        return rescaled.to(original.device)

    def __setitem__(self, key: str, tensor: torch.Tensor) -> None:
        if key not in self._writebacks:
            raise KeyError(f"'{key}' is not a tensor the rescaling changes")
        self._assigned[key] = tensor

    def __delitem__(self, key: str) -> None:
        raise TypeError("the rescaled tensors are fixed by u; none can be removed")

    def __contains__(self, key: object) -> bool:
        return key in self._writebacks

    def __iter__(self):
        return iter(self._writebacks)

    def __len__(self) -> int:
        return len(self._writebacks)

    def copy(self) -> dict[str, torch.Tensor]:
        """A dict of the rescaled tensors, each computed once (what ``changed`` was before 0.4.0)."""
        return dict(self)

    def __reduce__(self):
        # Pickled (torch.save, copy.deepcopy) as a state_dict's OrderedDict, which
        # torch.load(weights_only=True) reads: the original tensors are read from an open
        # checkpoint file, which cannot be pickled.
        return OrderedDict, (list(self.items()),)

    def __repr__(self) -> str:
        keys = list(self)
        listed = ", ".join(map(repr, keys[:5])) + (", ..." if len(keys) > 5 else "")
        return f"RescaledTensors({len(keys)} tensors computed when read: {listed})"


def build_groups(graph: Graph, params: Mapping[str, torch.Tensor]) -> RescalingGroups:
    """Analyse ``graph`` with checkpoint ``params``: groups, DAG parameters, write-back maps."""
    # A checkpoint read from its file had its values checked by its loader: checking them
    # again here would read every tensor once more.
    graph.check_parameters(params, values=not reads_from_file(params))
    shapes = infer_shapes(graph, params)
    ties = Ties(graph, shapes)
    for node in graph.nodes:
        ties.record(node)
    for name in graph.outputs:
        ties.fix(ties.ids(name))

    roots = ties.roots()
    fixed_roots = torch.cat(ties.fixed).unique() if ties.fixed else torch.zeros(0, dtype=torch.long)
    fixed_roots = roots[fixed_roots].unique()
    is_fixed_root = torch.zeros(len(roots), dtype=torch.bool)
    is_fixed_root[fixed_roots] = True
    free_roots = roots[~is_fixed_root[roots]].unique()
    num_free = len(free_roots)
    group_of_root = torch.full((len(roots),), num_free, dtype=torch.long)
    group_of_root[free_roots] = torch.arange(num_free)
    group_of_element = group_of_root[roots]
    labels = [""] * num_free
    for element in sorted(ties.labels, reverse=True):
        h = int(group_of_element[element])
        if h < num_free:
            labels[h] = ties.labels[element]

    node_groups = {name: group_of_element[ids] for name, ids in ties.channel_ids.items()}
    dag_params: list[DagParam] = []
    writebacks: list[WriteBack] = []
    for node, affine, values in _layers(graph, params):
        _add_layer(node, affine, values, node_groups, num_free, dag_params, writebacks)
        del affine, values  # a folded layer's float64 weights: let go before the next layer's

    partial = RescalingGroups(
        graph,
        num_free,
        len(fixed_roots),
        dag_params,
        writebacks,
        labels,
        torch.zeros(num_free, dtype=torch.long),
        node_groups,
        shapes,
    )
    partial.colours = _colour(dag_params, num_free)
    partial.num_colours = int(partial.colours.max()) + 1 if num_free else 0
    return partial


def groups_with_values(groups: RescalingGroups, graph: Graph, params: Mapping[str, torch.Tensor]) -> RescalingGroups:
    """The groups of ``graph`` with checkpoint ``params``, for a copy of the network ``groups``
    were built on that holds other values, such as a rescaled file read back. Where ``graph`` is
    ``groups.graph`` node for node and every DAG parameter has its shape, the groups are the
    same: ``groups``' maps, shapes and colours are kept, on their device, and only the DAG
    parameters' values are read from ``params``. Any other graph gets :func:`build_groups` anew."""
    if graph.nodes == groups.graph.nodes and graph.outputs == groups.graph.outputs:
        graph.check_parameters(params, values=not reads_from_file(params))
        values: LayerValues = []
        for _, affine, layer in _layers(graph, params):
            values += layer
            del affine, layer  # as in build_groups
        if len(values) == len(groups.dag_params) and all(
            tuple(source.shape) == dp.shape for dp, (source, _) in zip(groups.dag_params, values)
        ):
            dag_params = [
                replace(dp, source=source.to(groups.device), fold=fold)
                for dp, (source, fold) in zip(groups.dag_params, values)
            ]
            return replace(groups, graph=graph, dag_params=dag_params)
    return build_groups(graph, params).to(groups.device)


LayerValues = list[tuple[torch.Tensor | Reread, Callable[[], Fold] | None]]


def _layers(graph: Graph, params: Mapping[str, torch.Tensor]) -> Iterator[tuple[Node, Affine, LayerValues]]:
    """Each layer of ``graph`` with DAG parameters: its node, its layout (:class:`~.rules.Affine`)
    and the value and fold of its weight then its bias, as its DAG parameters list them (a
    weight as a :class:`Reread`). The layout of a layer with a BatchNorm folded in holds its
    weights in float64: the caller lets it go before asking for the next layer's."""
    for node in graph.nodes:
        affine = rule_for(node).affine(node, graph, _weight_unread(node, params))
        if affine is None:
            continue
        values: LayerValues = []
        if affine.weight is not None:
            weight_fold = None if affine.weight_fold is None else _reread_fold(node, graph, params)
            values.append((_reread_weight(node, graph, params, affine), weight_fold))
        if affine.bias is not None:
            bias_fold = None if affine.bias_fold is None else lambda fold=affine.bias_fold: fold
            values.append((affine.bias, bias_fold))
        yield node, affine, values
        del affine, values


def _weight_unread(node, params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``params`` with a Linear's or Conv's weight as a stand-in of its shape: laying the layer out
    needs the weight's shape only (each pass reads its values through :func:`_reread_weight`),
    and its bias, read here, comes from other tensors."""
    if not isinstance(rule_for(node), AffineLayer):
        return params
    return ChainMap({node.weight: stand_ins(params)[node.weight]}, params)


def _reread_weight(node, graph: Graph, params: Mapping[str, torch.Tensor], affine: Affine) -> Reread:
    """The layer's weight as a :class:`Reread` value: its rule computes it from ``params`` again
    at each access (the checkpoint's tensors, read when used). The bias, O numbers, is kept:
    recomputing it through the rule would read the weight as well."""
    rule = rule_for(node)
    return Reread(lambda: rule.affine(node, graph, params).weight, tuple(affine.weight.shape))


def _reread_fold(node, graph: Graph, params: Mapping[str, torch.Tensor]) -> Callable[[], Fold]:
    """The layer's weight :class:`~.rules.Fold`, computed from ``params`` again at each call."""
    rule = rule_for(node)
    return lambda: rule.affine(node, graph, params).weight_fold


def _add_layer(
    node,
    affine: Affine,
    values: LayerValues,
    node_groups: dict[str, torch.Tensor],
    num_free: int,
    dag_params: list[DagParam],
    writebacks: list[WriteBack],
) -> None:
    """The layer's DAG parameters with their group maps (``values``: see :func:`_layers`), and
    the write-back of its stored tensors."""
    dst, src = node_groups[affine.output], node_groups[node.inputs[0]]
    groups = affine.groups
    out_ch = len(dst)
    values = iter(values)
    if affine.weight is not None:
        weight, weight_fold = next(values)
        view = (groups, out_ch // groups, weight.shape[1], prod(weight.shape[2:]))
        dst2, src2 = dst.reshape(groups, -1), src.reshape(groups, -1)
        dag_params.append(
            DagParam(
                affine.weight_label,
                node.name,
                weight,
                dst2,
                src2,
                view,
                _self_loops(dst2, src2, num_free),
                fold=weight_fold,
            )
        )
    if affine.bias is not None:
        bias, bias_fold = next(values)
        dag_params.append(
            DagParam(
                affine.bias_label,
                node.name,
                bias,
                dst.reshape(1, -1),
                torch.tensor([[num_free]]),
                (1, out_ch, 1, 1),
                is_bias=True,
                fold=bias_fold,
            )
        )
    for stored in affine.stored:
        writebacks.append(
            WriteBack(
                stored.key,
                stored.layout,
                dst if stored.output_side else None,
                src if stored.input_side else None,
                out_ch,
                groups,
            )
        )


def _self_loops(dst: torch.Tensor, src: torch.Tensor, num_free: int) -> torch.Tensor | None:
    """Mask of weights whose two ends share a free group (their row of B is zero), if any."""
    shared = set(dst[dst < num_free].unique().tolist()) & set(src[src < num_free].unique().tolist())
    if not shared:
        return None
    return (dst[:, :, None] == src[:, None, :])[..., None] & (dst < num_free)[:, :, None, None]


def _colour(dag_params: list[DagParam], num_free: int) -> torch.Tensor:
    """Greedy colouring: no two groups of one colour share a parameter (SPEC §5).

    Groups conflict when one is a destination and the other a source of the same weight
    tensor, so colours used per tensor side are tracked instead of the (dense) conflict graph.
    """
    weights = [dp for dp in dag_params if bool((dp.src < num_free).any())]
    as_dst: list[list[int]] = [[] for _ in range(num_free)]
    as_src: list[list[int]] = [[] for _ in range(num_free)]
    for t, dp in enumerate(weights):
        for h in dp.dst[dp.dst < num_free].unique().tolist():
            as_dst[h].append(t)
        for h in dp.src[dp.src < num_free].unique().tolist():
            as_src[h].append(t)
    dst_colours: list[set[int]] = [set() for _ in weights]
    src_colours: list[set[int]] = [set() for _ in weights]
    colours = torch.zeros(num_free, dtype=torch.long)
    for h in range(num_free):
        forbidden: set[int] = set()
        for t in as_dst[h]:
            forbidden |= src_colours[t]
        for t in as_src[h]:
            forbidden |= dst_colours[t]
        c = 0
        while c in forbidden:
            c += 1
        colours[h] = c
        for t in as_dst[h]:
            dst_colours[t].add(c)
        for t in as_src[h]:
            src_colours[t].add(c)
    return colours
