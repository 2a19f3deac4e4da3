"""G-SGD (SPEC §9) against oracles of its own: brute-force path enumeration, autograd of the
loss through another weight allocation, the step in the basis-path space, invariance against
an SGD control, and the refusals.

The oracles below rebuild the skeleton and the basis paths from SPEC §9's text, entry by entry,
and never call the optimizer's internals: only its results (``basis_values``,
``basis_gradient``, ``step``) are compared with them.
"""

from __future__ import annotations

import copy
import itertools
import math

import fake_cuda
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathcond_cli as pathcond
from pathcond_cli.errors import SingularBasisError, UnsupportedModelError, UsageError
from pathcond_cli.gsgd import GSGD


class CustomMLP(nn.Module):
    """Biases on the first and last layer only, torch.relu and F.relu in a forward of its own."""

    def __init__(self, d: int, h: int, k: int):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.mid = nn.Linear(h, h, bias=False)
        self.out = nn.Linear(h, k)

    def forward(self, x):
        return self.out(F.relu(self.mid(torch.relu(self.inp(x)))))


def mlp(widths, *, bias=True) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(a, b, bias=bias))
    return nn.Sequential(*layers)


def conv_chain(channels, kernel=3) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(channels, channels[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Conv1d(a, b, kernel, padding=1))
    return nn.Sequential(*layers)


def drawn(model: nn.Module, seed: int) -> nn.Module:
    """float64, weights and biases ~ N(0, 0.7²) (the skeleton weights kept away from 0)."""
    generator = torch.Generator().manual_seed(seed)
    model = model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.7)
            p.add_(torch.sign(p) * 0.1)
    return model


# -- the oracle: SPEC §9 entry by entry --------------------------------------------------------------


