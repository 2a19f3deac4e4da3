"""Path norms, path-magnitude scores and the ℓ1 path-metric (SPEC §8) against brute force.

The oracle (tests/oracle.py) enumerates every path of the explicit neuron-level DAG and gives
Φ(θ) entry by entry; nothing of pathcond's diag / pathlift code is used to compute the
expected values. Checked here:

1. ‖Φ‖_q (q = 1, 1.5, 2, 4) equals (Σ_P |Φ_P|^q)^{1/q};
2. path norms are unchanged by admissible rescalings (``groups.apply``), large ones included;
3. every path-magnitude score Δ_i equals ‖Φ(θ)‖₁ − ‖Φ(θ with θ_i = 0)‖₁ and is invariant;
4. the path-metric's bounds bracket the brute-force d = ‖Φ(θ) − Φ(θ')‖₁, are exact when one
   vector dominates the other, vanish for rescaling-equivalent vectors; the telescoped sum is
   the brute-force telescoped sum at the engine's representatives and is rescaling-invariant;
   sign flips are counted per layer;
5. seed 004 Theorem 4.1 on the real network (ReLU-only DAGs): ‖R_θ(x) − R_θ'(x)‖₁ ≤
   max(‖x‖∞, 1)·d for sign-consistent pairs, with equality for non-negative dominated pairs at
   x = 1 (no max-pool), where the engine's exact metric must give the same number;
6. the engine's path count is the DP path count of the neuron DAG.

Also: path values far outside float64 (log-domain brute force), and a dead channel.
Engine results are computed once per network (``Base``, ``Pair``) and shared by the tests.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CATALOGUE
from oracle import _bn_for, build_neuron_dag, engine_blocks, fold, to_theta_order

from pathcond_cli.engine.diag import balanced_value, balancing_exponents, path_count, path_magnitude_scores, path_norm
from pathcond_cli.engine.evaluate import forward
from pathcond_cli.engine.graph import (
    BatchNorm,
    ChannelAffine,
    ChannelBias,
    Conv,
    ConvTranspose,
    LeakyReLU,
    Linear,
    MaxPool,
    PReLU,
)
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.engine.pathlift import compare_signs, path_metric, telescoped_sum

MAX_PATHS = 20000
# Every catalogue network is small enough (the largest has ~3.5k paths); the oracle's own
# self-check (neuron DAG == torch forward) lives in the other oracle test files.
ARCHS = sorted(CATALOGUE)
# The 18 ceil-mode pooling variants all get the norm, score and count checks; the pair tests
# (metric, telescoped sum, signs, Lipschitz) take five of them, to keep the file fast.
CEIL_KEPT = {"ceil_max1d_pad1", "ceil_max2d_pad1", "ceil_max3d_pad0", "ceil_avg2d_pad1_excl", "ceil_avg3d_pad1_incl"}
PAIR_ARCHS = [a for a in ARCHS if not a.startswith("ceil_") or a in CEIL_KEPT]
RELU_ARCHS = [a for a in PAIR_ARCHS if not any(isinstance(n, (LeakyReLU, PReLU)) for n in CATALOGUE[a](0)[0].nodes)]
# The bound is attained with every edge non-negative (no max-pool); a network with negative fixed
# constants (a signed fixed filter, a negative scale, a difference) gets the inequality only.
NO_MAXPOOL_RELU_ARCHS = [a for a in RELU_ARCHS if not any(isinstance(n, MaxPool) for n in CATALOGUE[a](0)[0].nodes)]
REL = 1e-9

_CACHE: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Hundreds of tiny convolutions: intra-op threads only add overhead (3-4× on a loaded
    2-core machine). Restored afterwards for the rest of the session."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Base:
    """One catalogue network: graph, params, the oracle DAG (paths enumerated once) and the
    engine's groups, with the engine results every test reuses computed once."""

    def __init__(self, arch: str):
        self.arch = arch
        graph, params = CATALOGUE[arch](0)
        self.graph = graph
        self.params = {k: v.to(torch.float64) for k, v in params.items()}
        self.dag = build_neuron_dag(graph, self.params)
        n = self.dag.path_count_dp()
        assert 0 < n <= MAX_PATHS, (arch, n)
        self.idx, self.const = self.dag._padded()
        self.groups = build_groups(graph, self.params)
        self.theta = self.dag.theta
        self.phi0 = self.phi(self.theta)
        self.l1 = float(self.phi0.abs().sum())
        self.pairs: dict = {}
        self._norms: dict = {}

    def phi(self, theta: torch.Tensor) -> torch.Tensor:
        ext = torch.cat([theta, theta.new_ones(1)])
        return self.const * ext[self.idx].prod(dim=1)

    def norm(self, q: float):
        if q not in self._norms:
            self._norms[q] = path_norm(self.groups, q)
        return self._norms[q]

    def theta_of(self, params) -> torch.Tensor:
        """The oracle's folded θ of another parameter set of this architecture (SPEC §1 fold
        written out in tests/oracle.py; same block order as the neuron DAG)."""
        parts = []
        for blk in self.dag.blocks:
            node = self.graph[blk.layer]
            if isinstance(node, (ChannelAffine, ChannelBias)):
                t = params[node.weight if blk.role == "weight" else node.bias]
            else:
                W, b = fold(self.graph, node, params)
                t = W if blk.role == "weight" else b
            assert t.numel() == blk.size, (blk, t.shape)
            parts.append(t.to(torch.float64).reshape(-1))
        return torch.cat(parts)


