"""The solver's view of ḡ as a few flat buffers (issue 28): a pass is a handful of kernels
whatever the number of tensors.

Every tensor's row sums ``[G, O/G]`` and column sums ``[G, I/G]`` of w = ḡ e^{x_dst + y_src} get
a slot in one flat row buffer and one flat column buffer, each slot mapped to its group
(``row_group``, ``col_group``) and its tensor. Tensors whose kernel-summed ḡ has the same
``[O/G, I/G]`` shape have it stacked in linear scale into one batch (a :class:`Bucket`; their
log ḡ stays per tensor, a view of log g for a kernel of one), so that the products of a
pass are two batched mat-vecs per distinct shape, not per tensor: a ResNet has the same dozen
or two shapes at any depth. Tensors whose ḡ is an outer product (a Linear layer fed one
vector, and every bias, a column of one) are held by their two log factors and reduced with
segment sums. Per-tensor scales and range decisions are segment reductions over the slots,
so nothing is decided on the host per tensor.

Batched products in linear scale are exact only when no positive term underflows: each
tensor's dynamic range (of ḡ and of the two factors) decides it, as before, and the tensors
that fail are reduced in the log domain (the whole pass redone there when any does, which
only extreme scales cause).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..engine.groups import RescalingGroups
from ..engine.log_g import LogG, OuterLog

SAFE_RANGE = 650.0


class SlotBuffer:
    """A float64 buffer over every row (or column) slot that the products of a pass write in
    place, with its views made once: each bucket's slots shaped for a batched product
    (``[batches, *shape]``, -1 for the bucket's rows or columns), the dense slots and the
    outer-product slots. A product per bucket is then one operation per pass, with no split,
    view or concatenation around it (on a GPU, one launch). What is read from it is consumed
    into a fresh tensor before the next product writes it."""

    def __init__(self, length: int, dense: int, buckets: list[Bucket], side: str, *shape: int, device):
        self.flat = torch.empty(length, dtype=torch.float64, device=device)
        self.dense, self.outer = self.flat[:dense], self.flat[dense:]
        self.pieces = [self.flat[getattr(bucket, side)].view(bucket.batch_count, *shape) for bucket in buckets]


@dataclass
class Bucket:
    """Dense tensors with one ``[R, C]`` shape: their log ḡ (each tensor's own, ``[G, R, C]``:
    for a kernel of one a view of log g, which a stacked copy would double), ḡ in linear scale
    stacked ``[Σ G, R, C]`` (``e^{log ḡ − shift}`` per tensor; None when recomputed per use),
    the mask of self-loop parameters (None when none has any) and where their slots lie."""

    log_parts: list[torch.Tensor]
    linear: torch.Tensor | None
    self_loops: torch.Tensor | None
    rows: slice
    cols: slice
    tensors: list[int]
    batches: list[slice]
    shift_per_batch: torch.Tensor | None = None

    @property
    def batch_count(self) -> int:
        return self.batches[-1].stop

    @property
    def log_gbar(self) -> torch.Tensor:
        """The tensors' log ḡ stacked: a copy, for the log-domain routes (extreme ranges) only."""
        return torch.cat(self.log_parts) if len(self.log_parts) > 1 else self.log_parts[0]

    def linear_gbar(self, shift_per_batch: torch.Tensor) -> torch.Tensor:
        if self.linear is not None:
            return self.linear
        stacked = torch.cat(self.log_parts) if len(self.log_parts) > 1 else self.log_parts[0].clone()
        return stacked.sub_(shift_per_batch[:, None, None]).exp_()


class FlatG:
    """log ḡ of every tensor in flat buffers (see the module docstring).

    ``parts[t]`` is tensor t's kernel-summed log ḡ, ``[G, O/G, I/G]``, or an :class:`OuterLog`.
    """

    def __init__(self, groups: RescalingGroups, parts: list[LogG], *, cache_bytes: int):
        device = groups.device
        dps = groups.dag_params
        self.group_slots = groups.num_free + 1
        by_shape: dict[tuple[int, int], list[int]] = {}
        outer = []
        for t, lg in enumerate(parts):
            if isinstance(lg, OuterLog):
                outer.append(t)
            else:
                by_shape.setdefault(tuple(lg.shape[1:]), []).append(t)
        self.dense_tensors = [t for members in by_shape.values() for t in members]
        self.outer_tensors = outer
        self.outer_self_loops = [t for t in outer if dps[t].self_loops is not None]
        slot_order = self.dense_tensors + outer
        self.dense_index = [-1] * len(parts)
        for i, t in enumerate(self.dense_tensors):
            self.dense_index[t] = i
        row_counts = [dps[t].dst.numel() for t in slot_order]
        col_counts = [dps[t].src.numel() for t in slot_order]
        self.row_slices: list[slice] = [slice(0)] * len(parts)
        self.col_slices: list[slice] = [slice(0)] * len(parts)
        rows = cols = 0
        first_cols, first_rows, rows_per_block, cols_per_block = [], [], [], []
        for t, count_rows, count_cols in zip(slot_order, row_counts, col_counts):
            self.row_slices[t], self.col_slices[t] = slice(rows, rows + count_rows), slice(cols, cols + count_cols)
            conv_groups = dps[t].dst.shape[0]
            first_cols += range(cols, cols + count_cols, count_cols // conv_groups)
            first_rows += range(rows, rows + count_rows, count_rows // conv_groups)
            rows_per_block += [count_rows // conv_groups] * conv_groups
            cols_per_block += [count_cols // conv_groups] * conv_groups
            rows, cols = rows + count_rows, cols + count_cols
        dense_count = len(self.dense_tensors)
        self.dense_rows, self.dense_cols = sum(row_counts[:dense_count]), sum(col_counts[:dense_count])

        def joined(pieces, dtype=torch.long):
            return torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype, device=device)

        def repeated(values, counts):
            return torch.repeat_interleave(
                torch.tensor(values, dtype=torch.long, device=device),
                torch.tensor(counts, dtype=torch.long, device=device),
                output_size=sum(counts),
            )

        self.row_group = joined([dps[t].dst.reshape(-1) for t in slot_order])
        self.col_group = joined([dps[t].src.reshape(-1) for t in slot_order])
        #: per slot: the tensor it belongs to, and the first source (destination) group of its
        #: conv group, which stands for all of them where a tensor's sources lie in one aggregate
        self.row_owner, self.col_owner = repeated(slot_order, row_counts), repeated(slot_order, col_counts)
        self.row_first_source = self.col_group[repeated(first_cols, rows_per_block)]
        self.col_first_destination = self.row_group[repeated(first_rows, cols_per_block)]
        # dense tensors are numbered in slot order, outer ones after them
        self.row_tensor = repeated(range(dense_count), row_counts[:dense_count])
        self.col_tensor = repeated(range(dense_count), col_counts[:dense_count])
        self.outer_row_tensor = repeated(range(len(outer)), row_counts[dense_count:])
        self.outer_col_tensor = repeated(range(len(outer)), col_counts[dense_count:])
        # Reductions made in pairs, each pair as one over both sides' segments, the second side's
        # numbered after the first's: x's and y's largest and smallest (as the largest of their
        # negation) per dense tensor; the row and column sums of w per group; the outer tensors'
        # column and row totals.
        self.range_index = torch.cat(
            [self.row_tensor + side * dense_count for side in (0, 1)]
            + [self.col_tensor + side * dense_count for side in (2, 3)]
        )
        self.side_group = torch.cat([self.row_group, self.col_group + self.group_slots])
        self.outer_side_tensor = torch.cat([self.outer_col_tensor, self.outer_row_tensor + len(outer)])
        self.outer_row_log = joined([parts[t].rows.reshape(-1) for t in outer], torch.float64)
        self.outer_col_log = joined([parts[t].cols.reshape(-1) for t in outer], torch.float64)
        self._stack(dps, parts, by_shape, cache_bytes)
        rows, cols = self.row_group.numel(), self.col_group.numel()
        # a product's vector (by rows: [B, 1, R]; by columns: [B, C, 1]) and its sums
        self.rows_in = SlotBuffer(rows, self.dense_rows, self.buckets, "rows", 1, -1, device=device)
        self.cols_in = SlotBuffer(cols, self.dense_cols, self.buckets, "cols", -1, 1, device=device)
        self.row_sums = SlotBuffer(rows, self.dense_rows, self.buckets, "rows", -1, 1, device=device)
        self.col_sums = SlotBuffer(cols, self.dense_cols, self.buckets, "cols", 1, -1, device=device)
        #: the dense slots of buckets with self-loops, whose sums without them differ, and those
        #: sums (all None when no bucket has self-loops)
        self.looped_rows = self.looped_cols = self.between_row_sums = self.between_col_sums = None
        if any(bucket.self_loops is not None for bucket in self.buckets):
            self.looped_rows = torch.zeros(self.dense_rows, dtype=torch.bool, device=device)
            self.looped_cols = torch.zeros(self.dense_cols, dtype=torch.bool, device=device)
            for bucket in self.buckets:
                if bucket.self_loops is not None:
                    self.looped_rows[bucket.rows] = True
                    self.looped_cols[bucket.cols] = True
            self.between_row_sums = SlotBuffer(rows, self.dense_rows, self.buckets, "rows", -1, 1, device=device)
            self.between_col_sums = SlotBuffer(cols, self.dense_cols, self.buckets, "cols", 1, -1, device=device)
        self.parts = parts
        self.dst_shapes = [dp.dst.shape for dp in dps]
        self.src_shapes = [dp.src.shape for dp in dps]

    def _stack(self, dps, parts: list[LogG], by_shape: dict[tuple[int, int], list[int]], cache_bytes: int) -> None:
        """One :class:`Bucket` per shape; per dense tensor the log scale of its linear ḡ and the
        spread of its finite log ḡ."""
        device = self.row_group.device
        self.buckets: list[Bucket] = []
        finite_max, finite_min, conv_groups, bucket_sizes = [], [], [], []
        for members in by_shape.values():
            first, last = members[0], members[-1]
            # stacked only while its range is taken (one bucket at a time)
            log_gbar = torch.cat([parts[t] for t in members]) if len(members) > 1 else parts[first]
            loops = [dps[t].self_loops for t in members]
            self_loops = (
                None
                if all(m is None for m in loops)
                else torch.cat(
                    [
                        torch.zeros(parts[t].shape, dtype=torch.bool, device=device) if m is None else m[..., 0]
                        for t, m in zip(members, loops)
                    ]
                )
            )
            batches, at = [], 0
            for t in members:
                batches.append(slice(at, at + parts[t].shape[0]))
                at += parts[t].shape[0]
            conv_groups += [parts[t].shape[0] for t in members]
            bucket_sizes.append(len(members))
            self.buckets.append(
                Bucket(
                    [parts[t] for t in members],
                    None,
                    self_loops,
                    slice(self.row_slices[first].start, self.row_slices[last].stop),
                    slice(self.col_slices[first].start, self.col_slices[last].stop),
                    members,
                    batches,
                )
            )
            finite = torch.isfinite(log_gbar)
            finite_max.append(torch.where(finite, log_gbar, -torch.inf).amax(dim=(1, 2)))
            finite_min.append(torch.where(finite, log_gbar, torch.inf).amin(dim=(1, 2)))
            del log_gbar, finite
        count = len(self.dense_tensors)
        batch_tensor = torch.repeat_interleave(
            torch.arange(count, device=device),
            torch.tensor(conv_groups, dtype=torch.long, device=device),
            output_size=sum(conv_groups),
        )
        self.bucket_of_dense = torch.repeat_interleave(
            torch.arange(len(self.buckets), device=device),
            torch.tensor(bucket_sizes, dtype=torch.long, device=device),
            output_size=count,
        )
        empty = torch.zeros(0, dtype=torch.float64, device=device)
        top = finite_extreme(torch.cat(finite_max) if finite_max else empty, batch_tensor, count, "amax")
        low = finite_extreme(torch.cat(finite_min) if finite_min else empty, batch_tensor, count, "amin")
        has_finite = torch.isfinite(top)
        self.shift = torch.where(has_finite, top, 0.0)
        self.spread = torch.where(has_finite, top - low, 0.0)
        self.linear_usable = self.spread < SAFE_RANGE
        shift_per_batch = self.shift[batch_tensor]
        room, at = cache_bytes, 0
        for bucket in self.buckets:
            batches = bucket.batch_count
            bucket.shift_per_batch = shift_per_batch[at : at + batches]
            at += batches
            size = sum(part.numel() * part.element_size() for part in bucket.log_parts)
            if size <= room:
                bucket.linear = bucket.linear_gbar(bucket.shift_per_batch)
                room -= size

    def multiply_rows(self, matrices: Iterable[torch.Tensor]) -> None:
        """M_b v per bucket (one matrix each, read one at a time), ``v`` in :attr:`cols_in`'s dense
        slots, into :attr:`row_sums`' dense slots."""
        for matrix, v, out in zip(matrices, self.cols_in.pieces, self.row_sums.pieces):
            torch.bmm(matrix, v, out=out)

    def multiply_cols(self, matrices: Iterable[torch.Tensor]) -> None:
        """vᵀ M_b per bucket, ``v`` in :attr:`rows_in`'s dense slots, into :attr:`col_sums`' dense slots."""
        for matrix, v, out in zip(matrices, self.rows_in.pieces, self.col_sums.pieces):
            torch.bmm(v, matrix, out=out)

    # ------------------------------------------------------------------ ranges

    def ranges(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per dense tensor: largest and smallest finite x over its row slots and y over its
        column slots (−inf/+inf when none is finite)."""
        count = len(self.dense_tensors)
        x_dense, y_dense = x[: self.dense_rows], y[: self.dense_cols]
        sides = torch.cat([x_dense, -x_dense, y_dense, -y_dense])
        top_x, low_x, top_y, low_y = finite_extreme(sides, self.range_index, 4 * count, "amax").reshape(4, count)
        return top_x, -low_x, top_y, -low_y

    def linear_safe(self, ranges: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Per dense tensor: whether its linear-scale products lose no positive term."""
        top_x, low_x, top_y, low_y = ranges
        return self.linear_usable & (self.spread + torch.maximum(top_x - low_x, top_y - low_y) < SAFE_RANGE)

    # ------------------------------------------------------------------ sums of w

    def log_sums(self, x: torch.Tensor, y: torch.Tensor, *, exact_everywhere: bool = False):
        """log row sums and column sums of w = ḡ e^{x_row + y_col} in every slot, the same
        without self-loop parameters, and a 0-d flag: whether some tensor's linear-scale sums
        lost terms (then call again with ``exact_everywhere``, which takes the log domain for
        those tensors)."""
        ranges = self.ranges(x, y)
        safe = self.linear_safe(ranges)
        top_x = torch.where(torch.isfinite(ranges[0]), ranges[0], 0.0)
        top_y = torch.where(torch.isfinite(ranges[2]), ranges[2], 0.0)
        e_x = torch.exp(x[: self.dense_rows] - top_x[self.row_tensor], out=self.rows_in.dense)
        e_y = torch.exp(y[: self.dense_cols] - top_y[self.col_tensor], out=self.cols_in.dense)
        for b, bucket in enumerate(self.buckets):
            gbar = bucket.linear_gbar(bucket.shift_per_batch)
            torch.bmm(gbar, self.cols_in.pieces[b], out=self.row_sums.pieces[b])
            torch.bmm(self.rows_in.pieces[b], gbar, out=self.col_sums.pieces[b])
            if bucket.self_loops is not None:
                gbar = gbar.masked_fill(bucket.self_loops, 0.0)
                torch.bmm(gbar, self.cols_in.pieces[b], out=self.between_row_sums.pieces[b])
                torch.bmm(self.rows_in.pieces[b], gbar, out=self.between_col_sums.pieces[b])
        rows, cols = self.row_sums.dense, self.col_sums.dense
        between_rows, between_cols = rows, cols
        if self.looped_rows is not None:
            between_rows = torch.where(self.looped_rows, self.between_row_sums.dense, rows)
            between_cols = torch.where(self.looped_cols, self.between_col_sums.dense, cols)
        scale = self.shift + top_x + top_y
        row_scale, col_scale = scale[self.row_tensor], scale[self.col_tensor]
        dense = [torch.log(r * e_x) + row_scale for r in (rows, between_rows)] + [
            torch.log(c * e_y) + col_scale for c in (cols, between_cols)
        ]
        if exact_everywhere:
            exact = self._log_domain_sums(x, y)
            keep_rows, keep_cols = safe[self.row_tensor], safe[self.col_tensor]
            dense = [
                torch.where(keep, linear, logged)
                for linear, logged, keep in zip(dense, exact, (keep_rows, keep_rows, keep_cols, keep_cols))
            ]
        outer = self._outer_sums(x, y)
        all_rows, between_rows, all_cols, between_cols = (torch.cat([d, o]) for d, o in zip(dense, outer))
        return all_rows, all_cols, between_rows, between_cols, ~(safe.all() | torch.tensor(exact_everywhere))

    def _log_domain_sums(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        rows, between_rows, cols, between_cols = [], [], [], []
        for bucket in self.buckets:
            batches = bucket.batch_count
            log_w = bucket.log_gbar + x[bucket.rows].reshape(batches, -1, 1) + y[bucket.cols].reshape(batches, 1, -1)
            rows.append(torch.logsumexp(log_w, dim=2).reshape(-1))
            cols.append(torch.logsumexp(log_w, dim=1).reshape(-1))
            if bucket.self_loops is not None:
                log_w = log_w.masked_fill(bucket.self_loops, -torch.inf)
                between_rows.append(torch.logsumexp(log_w, dim=2).reshape(-1))
                between_cols.append(torch.logsumexp(log_w, dim=1).reshape(-1))
            else:
                between_rows.append(rows[-1])
                between_cols.append(cols[-1])
        return [_joined(rows, x), _joined(between_rows, x), _joined(cols, y), _joined(between_cols, y)]

    def _outer_sums(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """The outer-product tensors' log row and column sums, exact in the log domain: a row's
        sum is its factor times the columns' total."""
        count = len(self.outer_tensors)
        log_rows = self.outer_row_log + x[self.dense_rows :]
        log_cols = self.outer_col_log + y[self.dense_cols :]
        totals = group_logsumexp(self.outer_side_tensor, torch.cat([log_cols, log_rows]), 2 * count)
        rows = log_rows + totals[:count][self.outer_row_tensor]
        cols = log_cols + totals[count:][self.outer_col_tensor]
        if not self.outer_self_loops:
            return [rows, rows, cols, cols]
        between_rows, between_cols = rows.clone(), cols.clone()
        size = self.group_slots
        for t in self.outer_self_loops:
            r, c = self._outer_slices(t)
            between_rows[r] = log_rows[r] + _other_groups(
                group_logsumexp(self.col_group[self.col_slices[t]], log_cols[c], size),
                self.row_group[self.row_slices[t]],
            )
            between_cols[c] = log_cols[c] + _other_groups(
                group_logsumexp(self.row_group[self.row_slices[t]], log_rows[r], size),
                self.col_group[self.col_slices[t]],
            )
        return [rows, between_rows, cols, between_cols]

    def _outer_slices(self, t: int) -> tuple[slice, slice]:
        """Tensor ``t``'s slots within the outer-product part of the row and column buffers."""
        r, c = self.row_slices[t], self.col_slices[t]
        return slice(r.start - self.dense_rows, r.stop - self.dense_rows), slice(
            c.start - self.dense_cols, c.stop - self.dense_cols
        )


def _joined(pieces: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(pieces) if pieces else like.new_zeros(0)


def finite_extreme(values: torch.Tensor, index: torch.Tensor, count: int, reduce: str) -> torch.Tensor:
    """Finite ``values`` reduced per segment (``amax``/``amin``); ∓inf where a segment has none."""
    empty = -torch.inf if reduce == "amax" else torch.inf
    finite = values.nan_to_num(nan=empty, posinf=empty, neginf=empty)
    return torch.full((count,), empty, dtype=values.dtype, device=values.device).scatter_reduce_(
        0, index, finite, reduce
    )


def group_logsumexp(index: torch.Tensor, log_values: torch.Tensor, size: int) -> torch.Tensor:
    """log Σ exp(values) per group index (``size`` groups), −inf for groups with no entry."""
    peak = torch.full((size,), -torch.inf, dtype=log_values.dtype, device=log_values.device)
    safe_peak = peak.scatter_reduce_(0, index, log_values, "amax").nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    summed = torch.zeros_like(safe_peak).index_add_(0, index, torch.exp(log_values - safe_peak[index]))
    return torch.log(summed) + safe_peak


def _other_groups(log_by_group: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Per entry of ``groups`` (indices into ``log_by_group``, ``[H + 1]``, the last the fixed slot):
    log Σ over every other slot of exp(log_by_group), or over all of them for the fixed slot,
    which has no self-loops. Prefix and suffix log-sums, so nothing is subtracted."""
    none = log_by_group.new_full((1,), -torch.inf)
    before = torch.cat([none, torch.logcumsumexp(log_by_group, 0)[:-1]])
    after = torch.cat([torch.logcumsumexp(log_by_group.flip(0), 0).flip(0)[1:], none])
    others = torch.logaddexp(before, after)
    others[-1] = torch.logsumexp(log_by_group, 0)
    return others[groups]