class Chain:
    """A chain's tensors [(key, W, key, b)] and the skeleton and basis paths built from SPEC §9's
    text. An edge is ("w", k, out, in, tap) or ("b", k, out); k is 0-based (weight k feeds
    hidden layer k + 1)."""

    def __init__(self, model: nn.Module):
        params = dict(model.named_parameters())
        self.layers = []
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Conv1d)):
                bias_key = f"{name}.bias" if module.bias is not None else None
                self.layers.append(
                    (
                        f"{name}.weight",
                        params[f"{name}.weight"].detach(),
                        bias_key,
                        None if bias_key is None else params[bias_key].detach(),
                    )
                )
        first, last = self.layers[0][1], self.layers[-1][1]
        self.L, self.h, self.d, self.K = len(self.layers), first.shape[0], first.shape[1], last.shape[0]
        self.taps = list(itertools.product(*(range(s) for s in first.shape[2:])))
        self.centre = tuple(s // 2 for s in first.shape[2:])

    def skeleton_edge(self, k: int, i: int) -> tuple:
        if k == 0:
            return ("w", 0, i, i % self.d, self.centre)
        if k == self.L - 1:
            return ("w", k, i % self.K, i, self.centre)
        return ("w", k, i, i, self.centre)

    def skeleton_path(self, i: int, first: int = 0, stop: int | None = None) -> list[tuple]:
        return [self.skeleton_edge(k, i) for k in range(first, self.L if stop is None else stop)]

    def value(self, edge: tuple) -> float:
        if edge[0] == "b":
            return float(self.layers[edge[1]][3][edge[2]])
        _, k, out, inp, tap = edge
        return float(self.layers[k][1][(out, inp, *tap)])

    def path_value(self, edges) -> float:
        return math.prod(self.value(e) for e in edges)

    def parameter_edges(self) -> list[tuple]:
        edges = []
        for k, (_, W, _, b) in enumerate(self.layers):
            edges += [("w", k, o, i, t) for o in range(W.shape[0]) for i in range(W.shape[1]) for t in self.taps]
            if b is not None:
                edges += [("b", k, o) for o in range(b.shape[0])]
        return edges

    def basis_paths(self) -> dict[tuple, list[tuple]]:
        """('S', i) → S_i, and each non-skeleton edge e → P_e."""
        skeleton = {self.skeleton_edge(k, i) for k in range(self.L) for i in range(self.h)}
        paths = {("S", i): self.skeleton_path(i) for i in range(self.h)}
        for e in self.parameter_edges():
            if e in skeleton:
                continue
            k, out = e[1], e[2]
            before = self.skeleton_path(e[3], 0, k) if e[0] == "w" and k >= 1 else []
            after = self.skeleton_path(out, k + 1) if k < self.L - 1 else []
            paths[e] = [*before, e, *after]
        return paths

    def all_paths(self):
        """Every path of the DAG as (edges, hidden neurons crossed): from an input or a bias to an output."""
        L, h = self.L, range(self.h)
        for neurons in itertools.product(range(self.d), *[h] * (L - 1), range(self.K)):
            for taps in itertools.product(self.taps, repeat=L):
                yield [("w", k, neurons[k + 1], neurons[k], taps[k]) for k in range(L)], list(neurons[1:-1])
        for k, (_, _, _, b) in enumerate(self.layers):
            if b is None:
                continue
            # the bias's neuron (hidden layer k + 1, or an output when k = L − 1), then on to an output
            for neurons in itertools.product(*[h] * (L - 1 - k), range(self.K)):
                for taps in itertools.product(self.taps, repeat=len(neurons) - 1):
                    edges = [("b", k, neurons[0])]
                    edges += [("w", k + 1 + j, neurons[j + 1], neurons[j], tap) for j, tap in enumerate(taps)]
                    yield edges, list(neurons[:-1])

    def coordinate(self, basis, edge: tuple) -> float:
        """The library's coordinate of edge: of P_e, or of S_i at a skeleton weight."""
        if edge[0] == "b":
            key = self.layers[edge[1]][2]
            return float(basis.per_parameter[key][edge[2]])
        _, k, out, inp, tap = edge
        return float(basis.per_parameter[self.layers[k][0]][(out, inp, *tap)])


MODELS = {
    "mlp 3-4-4-2": lambda: drawn(mlp((3, 4, 4, 2)), 0),
    "mlp 2-5-5-5-3 no bias": lambda: drawn(mlp((2, 5, 5, 5, 3), bias=False), 1),
    "mlp 5-3-4 (h < d)": lambda: drawn(mlp((5, 3, 4)), 2),
    "custom forward 3-4-4-2": lambda: drawn(CustomMLP(3, 4, 2), 3),
    "conv1d 2-3-3-2": lambda: drawn(conv_chain((2, 3, 3, 2)), 4),
}
INPUT_SHAPES = {"conv1d 2-3-3-2": (2, 5)}


def optimiser(model, name, lr=0.05, **options) -> GSGD:
    return GSGD(model, lr=lr, input_shape=INPUT_SHAPES.get(name), **options)


@pytest.mark.parametrize("name", MODELS)
def test_basis_paths_by_brute_force(name):
    """m − H basis paths; each non-skeleton parameter on exactly one; the library's values are the
    products along them; every path's value is the product of its edges' basis values over the
    skeleton values of the hidden neurons it crosses."""
    model = MODELS[name]()
    chain = Chain(model)
    basis = chain.basis_paths()
    m = sum(p.numel() for p in model.parameters())
    hidden = chain.h * (chain.L - 1)
    assert len(basis) == m - hidden
    counts = {e: 0 for e in chain.parameter_edges()}
    for edges in basis.values():
        assert len(set(edges)) == len(edges)
        for e in edges:
            counts[e] += 1
    skeleton = {chain.skeleton_edge(k, i) for k in range(chain.L) for i in range(chain.h)}
    assert all(counts[e] == 1 for e in counts if e not in skeleton)

    values = optimiser(model, name).basis_values()
    assert values.flat().numel() == m - hidden
    for key, edges in basis.items():
        library = float(values.skeleton[key[1]]) if key[0] == "S" else chain.coordinate(values, key)
        assert library == pytest.approx(chain.path_value(edges), rel=1e-13, abs=1e-15)
    for edges, crossed in chain.all_paths():
        formula = math.prod(chain.coordinate(values, e) for e in edges) / math.prod(
            float(values.skeleton[i]) for i in crossed
        )
        assert formula == pytest.approx(chain.path_value(edges), rel=1e-12, abs=1e-15)


def alternative_weights(chain: Chain, v_skeleton: torch.Tensor, v_paths: dict) -> dict[str, torch.Tensor]:
    """Weights with basis values v, by an allocation other than G-SGD's: the skeleton weights of
    layers 1..L−1 fixed (at the model's, times 1.5 or 0.75: another representative), those of
    the last layer set to v_S / (the others); every other weight θ_e = v_{P_e} / (the skeleton
    weights on P_e). Differentiable in v."""
    L = chain.L
    kept = [
        torch.tensor(
            [chain.value(chain.skeleton_edge(k, i)) * (1.5 if (i + k) % 2 else 0.75) for i in range(chain.h)],
            dtype=torch.float64,
        )
        for k in range(L - 1)
    ]
    last = v_skeleton / math.prod(kept)
    sigma = [*kept, last]
    weights = {}
    for k, (wkey, W, bkey, b) in enumerate(chain.layers):
        entries = []
        for o in range(W.shape[0]):
            for i in range(W.shape[1]):
                for t in chain.taps:
                    edge = ("w", k, o, i, t)
                    is_skeleton = any(edge == chain.skeleton_edge(k, n) for n in range(chain.h))
                    if is_skeleton:
                        neuron = i if k > 0 else o
                        entries.append(sigma[k][neuron])
                        continue
                    c = math.prod(sigma[j][i] for j in range(k)) if k > 0 else torch.tensor(1.0, dtype=torch.float64)
                    if k < L - 1:
                        c = c * math.prod(sigma[j][o] for j in range(k + 1, L))
                    entries.append(v_paths[edge] / c)
        weights[wkey] = torch.stack(entries).reshape(W.shape)
        if b is not None:
            entries = []
            for o in range(b.shape[0]):
                c = (
                    math.prod(sigma[j][o] for j in range(k + 1, L))
                    if k < L - 1
                    else torch.tensor(1.0, dtype=torch.float64)
                )
                entries.append(v_paths[("b", k, o)] / c)
            weights[bkey] = torch.stack(entries)
    return weights


def loss_of(model, x, y):
    return F.mse_loss(model(x), y)


def batch(name, n=7, seed=5):
    generator = torch.Generator().manual_seed(seed)
    shape = INPUT_SHAPES.get(name, (Chain(MODELS[name]()).d,))
    x = torch.randn((n, *shape), generator=generator, dtype=torch.float64)
    model = MODELS[name]()
    with torch.no_grad():
        y = torch.randn(model(x).shape, generator=generator, dtype=torch.float64)
    return x, y


def autograd_basis_gradient(model, name, x, y):
    """∂ℓ̃/∂v by autograd through :func:`alternative_weights`, at the model's basis values."""
    chain = Chain(model)
    basis = chain.basis_paths()
    v_skeleton = torch.tensor(
        [chain.path_value(basis[("S", i)]) for i in range(chain.h)], dtype=torch.float64, requires_grad=True
    )
    v_paths = {
        e: torch.tensor(chain.path_value(edges), dtype=torch.float64, requires_grad=True)
        for e, edges in basis.items()
        if e[0] != "S"
    }
    weights = alternative_weights(chain, v_skeleton, v_paths)
    own = dict(model.named_parameters())
    assert any(not torch.allclose(W.detach(), own[key]) for key, W in weights.items()), "another representative"
    loss = F.mse_loss(torch.func.functional_call(model, weights, (x,)), y)
    loss.backward()
    # the same basis values, so the same function: a check of the basis values themselves
    assert loss.item() == pytest.approx(loss_of(model, x, y).item(), rel=1e-12)
    return chain, basis, v_skeleton, v_paths


@pytest.mark.parametrize("name", MODELS)
def test_icr_gradient_is_autograd_through_another_allocation(name):
    model = MODELS[name]()
    x, y = batch(name)
    chain, basis, v_skeleton, v_paths = autograd_basis_gradient(model, name, x, y)
    opt = optimiser(model, name)
    loss_of(model, x, y).backward()
    delta = opt.basis_gradient()
    assert torch.allclose(delta.skeleton, v_skeleton.grad, rtol=1e-10, atol=1e-13)
    for e, v in v_paths.items():
        assert chain.coordinate(delta, e) == pytest.approx(float(v.grad), rel=1e-10, abs=1e-13), e


@pytest.mark.parametrize("name", MODELS)
def test_a_step_moves_the_basis_values_to_v_minus_lr_delta(name):
    model = MODELS[name]()
    x, y = batch(name)
    _, basis, v_skeleton, v_paths = autograd_basis_gradient(copy.deepcopy(model), name, x, y)
    lr = 0.05
    opt = optimiser(model, name, lr=lr)
    loss_of(model, x, y).backward()
    opt.step()
    after = Chain(model)
    for i in range(after.h):
        expected = (v_skeleton[i] - lr * v_skeleton.grad[i]).item()
        assert after.path_value(basis[("S", i)]) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    for e, v in v_paths.items():
        assert after.path_value(basis[e]) == pytest.approx((v - lr * v.grad).item(), rel=1e-12, abs=1e-14), e
    # G-SGD's allocation: only the layer-1 skeleton weights change among the skeleton weights
    for k in range(1, after.L):
        for i in range(after.h):
            assert after.value(after.skeleton_edge(k, i)) == Chain(MODELS[name]()).value(after.skeleton_edge(k, i))


def test_weight_decay_acts_on_the_basis_values():
    name = "mlp 3-4-4-2"
    model = MODELS[name]()
    x, y = batch(name)
    lr, decay = 0.05, 0.3
    opt = optimiser(model, name, lr=lr, weight_decay=decay)
    loss_of(model, x, y).backward()
    before, delta = opt.basis_values().flat(), opt.basis_gradient().flat()
    opt.step()
    assert torch.allclose(opt.basis_values().flat(), before - lr * (delta + decay * before), rtol=1e-12, atol=1e-15)


def rescaled(model: nn.Module, seed: int, spread: float = 1.0) -> nn.Module:
    """A copy with every hidden neuron (channel) scaled by e^{N(0, spread²)}: incoming weights and
    bias × λ, outgoing weights ÷ λ."""
    generator = torch.Generator().manual_seed(seed)
    other = copy.deepcopy(model)
    layers = [m for m in other.modules() if isinstance(m, (nn.Linear, nn.Conv1d))]
    with torch.no_grad():
        for into, out_of in zip(layers, layers[1:]):
            lam = torch.exp(torch.randn(into.weight.shape[0], generator=generator, dtype=torch.float64) * spread)
            into.weight.mul_(lam.reshape(-1, *([1] * (into.weight.dim() - 1))))
            if into.bias is not None:
                into.bias.mul_(lam)
            out_of.weight.div_(lam.reshape(1, -1, *([1] * (out_of.weight.dim() - 2))))
    return other


def train(model, name, make_optimiser, x, y, steps):
    opt = make_optimiser(model)
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    return model


def relative_difference(a, b, x) -> float:
    with torch.no_grad():
        fa, fb = a(x), b(x)
    return float((fa - fb).abs().max() / fa.abs().max())


@pytest.mark.parametrize("name", ["mlp 2-5-5-5-3 no bias", "custom forward 3-4-4-2", "mlp 3-4-4-2", "conv1d 2-3-3-2"])
def test_rescaling_equivalent_networks_stay_equivalent_under_gsgd_not_sgd(name):
    model = MODELS[name]()
    twin = rescaled(model, seed=7)
    x, y = batch(name, n=16)
    probe, _ = batch(name, n=32, seed=11)
    assert relative_difference(model, twin, probe) < 1e-13
    before = loss_of(model, x, y).item()
    lr = 0.01
    gsgd = [train(copy.deepcopy(m), name, lambda m: optimiser(m, name, lr=lr), x, y, 100) for m in (model, twin)]
    assert loss_of(gsgd[0], x, y).item() < 0.9 * before, "G-SGD must train"
    assert relative_difference(*gsgd, probe) < 1e-9
    sgd = [
        train(copy.deepcopy(m), name, lambda m: torch.optim.SGD(m.parameters(), lr=lr), x, y, 100)
        for m in (model, twin)
    ]
    assert relative_difference(*sgd, probe) > 1e-3, "the control: SGD depends on the scaling"


def test_float32_stays_float32_and_the_step_is_the_float64_one():
    name = "mlp 3-4-4-2"
    model64 = MODELS[name]()
    model32 = copy.deepcopy(model64).float()
    x, y = batch(name)
    for model in (model64, model32):
        opt = GSGD(model, lr=0.05)
        loss_of(model, x.to(model[0].weight.dtype), y.to(model[0].weight.dtype)).backward()
        opt.step()
        assert opt.basis_values().skeleton.dtype == model[0].weight.dtype
    assert all(p.dtype == torch.float32 for p in model32.parameters())
    for p32, p64 in zip(model32.parameters(), model64.parameters()):
        assert torch.allclose(p32.double(), p64, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["mlp 3-4-4-2", "conv1d 2-3-3-2"])
def test_on_the_fake_cuda_device_the_steps_are_the_cpus(name):
    x, y = batch(name)
    on_cpu = train(MODELS[name](), name, lambda m: optimiser(m, name), x, y, 3)
    with fake_cuda.installed():
        model = MODELS[name]().to("cuda")
        train(model, name, lambda m: optimiser(m, name), x.to("cuda"), y.to("cuda"), 3)
        assert all(p.device.type == "cuda" for p in model.parameters())
        moved = [p.detach().cpu() for p in model.parameters()]
    for p, q in zip(on_cpu.parameters(), moved):
        assert torch.allclose(p.detach(), q, rtol=1e-13, atol=1e-15)


def test_state_dict_round_trip_resumes_the_same_run():
    name = "mlp 3-4-4-2"
    x, y = batch(name)
    model = MODELS[name]()
    opt = optimiser(model, name, lr=0.05, weight_decay=0.01)
    train(model, name, lambda m: opt, x, y, 2)
    opt.param_groups[0]["lr"] = 0.02  # as a scheduler would
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, name, lambda m: opt, x, y, 3)

    resumed = MODELS[name]()
    resumed.load_state_dict(saved_model)
    other = optimiser(resumed, name, lr=1.0)
    other.load_state_dict(saved_opt)
    assert other.param_groups[0]["lr"] == 0.02 and other.param_groups[0]["weight_decay"] == 0.01
    train(resumed, name, lambda m: other, x, y, 3)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_flattened_input_and_dropout_are_part_of_the_chain():
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(6, 4), nn.ReLU(), nn.Dropout(0.0), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3)
    ).double()
    opt = GSGD(model, lr=0.1)
    assert (opt.hidden_width, opt.depth) == (4, 3)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    before = copy.deepcopy(model)
    F.mse_loss(model(x), torch.zeros(5, 3, dtype=torch.float64)).backward()
    opt.step()
    assert not torch.equal(model[1].weight, before[1].weight)