def _base(arch: str) -> Base:
    if arch not in _CACHE:
        _CACHE[arch] = Base(arch)
    return _CACHE[arch]


def _seed(arch: str, k: int) -> torch.Generator:
    return torch.Generator().manual_seed(sum(ord(c) * (i + 1) for i, c in enumerate(arch)) * 7919 + k)


def _rescaled(groups, params, gen, scale: float):
    u = torch.randn(groups.num_free, generator=gen, dtype=torch.float64) * scale
    moved = groups.apply(params, u)
    out = {**params, **{k: moved[k] for k in moved}}
    # the rescaling must actually move something (else every invariance check is vacuous)
    change = max(float(((out[k] - params[k]).abs() / params[k].abs().clamp_min(1e-300)).max()) for k in moved)
    assert change > 0.05 * min(scale, 1.0), f"rescaling by |u|~{scale} barely moved the parameters ({change})"
    return out


def _weighted(graph):
    return [n for n in graph.nodes if isinstance(n, (Linear, Conv, ConvTranspose, ChannelAffine))]


def _scaled_pair(graph, params, gen, *, low: float, high: float, zero_prob: float = 0.0):
    """θ' = θ ⊙ r with r ∈ (low, high] (some weights zeroed with ``zero_prob``), built on the
    checkpoint tensors so that the FOLDED DAG parameters are the folded θ times r: weights
    times r (a BatchNorm folds in as a positive-or-negative per-row factor, same for both),
    a plain bias times r, and a BatchNorm-folded bias b' moved to s·b' through β."""
    out = dict(params)

    def draw(shape, allow_zero):
        r = low + (high - low) * (1.0 - torch.rand(shape, generator=gen, dtype=torch.float64))  # (low, high]
        if allow_zero and zero_prob:
            r = torch.where(torch.rand(shape, generator=gen, dtype=torch.float64) < zero_prob, torch.zeros_like(r), r)
        return r

    for node in graph.nodes:
        if isinstance(node, ChannelBias):
            out[node.bias] = params[node.bias] * draw(params[node.bias].shape, True)
    for node in _weighted(graph):
        W = params[node.weight]
        out[node.weight] = W * draw(W.shape, True)
        bn = None if isinstance(node, ChannelAffine) else _bn_for(graph, node.name)
        if bn is None:
            if node.bias:
                b = params[node.bias]
                out[node.bias] = b * draw(b.shape, True)
        else:
            _, b_folded = fold(graph, node, params)
            s = draw(b_folded.shape, False).clamp_min(0.05)
            if high <= 1.0:
                s = s.clamp_max(0.95)  # strictly inside: rounding in the re-fold keeps |s·b'| ≤ |b'|
            out[bn.bias] = params[bn.bias] + (s - 1.0) * b_folded
    return out


def _flip_signs(graph, groups, params, gen):
    """Flip the sign of k_L (1, 2, 3, ...) weight entries of each DAG layer; returns (params, {layer: k_L})."""
    out = dict(params)
    expected = {}
    layers = list(dict.fromkeys(dp.layer for dp in groups.dag_params))
    for j, layer in enumerate(layers):
        node = graph[layer]
        key = node.bias if isinstance(node, ChannelBias) else node.weight  # a bias alone: its only parameter
        W = params[key]
        k = min(j % 3 + 1, W.numel())
        pick = torch.randperm(W.numel(), generator=gen)[:k]
        flat = W.clone().reshape(-1)
        assert bool((flat[pick] != 0).all())
        flat[pick] = -flat[pick]
        out[key] = flat.reshape(W.shape)
        expected[layer] = k
    return out, expected


def _outputs(graph, params, x) -> torch.Tensor:
    ys = forward(graph, params, x)
    return torch.cat([ys[o].reshape(x.shape[0], -1) for o in graph.outputs], dim=1)


