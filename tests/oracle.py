"""Brute-force oracles for pathcond's engine, built WITHOUT any of the engine's diag/objective code.

Everything here works on the explicit NEURON-level DAG of a (tiny) :class:`Graph`:

* one networkx node per neuron (every spatial position of every channel, per graph node), plus
  one "bias source" node per bias parameter;
* edges carry either an index into a flat θ vector (conv kernels are shared, so one θ entry
  labels many edges; a BatchNorm that follows a Linear/Conv is folded into it, SPEC §1) or a
  fixed constant (pass-through 1, max-pool window 1, identity skip 1, avg-pool 1/divisor with
  torch's divisor semantics, adaptive avg-pool 1/window size);
* conv / pool connectivity is derived by explicit index arithmetic (stride, padding, dilation,
  groups, ceil_mode), and cross-checked by evaluating the neuron DAG with real activations
  against a plain ``torch.nn.functional`` forward (see :meth:`NeuronDAG.forward_check`).

From it: the enumerated paths, the path-lifting Φ(θ) as a torch function, J = ∂Φ/∂θ by
autograd, diag(JᵀJ), the path count, a log-domain brute-force log diag(G) for extreme weights,
independent rescaling groups (union-find over neurons), an explicit dense B, and F(u) (SPEC §4)
with its gradient. Only the *numbering* of free groups is taken from the engine (to compare
u vectors column by column); the partition itself is recomputed and compared.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import networkx as nx
import numpy as np
import torch
import torch.nn.functional as F

from pathcond_cli.engine.graph import (
    AdaptiveAvgPool,
    Add,
    AvgPool,
    BatchNorm,
    ChannelAffine,
    ChannelBias,
    ChannelGather,
    ChannelShuffle,
    ChannelSlice,
    Concat,
    Conv,
    ConvTranspose,
    FixedFilter,
    Flatten,
    Graph,
    Identity,
    Input,
    LeakyReLU,
    Linear,
    MaxPool,
    Pad,
    PReLU,
    Rearrange,
    ReLU,
    Scale,
    Sub,
    Upsample,
)

_CONV = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}
_CONV_T = {3: F.conv_transpose1d, 4: F.conv_transpose2d, 5: F.conv_transpose3d}
_MAXP = {3: F.max_pool1d, 4: F.max_pool2d, 5: F.max_pool3d}
_AVGP = {3: F.avg_pool1d, 4: F.avg_pool2d, 5: F.avg_pool3d}
_ADAP = {3: F.adaptive_avg_pool1d, 4: F.adaptive_avg_pool2d, 5: F.adaptive_avg_pool3d}


# ----------------------------------------------------------------------------------------------
# Plain torch forward (reference semantics, independent of pathcond_cli.engine.evaluate)
# ----------------------------------------------------------------------------------------------


def _bn_for(graph: Graph, name: str) -> BatchNorm | None:
    consumers = [n for n in graph.nodes if name in n.inputs]
    if len(consumers) == 1 and isinstance(consumers[0], BatchNorm) and name not in graph.outputs:
        return consumers[0]
    return None


def torch_forward(graph: Graph, params, x: torch.Tensor, *, train: bool = False) -> dict[str, torch.Tensor]:
    """Batched forward with torch.nn.functional only (float dtype of ``x``)."""
    dt = x.dtype
    P = {k: v.to(dt) for k, v in params.items()}
    vals: dict[str, torch.Tensor] = {}
    for node in graph.nodes:
        xs = [vals[i] for i in node.inputs]
        if isinstance(node, Input):
            y = x
        elif isinstance(node, Linear):
            w = P[node.weight].t() if node.weight_transposed else P[node.weight]
            y = F.linear(xs[0], w, P[node.bias] if node.bias else None)
        elif isinstance(node, Conv):
            w = P[node.weight]
            y = _CONV[w.dim()](
                xs[0], w, P[node.bias] if node.bias else None, node.stride, node.padding, node.dilation, node.groups
            )
        elif isinstance(node, ConvTranspose):
            w = P[node.weight]
            y = _CONV_T[w.dim()](
                xs[0],
                w,
                P[node.bias] if node.bias else None,
                node.stride,
                node.padding,
                node.output_padding,
                node.groups,
                node.dilation,
            )
        elif isinstance(node, BatchNorm):
            y = F.batch_norm(
                xs[0],
                P[node.running_mean].clone(),
                P[node.running_var].clone(),
                P[node.weight],
                P[node.bias],
                training=train,
                momentum=0.0,
                eps=node.eps,
            )
        elif isinstance(node, ReLU):
            y = F.relu(xs[0])
        elif isinstance(node, LeakyReLU):
            y = F.leaky_relu(xs[0], node.negative_slope)
        elif isinstance(node, PReLU):
            y = F.prelu(xs[0], P[node.weight].reshape(-1))
        elif isinstance(node, Identity):
            y = xs[0]
        elif isinstance(node, Scale):
            y = xs[0] * node.factor
        elif isinstance(node, Pad):
            pads = []
            for b, e in reversed(list(zip(node.begin, node.end))):
                pads += [b, e]
            if node.mode in ("reflect", "replicate", "circular"):
                y = F.pad(xs[0], pads, mode=node.mode)
            else:
                y = F.pad(xs[0], pads, value=-math.inf if node.mode == "-inf" else 0.0)
        elif isinstance(node, ChannelBias):
            y = xs[0] + P[node.bias].reshape(1, -1, *([1] * (xs[0].dim() - 2)))
        elif isinstance(node, FixedFilter):
            w = torch.tensor(node.coefficients, dtype=dt).reshape(xs[0].shape[1], 1, *node.kernel)
            y = _CONV[w.dim()](xs[0], w, None, node.stride, node.padding, node.dilation, xs[0].shape[1])
        elif isinstance(node, ChannelAffine):
            view = (1, -1, *([1] * (xs[0].dim() - 2)))
            y = xs[0] * P[node.weight].reshape(view)
            if node.bias is not None:
                y = y + P[node.bias].reshape(view)
        elif isinstance(node, ChannelShuffle):
            n, c = xs[0].shape[:2]
            y = xs[0].reshape(n, node.groups, c // node.groups, *xs[0].shape[2:]).transpose(1, 2).reshape(xs[0].shape)
        elif isinstance(node, ChannelSlice):
            y = xs[0][:, node.start : node.stop]
        elif isinstance(node, ChannelGather):
            y = xs[0][:, list(node.channels)]
        elif isinstance(node, Upsample):
            y = _interpolate(node, xs[0])
        elif isinstance(node, MaxPool):
            y = _MAXP[xs[0].dim()](
                xs[0], node.kernel, node.stride, node.padding, node.dilation, ceil_mode=node.ceil_mode
            )
        elif isinstance(node, AvgPool):
            y = _AVGP[xs[0].dim()](
                xs[0], node.kernel, node.stride, node.padding, node.ceil_mode, node.count_include_pad
            )
        elif isinstance(node, AdaptiveAvgPool):
            y = _ADAP[xs[0].dim()](xs[0], node.output_size)
        elif isinstance(node, Flatten):
            y = xs[0].flatten(1)
        elif isinstance(node, Rearrange):
            y = xs[0].reshape(xs[0].shape[0], -1)[:, copied_elements(node)].reshape(xs[0].shape[0], *node.shape)
        elif isinstance(node, Add):
            y = xs[0]
            for other in xs[1:]:
                y = y + other
        elif isinstance(node, Sub):
            y = xs[0] - xs[1]
        elif isinstance(node, Concat):
            y = torch.cat(xs, 1)
        else:  # pragma: no cover
            raise TypeError(node)
        vals[node.name] = y
    return {o: vals[o] for o in graph.outputs}


def _interpolate(node: Upsample, x: torch.Tensor) -> torch.Tensor:
    """torch's own N-d interpolation (never separated per axis)."""
    r = x.dim() - 2
    values = node.size or node.scale_factor
    values = tuple(values) * (r // len(values))
    linear = node.mode == "linear"
    return F.interpolate(
        x,
        size=values if node.size else None,
        scale_factor=None if node.size else values,
        mode={1: "linear", 2: "bilinear", 3: "trilinear"}[r] if linear else "nearest",
        align_corners=node.align_corners if linear else None,
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(a.abs().max())
    diff = float((a - b).abs().max())
    return diff / scale if scale > 0 else diff


# ----------------------------------------------------------------------------------------------
# Index arithmetic for windows
# ----------------------------------------------------------------------------------------------


def conv_out_size(n: int, k: int, s: int, p: int, d: int) -> int:
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def pool_out_size(n: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    num = n + 2 * p - d * (k - 1) - 1
    out = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (out - 1) * s >= n + p:
        out -= 1
    return out


def _tup(v, r: int) -> tuple[int, ...]:
    v = tuple(v)
    return v if len(v) == r else (v[0],) * r


def copied_elements(node: Rearrange) -> list[int]:
    """The flat input index each output element of a rearrange copies, read off its fields
    directly: the listed elements, or the strided view enumerated index by index."""
    if node.elements:
        return list(node.elements)
    return [
        node.offset + sum(i * s for i, s in zip(position, node.strides))
        for position in itertools.product(*(range(n) for n in node.sizes))
    ]


def _flat(idx: tuple[int, ...], shape: tuple[int, ...]) -> int:
    f = 0
    for i, n in zip(idx, shape):
        f = f * n + i
    return f


# ----------------------------------------------------------------------------------------------
# The neuron DAG
# ----------------------------------------------------------------------------------------------


@dataclass
class ParamBlock:
    layer: str
    role: str  # "weight" | "bias"
    start: int
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass
class NeuronDAG:
    graph: Graph
    G: nx.DiGraph
    theta: torch.Tensor  # float64, flat
    blocks: list[ParamBlock]
    elements: dict[str, list]  # graph node name -> neuron id per flat output element
    shapes: dict[str, tuple[int, ...]]
    sources: list
    outputs: list
    _paths: list | None = field(default=None, repr=False)
    _padded_cache: tuple | None = field(default=None, repr=False)

    @property
    def p(self) -> int:
        return int(self.theta.numel())

    def block(self, layer: str, role: str) -> ParamBlock | None:
        for b in self.blocks:
            if b.layer == layer and b.role == role:
                return b
        return None

    # ---- paths ---------------------------------------------------------------------------
    def paths(self) -> list[tuple[list[int], float]]:
        """Every source→output path as (θ indices on it, product of its fixed constants).

        A depth-first walk over the successors in the graph's own order, sources in order:
        the paths, in the order, of ``nx.all_simple_paths(G, s, outputs)`` (a path is yielded on
        reaching an output and continues through it while some other output is off the path),
        without that function's per-step set difference over every output neuron. The fixed
        constants are multiplied in path order from 1.0, as edge by edge.
        """
        if self._paths is None:
            targets = set(self.outputs)
            succ = {a: [(b, e["param"], e["const"]) for b, e in self.G.adj[a].items()] for a in self.G.nodes}
            out = []

            for s in self.sources:
                if s in targets:
                    continue
                # one frame per node of the current path: its successors still to explore, and
                # the θ indices, constant product and outputs count of the path up to it
                stack = [(iter(succ[s]), [], 1.0, 0)]
                while stack:
                    it, idx, const, on_path = stack[-1]
                    nxt = next(it, None)
                    if nxt is None:
                        stack.pop()
                        continue
                    b, param, c = nxt
                    i2, c2 = (idx + [param], const) if param is not None else (idx, const * c)
                    hit = b in targets
                    if hit:
                        assert len(set(i2)) == len(i2), "a parameter appears twice on one path"
                        out.append((i2, c2))
                    # (a DAG: no node of the path can recur, so every successor is explored)
                    if len(targets) > on_path + hit:
                        stack.append((iter(succ[b]), i2, c2, on_path + hit))
            self._paths = out
        return self._paths

    def path_count(self) -> int:
        return len(self.paths())

    def path_count_dp(self) -> int:
        """Number of source→output paths by dynamic programming (exact integer)."""
        count = {n: 0 for n in self.G.nodes}
        for s in self.sources:
            count[s] = 1
        for n in nx.topological_sort(self.G):
            for m in self.G.successors(n):
                count[m] += count[n]
        return sum(count[o] for o in self.outputs)

    def _padded(self):
        if self._padded_cache is None:
            paths = self.paths()
            lengths = np.array([len(i) for i, _ in paths], dtype=np.int64)
            width = int(lengths.max()) if len(paths) else 0
            # row r holds path r's θ indices, then the index p (the constant 1 appended to θ)
            idx = np.full((len(paths), max(width, 1)), self.p, dtype=np.int64)
            rows = np.repeat(np.arange(len(paths)), lengths)
            cols = np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            idx[rows, cols] = np.fromiter(itertools.chain.from_iterable(i for i, _ in paths), np.int64, len(rows))
            idx = torch.from_numpy(idx)
            const = torch.tensor([c for _, c in paths], dtype=torch.float64)
            self._padded_cache = idx, const
        return self._padded_cache

    def phi(self, theta: torch.Tensor) -> torch.Tensor:
        """Path-lifting Φ(θ): one entry per path, product of the edge values along it."""
        idx, const = self._padded()
        ext = torch.cat([theta, theta.new_ones(1)])
        return const * ext[idx].prod(dim=1)

    def jacobian(self) -> torch.Tensor:
        """J = ∂Φ/∂θ by ONE reverse-mode pass: every path reads its own copy of θ (row r of
        Θ = θ repeated per path, a leaf), so ∂(Σ_r Φ_r(Θ_r))/∂Θ_r = ∂Φ_r/∂θ = row r of J, exactly
        what the per-path vector-Jacobian products give, without the paths × paths work of
        vectorising one of them per path."""
        idx, const = self._padded()
        n = idx.shape[0]
        rows = torch.cat([self.theta, self.theta.new_ones(1)]).expand(n, self.p + 1).clone().requires_grad_(True)
        phi = const * rows.gather(1, idx).prod(dim=1)
        (grad,) = torch.autograd.grad(phi.sum(), rows)
        return grad[:, : self.p]

    def diag_G(self) -> torch.Tensor:
        """diag(JᵀJ) with J the autograd Jacobian of Φ."""
        J = self.jacobian()
        return (J * J).sum(0)

    def log_diag_G(self) -> np.ndarray:
        """log g_i = logsumexp over paths P ∋ i of Σ_{e∈P, e≠i} 2 ln|θ_e| (+ 2 ln|consts|).

        Pure brute force in the log domain: valid for weights far outside float64's product range.
        """
        log_abs = np.log(np.abs(self.theta.numpy()))
        terms: list[list[float]] = [[] for _ in range(self.p)]
        for idx, const in self.paths():
            if const == 0:
                continue
            total = 2 * (log_abs[idx].sum() + math.log(abs(const)))
            for i in idx:
                terms[i].append(total - 2 * log_abs[i])
        out = np.full(self.p, -np.inf)
        for i, t in enumerate(terms):
            if t:
                t = np.array(t)
                m = t.max()
                if np.isfinite(m):
                    out[i] = m + math.log(np.exp(t - m).sum())
        return out

    # ---- evaluation with real activations (oracle self-check) ------------------------------
    def forward(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """Evaluate the neuron DAG on ONE input (flat, float64) with real activations."""
        theta = self.theta.numpy()
        val = {}
        inp = self.graph.inputs[0].name
        for f, n in enumerate(self.elements[inp]):
            val[n] = float(x[f])
        for n in nx.topological_sort(self.G):
            kind = self.G.nodes[n]["kind"]
            if kind == "input":
                continue
            if kind == "bias":
                val[n] = 1.0
                continue
            if kind == "neginf":
                val[n] = -math.inf
                continue
            ins = [(m, self.G.edges[m, n]) for m in self.G.predecessors(n)]
            terms = [val[m] * (theta[e["param"]] if e["param"] is not None else e["const"]) for m, e in ins]
            if kind == "max":
                v = max(terms)
            else:
                v = sum(terms)
            if kind == "relu":
                v = max(v, 0.0)
            elif kind == "leaky":
                v = v if v >= 0 else v * self.G.nodes[n]["slope"]
            val[n] = v
        return {o: np.array([val[n] for n in self.elements[o]]) for o in self.graph.outputs}

    def forward_check(self, params, *, seed: int = 0, train: bool = False) -> float:
        """Max relative difference between this neuron DAG and the torch forward (one input)."""
        shape = self.shapes[self.graph.inputs[0].name]
        x = torch.randn((1, *shape), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        ref = torch_forward(self.graph, params, x)
        mine = self.forward(x.flatten().numpy())
        return max(rel_err(ref[o].flatten(), torch.from_numpy(mine[o])) for o in self.graph.outputs)

    # ---- groups ------------------------------------------------------------------------------
    def groups(self) -> tuple[dict, set]:
        """Independent union-find: neuron -> root, and the set of fixed roots."""
        parent = {n: n for n in self.G.nodes if self.G.nodes[n]["kind"] != "bias"}

        def find(a):
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        def union(a, b):
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[ra] = rb

        # weight sharing: all positions of one conv channel share one λ
        # zero padding: the constant-zero padded neurons take their channel's scale (any is admissible)
        for node in self.graph.nodes:
            if isinstance(node, (Conv, ConvTranspose, Pad, ChannelAffine, FixedFilter)):
                elems = self.elements[node.name]
                C = self.shapes[node.name][0]
                per = len(elems) // C
                for c in range(C):
                    for e in elems[c * per + 1 : (c + 1) * per]:
                        union(elems[c * per], e)
        # weight sharing on the input side: a conv reads every position of an input channel
        # through the same kernel, so those positions share one λ
        for node in self.graph.nodes:
            if isinstance(node, (Conv, ConvTranspose)):
                elems = self.elements[node.inputs[0]]
                C = self.shapes[node.inputs[0]][0]
                per = len(elems) // C
                for c in range(C):
                    for e in elems[c * per + 1 : (c + 1) * per]:
                        union(elems[c * per], e)
        # fixed edges tie their two ends
        for a, b, e in self.G.edges(data=True):
            if e["param"] is None:
                union(a, b)
        roots = {n: find(n) for n in parent}
        fixed = {roots[n] for n in self.elements[self.graph.inputs[0].name]}
        fixed |= {roots[n] for n in self.outputs}
        return roots, fixed

    def group_columns(self, engine_groups) -> dict:
        """Map every neuron to the engine's free-group column (or None when fixed).

        Asserts that the engine's partition equals the independent one: a bijection between
        free classes, and fixed ↔ the engine's fixed slot.
        """
        roots, fixed = self.groups()
        H = engine_groups.num_free
        root_to_col: dict = {}
        col_to_root: dict = {}
        for node in self.graph.nodes:
            eng = engine_groups.node_groups[node.name]
            shape = self.shapes[node.name]
            per = math.prod(shape[1:])
            per_element = eng.dim() > 1  # held per element where they need not share a scale
            for f, n in enumerate(self.elements[node.name]):
                col = int(eng.reshape(-1)[f] if per_element else eng[f // per])
                r = roots[n]
                want = None if r in fixed else r
                if want is None:
                    assert col == H, f"{node.name}[{f}]: engine puts fixed neuron in free group {col}"
                    continue
                assert col < H, f"{node.name}[{f}]: engine fixes a neuron the oracle finds free"
                assert root_to_col.setdefault(r, col) == col, f"{node.name}[{f}]: engine splits a group"
                assert col_to_root.setdefault(col, r) == r, f"{node.name}[{f}]: engine merges two groups"
        assert len(col_to_root) == H, "the engine has free groups that own no neuron"
        return {n: (None if roots[n] in fixed else root_to_col[roots[n]]) for n in roots}

    def dense_B(self, engine_groups) -> np.ndarray:
        """Explicit B (p × H) from the edges: B[i, grp(t)] += 1, B[i, grp(s)] −= 1 (bias: +1)."""
        cols = self.group_columns(engine_groups)
        H = engine_groups.num_free
        B = np.zeros((self.p, H))
        seen: dict[int, np.ndarray] = {}
        for a, b, e in self.G.edges(data=True):
            i = e["param"]
            if i is None:
                continue
            row = np.zeros(H)
            if cols[b] is not None:
                row[cols[b]] += 1
            if self.G.nodes[a]["kind"] != "bias" and cols[a] is not None:
                row[cols[a]] -= 1
            if i in seen:
                assert np.array_equal(seen[i], row), f"shared parameter {i} has inconsistent B rows"
            else:
                seen[i] = row
        assert len(seen) == self.p, "some parameter labels no edge"
        for i, row in seen.items():
            B[i] = row
        return B


# ----------------------------------------------------------------------------------------------
# Construction
# ----------------------------------------------------------------------------------------------


def fold(graph: Graph, node, params) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SPEC §1 folding, written out: W' = a·W, b' = a·(b − μ) + β, a = γ/√(var+eps)."""
    W = params[node.weight].to(torch.float64)
    if isinstance(node, Linear) and node.weight_transposed:
        W = W.t()
    if isinstance(node, ConvTranspose):  # stored [I, O/g, *k] -> canonical [O, I/g, *k], written out
        I, Opg, ks = W.shape[0], W.shape[1], tuple(W.shape[2:])
        g = node.groups
        Ipg = I // g
        Wc = torch.empty((g * Opg, Ipg, *ks), dtype=torch.float64)
        for i in range(I):
            for o in range(Opg):
                Wc[(i // Ipg) * Opg + o, i % Ipg] = W[i, o]
        W = Wc
    b = params[node.bias].to(torch.float64) if node.bias else None
    bn = _bn_for(graph, node.name)
    if bn is None:
        return W.clone(), (None if b is None else b.clone())
    gamma, beta = params[bn.weight].to(torch.float64), params[bn.bias].to(torch.float64)
    mu, var = params[bn.running_mean].to(torch.float64), params[bn.running_var].to(torch.float64)
    a = gamma / torch.sqrt(var + bn.eps)
    Wf = W * a.reshape(-1, *([1] * (W.dim() - 1)))
    bf = a * ((b if b is not None else torch.zeros_like(mu)) - mu) + beta
    return Wf, bf


def build_neuron_dag(graph: Graph, params) -> NeuronDAG:
    G = nx.DiGraph()
    shapes: dict[str, tuple[int, ...]] = {}
    elements: dict[str, list] = {}
    thetas: list[torch.Tensor] = []
    blocks: list[ParamBlock] = []
    sources: list = []
    offset = 0

    def new_neurons(name: str, shape, kind: str, **attrs) -> list:
        ids = [("n", name, f) for f in range(math.prod(shape))]
        for n in ids:
            G.add_node(n, kind=kind, **attrs)
        shapes[name] = tuple(shape)
        elements[name] = ids
        return ids

    def edge(a, b, *, param=None, const=None):
        assert not G.has_edge(a, b), f"duplicate edge {a}->{b}"
        G.add_edge(a, b, param=param, const=const)

    def add_bias(layer: str, b: torch.Tensor, out: list) -> None:
        """One bias source per output channel, with an edge to each of that channel's neurons."""
        nonlocal offset
        count = b.numel()
        blocks.append(ParamBlock(layer, "bias", offset, (count,)))
        thetas.append(b.flatten())
        per = len(out) // count
        for o in range(count):
            bs = ("b", layer, o)
            G.add_node(bs, kind="bias")
            sources.append(bs)
            for f in range(o * per, (o + 1) * per):
                edge(bs, out[f], param=offset + o)
        offset += count

    bn_of = {}
    for node in graph.nodes:
        if isinstance(node, BatchNorm):
            bn_of[node.inputs[0]] = node

    for node in graph.nodes:
        if isinstance(node, Input):
            ids = new_neurons(node.name, node.shape, "input")
            sources.extend(ids)
            continue
        if isinstance(node, BatchNorm):  # folded into its producer: same neurons
            shapes[node.name] = shapes[node.inputs[0]]
            elements[node.name] = elements[node.inputs[0]]
            continue
        xin = node.inputs[0]
        ishape = shapes[xin]
        src = elements[xin]
        if isinstance(node, (Linear, Conv, ConvTranspose)):
            W, b = fold(graph, node, params)
            if bn_of.get(node.name) is not None:
                assert _bn_for(graph, node.name) is bn_of[node.name]
            w_start = offset
            blocks.append(ParamBlock(node.name, "weight", offset, tuple(W.shape)))
            thetas.append(W.flatten())
            offset += W.numel()
            if isinstance(node, Linear):
                O, I = W.shape
                assert ishape == (I,), (node.name, ishape, W.shape)
                out = new_neurons(node.name, (O,), "affine")
                for o in range(O):
                    for i in range(I):
                        edge(src[i], out[o], param=w_start + o * I + i)
            elif isinstance(node, ConvTranspose):
                # input position i feeds output position i·s − p + k·d through kernel tap k
                r = W.dim() - 2
                O, Ipg, ks = W.shape[0], W.shape[1], tuple(W.shape[2:])
                C, sp = ishape[0], ishape[1:]
                s, p, d = _tup(node.stride, r), _tup(node.padding, r), _tup(node.dilation, r)
                op = _tup(node.output_padding, r)
                groups = node.groups
                osp = tuple((sp[j] - 1) * s[j] - 2 * p[j] + d[j] * (ks[j] - 1) + op[j] + 1 for j in range(r))
                out = new_neurons(node.name, (O, *osp), "affine")
                Opg = O // groups
                for o in range(O):
                    g = o // Opg
                    for ci in range(Ipg):
                        c = g * Ipg + ci
                        for kpos in itertools.product(*(range(k) for k in ks)):
                            pi = w_start + _flat((o, ci, *kpos), (O, Ipg, *ks))
                            for ipos in itertools.product(*(range(n) for n in sp)):
                                opos = tuple(ipos[j] * s[j] - p[j] + kpos[j] * d[j] for j in range(r))
                                if all(0 <= opos[j] < osp[j] for j in range(r)):
                                    edge(src[_flat((c, *ipos), (C, *sp))], out[_flat((o, *opos), (O, *osp))], param=pi)
            else:
                r = W.dim() - 2
                O, Ipg, ks = W.shape[0], W.shape[1], tuple(W.shape[2:])
                C, sp = ishape[0], ishape[1:]
                s, p, d = _tup(node.stride, r), _tup(node.padding, r), _tup(node.dilation, r)
                groups = node.groups
                assert C == Ipg * groups
                osp = tuple(conv_out_size(sp[j], ks[j], s[j], p[j], d[j]) for j in range(r))
                out = new_neurons(node.name, (O, *osp), "affine")
                Opg = O // groups
                for o in range(O):
                    g = o // Opg
                    for ci in range(Ipg):
                        c = g * Ipg + ci
                        for kpos in itertools.product(*(range(k) for k in ks)):
                            pi = w_start + _flat((o, ci, *kpos), (O, Ipg, *ks))
                            for opos in itertools.product(*(range(n) for n in osp)):
                                ipos = tuple(opos[j] * s[j] - p[j] + kpos[j] * d[j] for j in range(r))
                                if all(0 <= ipos[j] < sp[j] for j in range(r)):
                                    edge(src[_flat((c, *ipos), (C, *sp))], out[_flat((o, *opos), (O, *osp))], param=pi)
            if b is not None:
                add_bias(node.name, b, out)
            continue
        if isinstance(node, (ReLU, LeakyReLU, Identity, Scale)):
            kind = {ReLU: "relu", LeakyReLU: "leaky", Identity: "sum", Scale: "sum"}[type(node)]
            extra = {"slope": node.negative_slope} if isinstance(node, LeakyReLU) else {}
            out = new_neurons(node.name, ishape, kind, **extra)
            for a, b_ in zip(src, out):
                edge(a, b_, const=node.factor if isinstance(node, Scale) else 1.0)
        elif isinstance(node, PReLU):
            slopes = params[node.weight].to(torch.float64).flatten().tolist()
            per = math.prod(ishape[1:])
            out = new_neurons(node.name, ishape, "leaky")
            for f, (a, b_) in enumerate(zip(src, out)):
                G.nodes[b_]["slope"] = slopes[f // per if len(slopes) > 1 else 0]
                edge(a, b_, const=1.0)
        elif isinstance(node, Pad):
            C, sp = ishape[0], ishape[1:]
            r = len(sp)
            osp = tuple(sp[j] + node.begin[j] + node.end[j] for j in range(r))
            # padded positions: no incoming edge, value 0 (or -inf); the other modes copy one input pixel.
            # Negative widths crop first, and the mode pads what is left.
            numpy_mode = {"reflect": "reflect", "replicate": "edge", "circular": "wrap"}.get(node.mode)
            out = new_neurons(node.name, (C, *osp), "sum")
            kept = [np.arange(n)[max(-b, 0) : n - max(-e, 0)] for n, b, e in zip(sp, node.begin, node.end)]
            widths = [(max(b, 0), max(e, 0)) for b, e in zip(node.begin, node.end)]
            sources_of = [
                np.pad(k, w, mode=numpy_mode) if numpy_mode else np.pad(k, w, constant_values=-1)
                for k, w in zip(kept, widths)
            ]
            for c in range(C):
                for opos in itertools.product(*(range(n) for n in osp)):
                    ipos = tuple(int(sources_of[j][opos[j]]) for j in range(r))
                    if min(ipos) >= 0:
                        edge(src[_flat((c, *ipos), (C, *sp))], out[_flat((c, *opos), (C, *osp))], const=1.0)
                    elif node.mode == "-inf":
                        G.nodes[out[_flat((c, *opos), (C, *osp))]]["kind"] = "neginf"
        elif isinstance(node, ChannelBias):
            # input neuron (c, pos) to output neuron (c, pos) on a fixed edge of 1, and one bias per channel
            out = new_neurons(node.name, ishape, "sum")
            for a, b_ in zip(src, out):
                edge(a, b_, const=1.0)
            add_bias(node.name, params[node.bias].to(torch.float64).flatten(), out)
        elif isinstance(node, FixedFilter):
            # one fixed edge per non-zero tap, of weight the coefficient, within the input channel
            C, sp = ishape[0], ishape[1:]
            r = len(sp)
            ks, s, p, d = _tup(node.kernel, r), _tup(node.stride, r), _tup(node.padding, r), _tup(node.dilation, r)
            taps = np.asarray(node.coefficients).reshape(C, *ks)
            osp = tuple(conv_out_size(sp[j], ks[j], s[j], p[j], d[j]) for j in range(r))
            out = new_neurons(node.name, (C, *osp), "sum")
            for c in range(C):
                for kpos in itertools.product(*(range(k) for k in ks)):
                    if taps[(c, *kpos)] == 0:
                        continue
                    for opos in itertools.product(*(range(n) for n in osp)):
                        ipos = tuple(opos[j] * s[j] - p[j] + kpos[j] * d[j] for j in range(r))
                        if all(0 <= ipos[j] < sp[j] for j in range(r)):
                            edge(
                                src[_flat((c, *ipos), (C, *sp))],
                                out[_flat((c, *opos), (C, *osp))],
                                const=float(taps[(c, *kpos)]),
                            )
        elif isinstance(node, (ChannelShuffle, ChannelSlice, ChannelGather)):
            C, sp = ishape[0], ishape[1:]
            per = math.prod(sp)
            if isinstance(node, ChannelShuffle):
                g = node.groups
                source_of = {j * g + i: i * (C // g) + j for i in range(g) for j in range(C // g)}
            elif isinstance(node, ChannelGather):
                source_of = dict(enumerate(node.channels))
            else:
                source_of = {c - node.start: c for c in range(node.start, node.stop)}
            out = new_neurons(node.name, (len(source_of), *sp), "sum")
            for oc, ic in source_of.items():
                for f in range(per):
                    edge(src[ic * per + f], out[oc * per + f], const=1.0)
        elif isinstance(node, Upsample):
            # One fixed edge per non-zero coefficient, read off torch's response to each unit impulse.
            C, sp = ishape[0], ishape[1:]
            responses = {}
            for ipos in itertools.product(*(range(n) for n in sp)):
                impulse = torch.zeros((1, 1, *sp), dtype=torch.float64)
                impulse[(0, 0, *ipos)] = 1.0
                responses[ipos] = _interpolate(node, impulse)[0, 0]
            osp = tuple(next(iter(responses.values())).shape)
            out = new_neurons(node.name, (C, *osp), "sum")
            for c in range(C):
                for ipos, response in responses.items():
                    for opos in response.nonzero().tolist():
                        edge(
                            src[_flat((c, *ipos), (C, *sp))],
                            out[_flat((c, *opos), (C, *osp))],
                            const=float(response[tuple(opos)]),
                        )
        elif isinstance(node, Rearrange):
            # output element j copies input element copied_elements(node)[j]: a fixed edge of 1
            out = new_neurons(node.name, tuple(node.shape), "sum")
            for j, i in enumerate(copied_elements(node)):
                edge(src[i], out[j], const=1.0)
        elif isinstance(node, Flatten):
            out = new_neurons(node.name, (math.prod(ishape),), "sum")
            for a, b_ in zip(src, out):  # channel-major flattening = same flat order
                edge(a, b_, const=1.0)
        elif isinstance(node, Concat):
            parts = [elements[i] for i in node.inputs]
            sps = {shapes[i][1:] for i in node.inputs}
            assert len(sps) == 1
            C = sum(shapes[i][0] for i in node.inputs)
            out = new_neurons(node.name, (C, *sps.pop()), "sum")
            for a, b_ in zip([n for part in parts for n in part], out):
                edge(a, b_, const=1.0)
        elif isinstance(node, (Add, Sub)):
            # broadcasting: an axis of size 1 feeds every position of that axis; a difference
            # reads its second input on fixed edges of −1
            oshape = tuple(max(sizes) for sizes in zip(*(shapes[i] for i in node.inputs)))
            out = new_neurons(node.name, oshape, "sum")
            for position, i in enumerate(node.inputs):
                assert len(shapes[i]) == len(oshape)
                sign = -1.0 if isinstance(node, Sub) and position == 1 else 1.0
                for opos in itertools.product(*(range(n) for n in oshape)):
                    ipos = tuple(0 if n == 1 else q for n, q in zip(shapes[i], opos))
                    edge(elements[i][_flat(ipos, shapes[i])], out[_flat(opos, oshape)], const=sign)
        elif isinstance(node, ChannelAffine):
            # one weight per channel on the edge from input neuron (c, pos) to output neuron (c, pos)
            C, per = ishape[0], math.prod(ishape[1:])
            w = params[node.weight].to(torch.float64).flatten()
            blocks.append(ParamBlock(node.name, "weight", offset, (C, 1)))  # a depthwise [O, I/groups] weight
            thetas.append(w)
            out = new_neurons(node.name, ishape, "affine")
            for c in range(C):
                for f in range(per):
                    edge(src[c * per + f], out[c * per + f], param=offset + c)
            offset += C
            if node.bias is not None:
                add_bias(node.name, params[node.bias].to(torch.float64), out)
        elif isinstance(node, (MaxPool, AvgPool)):
            C, sp = ishape[0], ishape[1:]
            r = len(sp)
            k, s, p = _tup(node.kernel, r), _tup(node.stride, r), _tup(node.padding, r)
            d = _tup(node.dilation, r) if isinstance(node, MaxPool) else (1,) * r
            osp = tuple(pool_out_size(sp[j], k[j], s[j], p[j], d[j], node.ceil_mode) for j in range(r))
            is_max = isinstance(node, MaxPool)
            out = new_neurons(node.name, (C, *osp), "max" if is_max else "sum")
            for c in range(C):
                for opos in itertools.product(*(range(n) for n in osp)):
                    tgt = out[_flat((c, *opos), (C, *osp))]
                    if is_max:
                        div = 1.0
                    else:
                        # torch's avg-pool divisor: window clipped at size+pad; then at the input
                        pool_size, valid = 1, 1
                        for j in range(r):
                            start = opos[j] * s[j] - p[j]
                            end = min(start + k[j], sp[j] + p[j])
                            pool_size *= end - start
                            valid *= min(end, sp[j]) - max(start, 0)
                        div = float(pool_size if node.count_include_pad else valid)
                    for kpos in itertools.product(*(range(kk) for kk in k)):
                        ipos = tuple(opos[j] * s[j] - p[j] + kpos[j] * d[j] for j in range(r))
                        if all(0 <= ipos[j] < sp[j] for j in range(r)):
                            edge(src[_flat((c, *ipos), (C, *sp))], tgt, const=1.0 / div)
        elif isinstance(node, AdaptiveAvgPool):
            C, sp = ishape[0], ishape[1:]
            r = len(sp)
            osz = _tup(node.output_size, r)
            out = new_neurons(node.name, (C, *osz), "sum")
            wins = [[(i * sp[j] // osz[j], -(-((i + 1) * sp[j]) // osz[j])) for i in range(osz[j])] for j in range(r)]
            for c in range(C):
                for opos in itertools.product(*(range(n) for n in osz)):
                    ranges = [range(*wins[j][opos[j]]) for j in range(r)]
                    div = float(math.prod(len(rg) for rg in ranges))
                    tgt = out[_flat((c, *opos), (C, *osz))]
                    for ipos in itertools.product(*ranges):
                        edge(src[_flat((c, *ipos), (C, *sp))], tgt, const=1.0 / div)
        else:  # pragma: no cover
            raise TypeError(f"oracle cannot handle {type(node).__name__}")

    theta = torch.cat(thetas) if thetas else torch.zeros(0, dtype=torch.float64)
    outputs = [n for o in graph.outputs for n in elements[o]]
    assert nx.is_directed_acyclic_graph(G)
    return NeuronDAG(graph, G, theta, blocks, elements, shapes, sources, outputs)


# ----------------------------------------------------------------------------------------------
# Mapping engine quantities onto the oracle's θ ordering
# ----------------------------------------------------------------------------------------------


def engine_blocks(dag: NeuronDAG, engine_groups) -> list[ParamBlock]:
    """The oracle block of each engine DagParam (per layer: weight first, then bias; a layer the
    oracle gives no weight has its bias alone), checking that the engine's canonical,
    BatchNorm-folded values equal the oracle's."""
    roles: dict[str, int] = {}
    out = []
    for dp in engine_groups.dag_params:
        k = roles.get(dp.layer, 0)
        roles[dp.layer] = k + 1
        blk = dag.block(dp.layer, "weight" if k == 0 and dag.block(dp.layer, "weight") is not None else "bias")
        assert blk is not None, f"engine DAG parameter {dp.name} has no oracle counterpart"
        assert tuple(dp.value.shape) == blk.shape, (dp.name, tuple(dp.value.shape), blk.shape)
        mine = dag.theta[blk.start : blk.start + blk.size]
        assert torch.allclose(dp.value.flatten().to(torch.float64), mine, rtol=1e-12, atol=0), (
            f"{dp.name}: folded values differ"
        )
        out.append(blk)
    assert sum(b.size for b in out) == dag.p, "engine and oracle disagree on p"
    return out


def to_theta_order(dag: NeuronDAG, engine_groups, tensors: list[torch.Tensor], fill=0.0) -> torch.Tensor:
    """Flatten per-DagParam tensors (canonical layout) into the oracle's θ order."""
    out = torch.full((dag.p,), float("nan"), dtype=torch.float64)
    for blk, t in zip(engine_blocks(dag, engine_groups), tensors):
        out[blk.start : blk.start + blk.size] = t.detach().to(torch.float64).reshape(-1)
    assert not torch.isnan(out).any()
    return out


# ----------------------------------------------------------------------------------------------
# The objective F (SPEC §4), from an explicit dense B
# ----------------------------------------------------------------------------------------------


def _logsumexp(x: np.ndarray) -> float:
    m = np.max(x)
    if not np.isfinite(m):
        return float(m)
    return float(m + np.log(np.sum(np.exp(x - m))))


@dataclass
class DenseObjective:
    """F(u) = p·ln Σ g_i e^{−2(Bu)_i} + 2 Σ_i (Bu)_i with explicit log g and dense B, every
    sum over the support g_i > 0 (SPEC §4): the rows of B with g_i = 0 are dropped."""

    log_g: np.ndarray
    B: np.ndarray

    def __post_init__(self):
        support = np.isfinite(self.log_g)
        self.log_g, self.B = self.log_g[support], self.B[support]

    @property
    def p(self) -> int:
        return self.B.shape[0]

    def value(self, u) -> float:
        Bu = self.B @ np.asarray(u, dtype=np.float64)
        return self.p * _logsumexp(self.log_g - 2 * Bu) + 2 * float(Bu.sum())

    def grad(self, u) -> np.ndarray:
        Bu = self.B @ np.asarray(u, dtype=np.float64)
        lw = self.log_g - 2 * Bu
        w = np.exp(lw - np.max(lw))
        w = w / w.sum()
        return -2 * self.p * (self.B.T @ w) + 2 * self.B.sum(0)

    def incidence(self, u) -> tuple[np.ndarray, np.ndarray, float]:
        """A_h, C_h (SPEC §5) and S, at u, in natural scale (use for moderate g only)."""
        w = np.exp(self.log_g - 2 * self.B @ np.asarray(u, dtype=np.float64))
        return (self.B > 0).T.astype(float) @ w, (self.B < 0).T.astype(float) @ w, float(w.sum())

    def minimise(self, x0=None, free: np.ndarray | None = None):
        """scipy L-BFGS-B on F (optionally over a subset of coordinates, the rest at 0)."""
        from scipy.optimize import minimize

        H = self.B.shape[1]
        mask = np.ones(H, bool) if free is None else np.asarray(free, bool)

        def full(v):
            u = np.zeros(H)
            u[mask] = v
            return u

        f = lambda v: self.value(full(v))  # noqa: E731
        g = lambda v: self.grad(full(v))[mask]  # noqa: E731
        v0 = np.zeros(int(mask.sum())) if x0 is None else np.asarray(x0)[mask]
        res = minimize(
            f, v0, jac=g, method="L-BFGS-B", options={"maxiter": 20000, "maxcor": 50, "ftol": 1e-16, "gtol": 1e-12}
        )
        # polish with a few Newton steps on the exact Hessian (tiny H): F* to machine precision
        v = res.x
        for _ in range(30):
            u = full(v)
            Bu = self.B @ u
            lw = self.log_g - 2 * Bu
            w = np.exp(lw - lw.max())
            w /= w.sum()
            Bm = self.B[:, mask]
            mean = Bm.T @ w
            cov = (Bm * w[:, None]).T @ Bm - np.outer(mean, mean)
            hess = 4 * self.p * cov
            grad = g(v)
            try:
                step = np.linalg.solve(hess + 1e-14 * np.eye(len(v)), grad)
            except np.linalg.LinAlgError:
                break
            t = 1.0
            while f(v - t * step) > f(v) + 1e-14 * abs(f(v)) and t > 1e-8:
                t /= 2
            v = v - t * step
            if np.abs(grad).max() < 1e-13:
                break
        return full(v), f(v)


def oracle_objective(dag: NeuronDAG, engine_groups, log_g: np.ndarray | None = None) -> DenseObjective:
    """F from the oracle's own g (autograd diag(JᵀJ)) and its own dense B."""
    if log_g is None:
        with np.errstate(divide="ignore"):
            log_g = np.log(dag.diag_G().numpy())
    return DenseObjective(np.asarray(log_g, dtype=np.float64), dag.dense_B(engine_groups))