def test_no_gradient_no_step():
    model = MODELS["mlp 3-4-4-2"]()
    before = copy.deepcopy(model.state_dict())
    GSGD(model, lr=0.1).step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- refusals -----------------------------------------------------------------------------------------


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.c(torch.relu(self.b(h)) + h)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.c.weight = self.b.weight
        self.d = nn.Linear(4, 2)

    def forward(self, x):
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


class ExtraParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp((3, 4, 2))
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.body(x)


def frozen() -> nn.Module:
    model = mlp((3, 4, 2))
    model[0].bias.requires_grad_(False)
    return model


REFUSED = {
    "widths": (lambda: mlp((3, 4, 5, 2)), (3,), ["hidden widths 4 ('0'), 5 ('2') differ"]),
    "batchnorm": (
        lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)),
        (3,),
        ["'1' (batchnorm) is no part"],
    ),
    "no hidden layer": (lambda: nn.Sequential(nn.Linear(3, 2)), (3,), ["1 Linear/Conv layer(s)"]),
    "residual": (Residual, (3,), ["(add) is no part", "reads 2 tensors"]),
    "leaky relu": (
        lambda: nn.Sequential(nn.Linear(3, 4), nn.LeakyReLU(), nn.Linear(4, 2)),
        (3,),
        ["(leaky_relu) is no part"],
    ),
    "relu at the output": (
        lambda: nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.ReLU()),
        (3,),
        ["the output is '3' (relu), not the last layer '2'"],
    ),
    "conv then linear": (
        lambda: nn.Sequential(nn.Conv1d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(9, 2)),
        (2, 5),
        ["'2' (flatten) is no part", "Linear and Conv layers mixed"],
    ),
    "grouped conv": (
        lambda: nn.Sequential(nn.Conv1d(2, 4, 3, groups=2), nn.ReLU(), nn.Conv1d(4, 2, 3)),
        (2, 7),
        ["grouped convolution (groups=2)"],
    ),
    "conv channels": (lambda: conv_chain((2, 3, 4, 2)), (2, 5), ["hidden widths 3 ('0'), 4 ('2') differ"]),
    "tied weights": (Tied, (3,), ["share parameter tensors"]),
    "extra parameter": (ExtraParameter, (3,), ["temperature are read by no layer"]),
    "frozen bias": (frozen, (3,), ["'0.bias' is frozen"]),
    "gelu": (lambda: nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 2)), (3,), ["not even a ReLU DAG", "GELU"]),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refusals_name_what_breaks_the_setting(case):
    build, shape, needles = REFUSED[case]
    with pytest.raises(UnsupportedModelError) as raised:
        GSGD(build(), lr=0.1, input_shape=shape)
    for needle in needles:
        assert needle in str(raised.value), str(raised.value)
    assert raised.value.exit_code == 4