class Pair:
    """θ' of one kind for a base network, its oracle θ' and Φ(θ'), and the engine's comparison
    of (θ, θ') (computed once: several tests read it)."""

    def __init__(self, base: Base, kind: str):
        gen = _seed(base.arch, {"mixed": 1, "shrunk": 2, "rescaled": 3, "flipped": 4}[kind])
        self.expected_flips = None
        if kind == "mixed":
            self.params = _scaled_pair(base.graph, base.params, gen, low=0.0, high=2.0)
        elif kind == "shrunk":
            self.params = _scaled_pair(base.graph, base.params, gen, low=0.0, high=1.0, zero_prob=0.3)
        elif kind == "rescaled":
            self.params = _rescaled(base.groups, base.params, gen, 5.0)
        else:
            self.params, self.expected_flips = _flip_signs(base.graph, base.groups, base.params, gen)
        self.theta = base.theta_of(self.params)
        self.phi = base.phi(self.theta)
        self.l1 = float(self.phi.abs().sum())
        self.d = float((base.phi0 - self.phi).abs().sum())
        self.groups = build_groups(base.graph, self.params)
        self.norm1 = path_norm(self.groups, 1)
        self.signs = compare_signs(base.groups, self.groups)
        self.metric = path_metric(base.groups, self.groups, base.norm(1), self.norm1, self.signs)


def _pair(base: Base, kind: str) -> Pair:
    if kind not in base.pairs:
        base.pairs[kind] = Pair(base, kind)
    return base.pairs[kind]


def _balanced_theta(base: Base, groups) -> torch.Tensor:
    """The engine's balanced representative Dθ of ``groups`` (same architecture as ``base``),
    laid out in the oracle's θ order."""
    u_ext = groups.extend(balancing_exponents(groups))
    out = torch.full((base.dag.p,), float("nan"), dtype=torch.float64)
    for blk, dp in zip(engine_blocks(base.dag, base.groups), groups.dag_params):
        st = balanced_value(dp, u_ext, "cpu")
        out[blk.start : blk.start + blk.size] = (st.value * math.exp(st.log_scale)).reshape(-1)
    assert not torch.isnan(out).any()
    return out


def _telescoped_brute(base: Base, a: torch.Tensor, b: torch.Tensor) -> float:
    """Σ_P |c_P| Σ_k |b_1 … b_{k−1}| |a_k − b_k| |a_{k+1} … a_L|, the edges of each path in
    source → output order (the oracle's padding slots hold 1 in both vectors: no term, factor 1)."""
    A = torch.cat([a, a.new_ones(1)])[base.idx]
    B = torch.cat([b, b.new_ones(1)])[base.idx]
    ones = A.new_ones(A.shape[0], 1)
    prefix = torch.cat([ones, torch.cumprod(B.abs(), dim=1)[:, :-1]], dim=1)
    suffix = torch.cat([torch.cumprod(A.abs().flip(1), dim=1).flip(1)[:, 1:], ones], dim=1)
    return float((base.const.abs()[:, None] * prefix * (A - B).abs() * suffix).sum())


# ----------------------------------------------------------------------------------------------
# 1-2. path norms
# ----------------------------------------------------------------------------------------------

QS = (1.0, 1.5, 2.0, 4.0)


@pytest.mark.parametrize("arch", ARCHS)
def test_path_norm_equals_brute_force(arch):
    base = _base(arch)
    assert bool((base.phi0 != 0).any())
    # oracle fold written out here == the neuron DAG's θ (guards theta_of, used by every pair)
    assert torch.equal(base.theta_of(base.params), base.theta)
    for q in QS:
        expected = float((base.phi0.abs() ** q).sum() ** (1.0 / q))
        norm = base.norm(q)
        assert norm.value is not None, (q, norm.log10)
        assert norm.value == pytest.approx(expected, rel=REL), f"q={q}: engine {norm.value!r}, brute force {expected!r}"
        assert norm.log10 == pytest.approx(math.log10(expected), abs=REL)


@pytest.mark.parametrize("arch", ARCHS)
def test_path_norm_rescaling_invariant(arch):
    base = _base(arch)
    moved = _pair(base, "rescaled")
    # oracle view of the admissible rescaling: Φ itself is unchanged, entry by entry
    err = float((moved.phi - base.phi0).abs().max())
    assert err <= REL * float(base.phi0.abs().max()), f"groups.apply changed Φ by {err!r}"
    assert float((moved.theta - base.theta).abs().max()) > 1e-2, "the rescaling left θ in place"
    for q in QS:
        expected = float((base.phi0.abs() ** q).sum() ** (1.0 / q))
        after = moved.norm1 if q == 1 else path_norm(moved.groups, q)
        assert after.value == pytest.approx(expected, rel=REL), f"q={q}: rescaled {after.value!r} vs {expected!r}"
        assert after.log10 == pytest.approx(base.norm(q).log10, abs=REL)


EXTREME_ARCHS = [
    "mlp",
    "residual",
    "conv_bn",
    "conv_transpose",
    "channel_affine",
    "concat",
    "avgpool_ceil",
    "upsample_bilinear_frac",
    "mlp_bottleneck",
]
FACTORS = (1e200, 1e-40, 1e180, 1e100, 1e-150, 1e250)


def _extreme(base: Base) -> dict:
    """Every weighted layer's weight and bias (BatchNorm: β and running mean too, so the folded
    bias scales with it) times a factor from FACTORS: path values far outside float64."""
    out = dict(base.params)
    for node, factor in zip(_weighted(base.graph), FACTORS * 4):
        keys = [node.weight, node.bias]
        bn = None if isinstance(node, ChannelAffine) else _bn_for(base.graph, node.name)
        if bn is not None:
            keys += [bn.bias, bn.running_mean]
        for key in keys:
            if key:
                out[key] = out[key] * factor
    return out


def _log_abs_phi(base: Base, theta: torch.Tensor) -> torch.Tensor:
    """ln |Φ_P| per path, summed in the log domain (no product leaves float64)."""
    ext = torch.cat([theta.abs().log(), theta.new_zeros(1)])
    return ext[base.idx].sum(dim=1) + base.const.abs().log()


@pytest.mark.parametrize("arch", EXTREME_ARCHS)
def test_path_norm_and_scores_extreme_scales(arch):
    """Path values up to 1e160–1e500: ‖Φ‖_q (log10) and ln Δ_i = ln Σ_{P ∋ i} |Φ_P| against log-domain brute force."""
    base = _base(arch)
    params = _extreme(base)
    theta = base.theta_of(params)
    log_phi = _log_abs_phi(base, theta)
    assert 2 * float(log_phi.max()) > math.log(1e308), "not extreme enough: |Φ_P|² must leave float64"
    groups = build_groups(base.graph, params)
    for q in QS:
        expected = float(torch.logsumexp(q * log_phi, 0)) / q / math.log(10)
        got = path_norm(groups, q).log10
        assert got == pytest.approx(expected, abs=1e-9 * max(1.0, abs(expected))), (
            f"q={q}: log10 {got!r} vs {expected!r}"
        )
    scores = path_magnitude_scores(groups)
    engine = torch.cat([s.reshape(-1) for s in scores])
    blocks = engine_blocks(base.dag, base.groups)
    expected = torch.full((base.dag.p,), -math.inf, dtype=torch.float64)
    for i in range(base.dag.p):
        on = (base.idx == i).any(dim=1)
        if bool(on.any()):
            expected[i] = torch.logsumexp(log_phi[on], 0)
    order = torch.cat([torch.arange(b.start, b.start + b.size) for b in blocks])
    expected = expected[order]
    assert torch.equal(torch.isneginf(engine), torch.isneginf(expected))
    finite = torch.isfinite(expected)
    assert not torch.isnan(engine).any()
    err = (engine[finite] - expected[finite]).abs().max()
    assert float(err) <= 1e-9 * max(1.0, float(expected[finite].abs().max())), f"max |Δ ln Δ_i| = {float(err):.3e}"


@pytest.mark.parametrize("arch", EXTREME_ARCHS)
def test_path_metric_extreme_scales(arch):
    """The path-metric of (θ, θ ⊙ r) with path values beyond float64, against a log-domain
    brute force: ln d = ln Σ_P |Φ_P(θ)| · |1 − Φ_P(θ')/Φ_P(θ)| (same signs on every path)."""
    base = _base(arch)
    params = _extreme(base)
    theta = base.theta_of(params)
    groups = build_groups(base.graph, params)
    norm = path_norm(groups, 1)
    log_phi = _log_abs_phi(base, theta)
    for kind, (low, high, zeros) in {"mixed": (0.0, 2.0, 0.0), "shrunk": (0.0, 1.0, 0.3)}.items():
        params_b = _scaled_pair(base.graph, params, _seed(arch, 81), low=low, high=high, zero_prob=zeros)
        theta_b = base.theta_of(params_b)
        assert bool((theta * theta_b >= 0).all())
        log_phi_b = _log_abs_phi(base, theta_b)
        ln_d = float(torch.logsumexp(log_phi + torch.log(torch.expm1(log_phi_b - log_phi).abs()), 0))
        ln_l1, ln_l1_b = float(torch.logsumexp(log_phi, 0)), float(torch.logsumexp(log_phi_b, 0))
        groups_b = build_groups(base.graph, params_b)
        signs = compare_signs(groups, groups_b)
        metric = path_metric(groups, groups_b, norm, path_norm(groups_b, 1), signs)
        assert signs.flips == 0
        assert metric.exact == (kind == "shrunk")
        tol = 1e-9 * max(1.0, abs(ln_l1))
        # d ≥ |‖Φ‖₁ − ‖Φ'‖₁|, as logarithms
        high_, low_ = max(ln_l1, ln_l1_b), min(ln_l1, ln_l1_b)
        ln_lower = high_ + math.log(-math.expm1(low_ - high_))
        assert metric.ln_lower == pytest.approx(ln_lower, abs=tol), kind
        assert metric.ln_lower <= ln_d + tol, f"{kind}: ln lower {metric.ln_lower!r} > ln d {ln_d!r}"
        assert ln_d <= metric.ln_upper + tol, f"{kind}: ln d {ln_d!r} > ln upper {metric.ln_upper!r}"
        if kind == "shrunk":
            assert metric.ln_lower == pytest.approx(ln_d, abs=tol), (
                f"exact ln lower {metric.ln_lower!r} vs ln d {ln_d!r}"
            )