def test_a_convolution_needs_its_input_shape_and_bad_options_are_refused():
    with pytest.raises(UsageError, match="input_shape"):
        GSGD(conv_chain((2, 3, 3, 2)), lr=0.1)
    model = mlp((3, 4, 2))
    for options in ({"lr": 0.0}, {"lr": math.nan}, {"lr": 0.1, "weight_decay": -1.0}):
        with pytest.raises(ValueError):
            GSGD(model, **options)
    opt = GSGD(model, lr=0.1)
    with pytest.raises(UsageError, match="no further parameter groups"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]})


def test_a_zero_skeleton_weight_is_refused():
    model = MODELS["mlp 3-4-4-2"]()
    with torch.no_grad():
        model[2].weight[1, 1] = 0.0  # the skeleton weight of hidden neuron 1 in layer 2
    with pytest.raises(SingularBasisError, match=r"neuron\(s\) 1 is 0"):
        GSGD(model, lr=0.1)
    with torch.no_grad():
        model[2].weight[1, 1] = 1.0
        model[2].weight[1, 2] = 0.0  # not a skeleton weight: allowed, and it trains
    opt = GSGD(model, lr=0.1)
    x, y = batch("mlp 3-4-4-2")
    loss_of(model, x, y).backward()
    opt.step()
    assert model[2].weight[1, 2].item() != 0.0