# ----------------------------------------------------------------------------------------------
# 3. path-magnitude scores
# ----------------------------------------------------------------------------------------------


def _brute_scores(base: Base, theta: torch.Tensor | None = None) -> torch.Tensor:
    """Δ_i = ‖Φ(θ)‖₁ − ‖Φ(θ with θ_i = 0)‖₁ for every i, by zeroing θ_i and recomputing Φ."""
    theta = base.theta if theta is None else theta
    p, l1 = base.dag.p, float(base.phi(theta).abs().sum())
    out = torch.empty(p, dtype=torch.float64)
    for start in range(0, p, 32):
        rows = torch.arange(start, min(start + 32, p))
        T = theta.repeat(len(rows), 1)
        T[torch.arange(len(rows)), rows] = 0.0
        ext = torch.cat([T, T.new_ones(len(rows), 1)], dim=1)
        out[rows] = l1 - (base.const * ext[:, base.idx].prod(dim=2)).abs().sum(dim=1)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_path_magnitude_scores_equal_brute_force(arch):
    base = _base(arch)
    dag, groups = base.dag, base.groups
    scores = path_magnitude_scores(groups)
    assert len(scores) == len(groups.dag_params)
    for dp, s in zip(groups.dag_params, scores):
        assert tuple(s.shape) == tuple(dp.value.shape), dp.name
        assert not torch.isnan(s).any() and not torch.isposinf(s).any(), dp.name
    engine = to_theta_order(dag, groups, [s.exp() for s in scores])
    brute = _brute_scores(base)
    err = (engine - brute).abs()
    worst = int(err.argmax())
    assert float(err.max()) <= REL * base.l1, (
        f"Δ[{worst}]: engine {float(engine[worst])!r}, brute force {float(brute[worst])!r} (‖Φ‖₁ = {base.l1!r})"
    )
    # exact zeros (parameters on no path) are −inf, and nothing else is
    used = torch.zeros(dag.p + 1, dtype=torch.bool)
    used[base.idx.reshape(-1)] = True
    log_engine = to_theta_order(dag, groups, scores)
    assert torch.equal(torch.isneginf(log_engine), ~used[:-1] | (base.theta == 0))
    # Δ_i = Σ_{P ∋ i} |Φ_P| ≤ ‖Φ‖₁
    assert float(brute.max()) <= base.l1 * (1 + REL)


@pytest.mark.parametrize("arch", PAIR_ARCHS)
def test_path_magnitude_scores_rescaling_invariant(arch):
    base = _base(arch)
    moved = _pair(base, "rescaled")
    before = path_magnitude_scores(base.groups)
    after = path_magnitude_scores(moved.groups)
    for dp, a, b in zip(base.groups.dag_params, before, after):
        ea, eb = a.exp(), b.exp()
        assert torch.equal(torch.isneginf(a), torch.isneginf(b)), dp.name
        err = float((ea - eb).abs().max())
        assert err <= REL * base.l1, f"{dp.name}: scores moved by {err!r} under a rescaling (‖Φ‖₁ = {base.l1!r})"
        finite = torch.isfinite(a)
        rel = float(((ea - eb).abs() / ea)[finite].max()) if bool(finite.any()) else 0.0
        assert rel <= REL, f"{dp.name}: relative change {rel!r} of a score under a rescaling"


DEAD_ARCHS = [
    "mlp",
    "mlp_nobias_transposed",
    "residual",
    "conv_bn",
    "conv_transpose",
    "channel_affine",
    "concat",
    "grouped_conv",
    "shuffle_split",
    "conv3d",
]


@pytest.mark.parametrize("arch", DEAD_ARCHS)
def test_dead_channel(arch):
    """Channel 0 of the first layer zeroed entirely (weights in, bias; BatchNorm shift too): a
    free group with no incoming mass, on which the balancing has nothing to normalise. Norms,
    scores (−inf exactly where Δ = 0) and the metric against the intact network still match."""
    base = _base(arch)
    params = dict(base.params)
    first = _weighted(base.graph)[0]
    W = params[first.weight].clone()
    if (isinstance(first, Linear) and first.weight_transposed) or isinstance(first, ConvTranspose):
        W[:, 0] = 0
    else:
        W[0] = 0
    params[first.weight] = W
    keys = [first.bias]
    bn = None if isinstance(first, ChannelAffine) else _bn_for(base.graph, first.name)
    if bn is not None:
        keys += [bn.bias, bn.running_mean]
    for key in keys:
        if key:
            v = params[key].clone()
            v[0] = 0
            params[key] = v
    theta = base.theta_of(params)
    phi = base.phi(theta)
    l1 = float(phi.abs().sum())
    assert int((theta == 0).sum()) > 0 and int((phi == 0).sum()) > 0
    groups = build_groups(base.graph, params)
    for q in QS:
        expected = float((phi.abs() ** q).sum() ** (1.0 / q))
        assert path_norm(groups, q).value == pytest.approx(expected, rel=REL), q
    scores = path_magnitude_scores(groups)
    engine = torch.cat([s_.reshape(-1) for s_ in scores])
    order = torch.cat([torch.arange(b.start, b.start + b.size) for b in engine_blocks(base.dag, base.groups)])
    brute = _brute_scores(base, theta)[order]
    assert not torch.isnan(engine).any()
    assert float((engine.exp() - brute).abs().max()) <= REL * l1
    assert torch.equal(torch.isneginf(engine), brute == 0)
    d = float((base.phi0 - phi).abs().sum())
    for groups_a, groups_b, norms in ((base.groups, groups, (base.l1, l1)), (groups, base.groups, (l1, base.l1))):
        signs = compare_signs(groups_a, groups_b)
        metric = path_metric(groups_a, groups_b, path_norm(groups_a, 1), path_norm(groups_b, 1), signs)
        # zeroing dominates either way round: (a_dominates, b_dominates) = (True, False) or the reverse
        assert signs.flips == 0 and (signs.a_dominates, signs.b_dominates) == (
            (True, False) if groups_a is base.groups else (False, True)
        )
        assert metric.exact
        slack = _check_bracket(*norms, d, metric, "dead channel")
        assert metric.lower == pytest.approx(d, abs=slack)


# ----------------------------------------------------------------------------------------------
# 4. the ℓ1 path-metric
# ----------------------------------------------------------------------------------------------


def _check_bracket(norm_a: float, norm_b: float, d: float, metric, label: str) -> float:
    slack = REL * max(norm_a, norm_b)
    assert metric.lower is not None and metric.upper is not None, label
    assert metric.lower == pytest.approx(abs(norm_a - norm_b), abs=slack), f"{label}: lower is not |‖Φ‖₁ − ‖Φ'‖₁|"
    assert metric.lower <= d + slack, f"{label}: lower {metric.lower!r} > d {d!r}"
    assert d <= metric.upper + slack, f"{label}: d {d!r} > upper {metric.upper!r}"
    assert metric.lower <= metric.upper, label
    return slack


def _dominates(x, y) -> bool:
    """|y_i| ≤ |x_i| with x_i y_i ≥ 0 for every i (y is x pruned / shrunk)."""
    return bool(((x * y >= 0) & (y.abs() <= x.abs())).all())


@pytest.mark.parametrize("arch", PAIR_ARCHS)
def test_path_metric_brackets_d_sign_consistent(arch):
    base = _base(arch)
    pair = _pair(base, "mixed")
    assert bool((base.theta * pair.theta > 0).all()), "oracle: the construction flipped or zeroed a folded sign"
    assert pair.signs.flips == 0, [s for s in pair.signs.layers if s.flips]
    # r spans (0, 2]: neither vector dominates, and the engine must not claim it does
    assert not _dominates(base.theta, pair.theta) and not _dominates(pair.theta, base.theta)
    assert not pair.signs.a_dominates and not pair.signs.b_dominates
    assert not pair.metric.exact
    assert pair.d > 0
    _check_bracket(base.l1, pair.l1, pair.d, pair.metric, "θ ⊙ r, r ∈ (0, 2]")