def test_a_step_that_would_zero_a_skeleton_path_raises_and_changes_nothing():
    """With λη = 1 and no loss gradient, v' = v − ηλv = 0 exactly on every basis path."""
    model = MODELS["mlp 3-4-4-2"]()
    opt = GSGD(model, lr=0.5, weight_decay=2.0)
    (0.0 * model(torch.ones(1, 3, dtype=torch.float64)).sum()).backward()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(SingularBasisError, match="would reach 0"):
        opt.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_float32_products_that_underflow_are_refused():
    model = mlp((2, 2, 2, 2, 2), bias=False)
    with torch.no_grad():
        for layer in model[::2]:
            layer.weight.fill_(1e-12)  # each fine in float32; their product over 4 layers is 1e-48, below its range
    with pytest.raises(SingularBasisError):
        GSGD(model, lr=0.1)


def test_exported_from_the_package():
    assert pathcond.GSGD is GSGD and "GSGD" in pathcond.__all__


def test_the_training_benchmark_arms_start_from_one_function():
    """benchmarks/train_gsgd.py's unbalanced initialisation and ENorm cycle preserve the function;
    every arm trains (a smoke run on random data; the comparison itself is a benchmark)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "train_gsgd.py"
    spec = importlib.util.spec_from_file_location("train_gsgd", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    try:
        spec.loader.exec_module(bench)
        generator = torch.Generator().manual_seed(0)
        images, labels = torch.rand(40, 6, generator=generator), torch.randint(0, 3, (40,), generator=generator)
        initial = bench.kaiming_init(bench.mlp((6, 8, 8, 3)), seed=0)
        skewed = bench.unbalanced(initial, seed=0)
        ratio = (skewed[0].weight / initial[0].weight).abs()
        assert torch.allclose(ratio.log().abs(), torch.full_like(ratio, bench.UNBALANCE), rtol=1e-5)
        assert relative_difference(initial, skewed, images) < 1e-5
        cycled = copy.deepcopy(skewed)
        bench.EnormEveryStep(cycled, 6)()
        assert not torch.allclose(cycled[0].weight, skewed[0].weight)
        assert relative_difference(skewed, cycled, images) < 1e-5
        starts = []
        for method in bench.METHODS:
            model = bench.starting_point(skewed, method, 6)
            curve = bench.train(model, method, "classify", images, labels, lr=1e-3, epochs=2, batch=16, seed=0)
            assert len(curve) == 3 and all(math.isfinite(v) for v in curve), (method, curve)
            assert curve[-1] != curve[0], method
            starts.append(curve[0])
        assert max(starts) - min(starts) < 1e-5 * max(starts)
    finally:
        del sys.modules[spec.name]