@pytest.mark.parametrize("direction", ["a_dominates", "b_dominates"])
@pytest.mark.parametrize("arch", PAIR_ARCHS)
def test_path_metric_exact_when_shrinking(arch, direction):
    base = _base(arch)
    pair = _pair(base, "shrunk")
    assert _dominates(base.theta, pair.theta), "oracle: the shrunk θ' does not shrink every folded entry"
    assert bool((pair.theta == 0).any()), "no pruned entry"
    if direction == "a_dominates":
        signs, metric, norms = pair.signs, pair.metric, (base.l1, pair.l1)
    else:  # the same pair, the other way round
        signs = compare_signs(pair.groups, base.groups)
        metric = path_metric(pair.groups, base.groups, pair.norm1, base.norm(1), signs)
        norms = (pair.l1, base.l1)
    assert signs.flips == 0
    assert getattr(signs, direction), "engine misses the dominance"
    assert not getattr(signs, "b_dominates" if direction == "a_dominates" else "a_dominates")
    assert metric.exact
    assert pair.d > 0
    slack = _check_bracket(*norms, pair.d, metric, direction)
    assert metric.lower == pytest.approx(pair.d, abs=slack), f"exact lower {metric.lower!r} ≠ d {pair.d!r}"
    assert metric.upper == metric.lower


@pytest.mark.parametrize("arch", PAIR_ARCHS)
def test_path_metric_zero_for_rescaled_pair(arch):
    base = _base(arch)
    pair = _pair(base, "rescaled")
    assert pair.signs.flips == 0
    assert pair.d <= REL * base.l1  # oracle: Φ unchanged
    assert not pair.metric.exact  # a rescaling by random λ dominates neither way
    assert pair.metric.upper is not None and pair.metric.upper <= REL * base.l1, (
        f"upper {pair.metric.upper!r} for two rescaling-equivalent vectors (‖Φ‖₁ = {base.l1!r})"
    )
    assert pair.metric.lower <= REL * base.l1, f"lower {pair.metric.lower!r} (‖Φ‖₁ = {base.l1!r})"


@pytest.mark.parametrize("arch", PAIR_ARCHS)
def test_telescoped_sum_brute_force_and_invariance(arch):
    """The two-stream pass equals the per-path telescoped sum at the engine's balanced
    representatives; it bounds d by itself; rescaling both arguments leaves it unchanged."""
    base = _base(arch)
    pair = _pair(base, "mixed")
    for dp, blk in zip(pair.groups.dag_params, engine_blocks(base.dag, base.groups)):  # same layout, θ' values
        assert torch.allclose(
            dp.value.reshape(-1).to(torch.float64), pair.theta[blk.start : blk.start + blk.size], rtol=1e-12, atol=0
        ), dp.name
    ln_tele, _ = telescoped_sum(base.groups, pair.groups)
    brute = _telescoped_brute(base, _balanced_theta(base, base.groups), _balanced_theta(base, pair.groups))
    assert math.exp(ln_tele) == pytest.approx(brute, rel=REL), (
        f"two-stream pass {math.exp(ln_tele)!r}, per path {brute!r}"
    )
    assert pair.d <= math.exp(ln_tele) * (1 + REL), f"telescoped sum {math.exp(ln_tele)!r} < d {pair.d!r}"
    assert pair.metric.upper == pytest.approx(math.exp(ln_tele), rel=REL)
    gen = _seed(arch, 41)
    moved_a = build_groups(base.graph, _rescaled(base.groups, base.params, gen, 5.0))
    moved_b = build_groups(base.graph, _rescaled(pair.groups, pair.params, gen, 5.0))
    ln_moved, _ = telescoped_sum(moved_a, moved_b)
    assert ln_moved == pytest.approx(ln_tele, abs=REL), "the telescoped bound depends on the representatives"


@pytest.mark.parametrize("arch", PAIR_ARCHS)
def test_sign_flips_counted_per_layer(arch):
    base = _base(arch)
    pair = _pair(base, "flipped")
    sizes: dict[str, int] = {}
    for blk in engine_blocks(base.dag, base.groups):
        sizes[blk.layer] = sizes.get(blk.layer, 0) + blk.size
    got = {s.layer: s.flips for s in pair.signs.layers}
    assert got == pair.expected_flips, f"flips per layer {got}, expected {pair.expected_flips}"
    assert {s.layer: s.parameters for s in pair.signs.layers} == sizes
    assert pair.signs.flips == sum(pair.expected_flips.values()) == int((base.theta * pair.theta < 0).sum())
    assert not pair.signs.a_dominates and not pair.signs.b_dominates and not pair.metric.exact
    # the bounds themselves need no sign condition
    _check_bracket(base.l1, pair.l1, pair.d, pair.metric, "flipped")


# ----------------------------------------------------------------------------------------------
# 5. seed 004 Theorem 4.1 on the real network
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", RELU_ARCHS)
def test_lipschitz_bound_on_real_outputs(arch):
    base = _base(arch)
    gen = _seed(arch, 61)
    shape = tuple(base.graph.inputs[0].shape)
    for kind in ("mixed", "shrunk"):
        pair = _pair(base, kind)
        assert pair.signs.flips == 0 and pair.d > 0
        for R in (0.5, 1.0, 3.0):
            x = (2 * torch.rand((32, *shape), generator=gen, dtype=torch.float64) - 1) * R
            corners = torch.where(torch.rand((32, *shape), generator=gen) < 0.5, -R, R).to(torch.float64)
            x = torch.cat([x, corners])
            gap = (_outputs(base.graph, base.params, x) - _outputs(base.graph, pair.params, x)).abs().sum(dim=1)
            norm_x = x.flatten(1).abs().amax(dim=1).clamp_min(1.0)
            bound = norm_x * pair.d
            worst = int((gap - bound).argmax())
            assert bool((gap <= bound * (1 + REL)).all()), (
                f"{kind}, R={R}: ‖R_θ(x) − R_θ'(x)‖₁ = {float(gap[worst])!r} > max(‖x‖∞,1)·d = {float(bound[worst])!r}"
            )
            assert bool((gap <= norm_x * pair.metric.upper * (1 + REL)).all())
            assert float(gap.max()) > 0


@pytest.mark.parametrize("arch", NO_MAXPOOL_RELU_ARCHS)
def test_lipschitz_bound_attained_nonnegative(arch):
    """004: the bound is attained for non-negative θ, θ' and x. With every folded parameter
    ≥ 0, θ' ≤ θ entrywise and x = 1, every ReLU is active and (no max-pool) the network is the
    path sum R_θ(1) = Σ_P Φ_P(θ): ‖R_θ(1) − R_θ'(1)‖₁ = d, which the engine's exact metric must
    also give. The real network, the oracle's Φ and the engine meet in one equality. With a
    negative fixed edge (found in the oracle's neuron DAG) the engine's d is still exact and the
    real network's gap is at most d."""
    base = _base(arch)
    gen = _seed(arch, 71)
    bn_stats = {n.running_mean for n in base.graph.nodes if isinstance(n, BatchNorm)}
    positive = {k: (torch.zeros_like(v) if k in bn_stats else v.abs()) for k, v in base.params.items()}
    shrunk = _scaled_pair(base.graph, positive, gen, low=0.0, high=1.0, zero_prob=0.3)
    theta_a, theta_b = base.theta_of(positive), base.theta_of(shrunk)
    assert bool((theta_a >= 0).all()) and bool((theta_b >= 0).all()) and _dominates(theta_a, theta_b)
    d = float((base.phi(theta_a) - base.phi(theta_b)).abs().sum())
    groups_a, groups_b = build_groups(base.graph, positive), build_groups(base.graph, shrunk)
    signs = compare_signs(groups_a, groups_b)
    metric = path_metric(groups_a, groups_b, path_norm(groups_a, 1), path_norm(groups_b, 1), signs)
    assert signs.a_dominates and metric.exact
    assert metric.lower == pytest.approx(d, rel=REL), f"engine d = {metric.lower!r}, brute-force d = {d!r}"
    x = torch.ones((1, *base.graph.inputs[0].shape), dtype=torch.float64)
    gap = float((_outputs(base.graph, positive, x) - _outputs(base.graph, shrunk, x)).abs().sum())
    if any(e["const"] is not None and e["const"] < 0 for _, _, e in base.dag.G.edges(data=True)):
        # A negative fixed edge: some ReLU may be off at x = 1, so the bound holds, not attained.
        assert gap <= d * (1 + REL), f"‖R_θ(1) − R_θ'(1)‖₁ = {gap!r} > brute-force d = {d!r}"
    else:
        assert gap == pytest.approx(d, rel=REL), f"‖R_θ(1) − R_θ'(1)‖₁ = {gap!r}, brute-force d = {d!r}"


# ----------------------------------------------------------------------------------------------
# 6. path count
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_path_count_equals_dp(arch):
    base = _base(arch)
    count = path_count(base.groups)
    n = base.dag.path_count_dp()
    assert count.exact == n, f"engine {count.exact}, neuron DAG {n}"
    assert count.log10 == pytest.approx(math.log10(n), abs=1e-12)
    assert base.idx.shape[0] == n  # enumeration agrees with the DP
