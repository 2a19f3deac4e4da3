"""G-SGD (SPEC §9, seed 003): gradient descent on the values of a basis of paths.

    opt = pathcond.GSGD(model, lr=0.05)
    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

The model is a ReLU MLP whose hidden layers all have one width h (biases or not), or a chain
of convolutions with one channel count. Its rescaling-invariant coordinates are the values of
m − H basis paths (m parameters, H hidden neurons): the h skeleton paths, which run through
the skeleton weights (W_1[i, i mod d], W_l[i, i], W_L[i mod K, i]; for convolutions the centre
tap), and one path per other parameter, which adds that parameter to skeleton weights only.
A step takes the weight gradient of an ordinary backward pass, turns it into the gradient of
the loss with respect to those values (the inverse chain rule), steps the values, and writes
weights that have the stepped values (the weight allocation). Two rescaling-equivalent
networks have the same basis values, so they take the same steps: training does not depend on
how the network happens to be scaled, which plain SGD does.

With v_{P_e} = θ_e · c_e (c_e: the product of the skeleton weights on P_e), everything is O(m)
after the backward pass: δ_{P_e} = g_e / c_e, δ_{S_i} = (g_s θ_s − Σ g_e θ_e) / v_{S_i} over the
non-skeleton weights leaving neuron i's hidden copies, v' = v − η δ, and θ'_e = v'_{P_e} / c'_e,
where c' differs from c only by the layer-1 skeleton weights, the only skeleton weights G-SGD
changes. Dividing by c_e rather than by θ_e keeps zero weights (pruned, or initialised so) usable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .engine.graph import Conv, Flatten, Graph, Identity, Input, Linear, ReLU
from .errors import SingularBasisError, UnsupportedModelError, UsageError
from .io.formats.fx_import import module_import

# Nodes that pass a chain's values through unchanged: nn.Identity, and nn.Dropout (the importer
# traces in eval mode; in training, dropout multiplies each unit by a non-negative factor, which
# commutes with every positive rescaling, so the invariance G-SGD relies on still holds).
_PASS_THROUGH = (Identity,)
SETTING = (
    "G-SGD needs a chain x → W_1 → ReLU → W_2 → ReLU → … → W_L (L ≥ 2) of Linear layers whose "
    "hidden layers all have one width, or of convolutions (groups=1) with one hidden channel count (seed 003)"
)


@dataclass(frozen=True)
class _Layer:
    """One Linear or Conv of the chain (its parameters with their names in the module) and its
    skeleton weights: entry (rows[i], cols[i], *centre) of the weight, one per hidden neuron i."""

    weight_key: str
    weight: torch.nn.Parameter
    bias_key: str | None
    bias: torch.nn.Parameter | None
    rows: torch.Tensor
    cols: torch.Tensor
    centre: tuple[int, ...]

    def skeleton(self, weight: torch.Tensor) -> torch.Tensor:
        rows, cols = self.rows.to(weight.device), self.cols.to(weight.device)
        return weight[(rows, cols, *self.centre)]

    def set_skeleton(self, weight: torch.Tensor, values: torch.Tensor) -> None:
        rows, cols = self.rows.to(weight.device), self.cols.to(weight.device)
        weight[(rows, cols, *self.centre)] = values

    def non_skeleton_mask(self) -> torch.Tensor:
        mask = torch.ones_like(self.weight, dtype=torch.bool)
        self.set_skeleton(mask, torch.zeros((), dtype=torch.bool, device=mask.device))
        return mask


@dataclass(frozen=True)
class BasisPaths:
    """Coordinates on G-SGD's basis paths: their values v, or the ICR gradient δ = ∂ℓ̃/∂v.

    ``skeleton[i]`` is the coordinate of hidden neuron i's skeleton path S_i. ``per_parameter``
    maps each parameter's name to a tensor of its shape: at a non-skeleton entry e, the
    coordinate of the basis path P_e that e defines; at a skeleton weight, that of the skeleton
    path it lies on. ``non_skeleton`` maps each name to the mask of its non-skeleton entries.
    """

    skeleton: torch.Tensor
    per_parameter: dict[str, torch.Tensor]
    non_skeleton: dict[str, torch.Tensor]

    def flat(self) -> torch.Tensor:
        """The m − H coordinates: the skeleton paths, then each parameter's non-skeleton entries
        (row-major, in the chain's order: weight, then bias, layer by layer)."""
        return torch.cat([self.skeleton, *(t[self.non_skeleton[name]] for name, t in self.per_parameter.items())])


class _Skeleton:
    """The products of skeleton weights one step needs, from the weights as they are.

    ``inward[k][i]``: the skeleton weights of layers 1..k+1 (input → hidden neuron (k+1, i));
    ``outward[k][i]``: those of layers k+2..L (hidden neuron (k+1, i) → output); ``value[i]``:
    v_{S_i}, all of them. Layers are 0-based here: weight k feeds hidden layer k + 1.
    """

    def __init__(self, layers: Sequence[_Layer], weights: Sequence[torch.Tensor]):
        self.sigma = [layer.skeleton(weight) for layer, weight in zip(layers, weights)]
        self.inward = list(torch.cumprod(torch.stack(self.sigma[:-1]), dim=0).unbind())
        reverse = torch.cumprod(torch.stack(self.sigma[:0:-1]), dim=0).unbind()
        self.outward = list(reversed(reverse))
        self.value = self.inward[-1] * self.sigma[-1]

    def weight_coefficient(
        self, k: int, weight: torch.Tensor, inward: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """c_e for every entry of weight k, shaped to broadcast against it: the skeleton weights
        before e's source neuron times those after its destination neuron (``inward`` to use
        other products before the source, as after a step)."""
        inward = self.inward if inward is None else inward
        last = len(self.sigma) - 1
        out = self.outward[k] if k < last else weight.new_ones(weight.shape[0])
        into = inward[k - 1] if k > 0 else weight.new_ones(weight.shape[1])
        coefficient = out[:, None] * into[None, :]
        return coefficient.reshape(*coefficient.shape, *([1] * (weight.dim() - 2)))

    def bias_coefficient(self, k: int, bias: torch.Tensor) -> torch.Tensor:
        """c for the bias of layer k's neurons: the skeleton weights after them (1 at the output)."""
        return self.outward[k] if k < len(self.sigma) - 1 else torch.ones_like(bias)


class GSGD(torch.optim.Optimizer):
    """G-SGD (Meng et al., ICLR 2019; SPEC §9): SGD on basis-path values, invariant under rescaling.

    ``model``: an ``nn.Module`` torch.fx can trace (``nn.Sequential`` or a custom ``forward``)
    computing x ↦ W_L ReLU(W_{L−1} … ReLU(W_1 x + b_1) …) + b_L, L ≥ 2, every hidden layer of
    one width, biases optional; or the same chain of ``Conv1d/2d/3d`` (groups=1) with one hidden
    channel count. Flatten before the first Linear, ``nn.Identity`` and ``nn.Dropout`` are
    allowed; anything else (other widths, BatchNorm, other activations, skips, a parameter the
    chain does not read, a frozen one) raises :class:`UnsupportedModelError` naming what breaks
    the setting. ``input_shape`` (batch-free) is needed for convolutions; for an MLP it is the
    first layer's ``in_features``.

    ``weight_decay`` λ acts on the basis-path values: the step minimises ℓ̃(v) + λ‖v‖²/2, so
    v' = v − η(δ + λv); like the loss, the penalty is the same for rescaling-equivalent networks.

    The step runs on the parameters' device in their dtype, one host synchronisation per step
    (the check below). A skeleton-path value that is or would become 0, or a product of skeleton
    weights that leaves the dtype's range (the basis coordinates are singular there), raises
    :class:`SingularBasisError` and leaves the model as it was.
    """

    def __init__(
        self, model: torch.nn.Module, lr: float, *, weight_decay: float = 0.0, input_shape: Sequence[int] | None = None
    ):
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a finite number > 0, not {lr}")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, not {weight_decay}")
        source = type(model).__name__
        graph, _, _ = _import(model, input_shape, source)
        self._layers = _chain(graph, model, source)
        first = self._layers[0].weight
        self.hidden_width = len(self._layers[0].rows)
        params = [p for layer in self._layers for p in (layer.weight, layer.bias) if p is not None]
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        with torch.no_grad():
            skeleton = _Skeleton(self._layers, self._weights())
            _check_usable(skeleton, [], first.dtype, "the model as given")

    def add_param_group(self, param_group: dict) -> None:
        if self.param_groups:
            raise UsageError(
                "G-SGD steps the whole chain in one basis-path space; it takes no further parameter groups "
                "(give other parameters an optimizer of their own)."
            )
        super().add_param_group(param_group)

    @property
    def depth(self) -> int:
        """L, the number of weight layers (L − 1 hidden layers of ``hidden_width`` neurons)."""
        return len(self._layers)

    def _weights(self) -> list[torch.Tensor]:
        return [layer.weight for layer in self._layers]

    def _paths(
        self, skeleton_values: torch.Tensor, weight_values: list[torch.Tensor], bias_values: list[torch.Tensor | None]
    ) -> BasisPaths:
        per_parameter, masks = {}, {}
        for layer, weight, bias in zip(self._layers, weight_values, bias_values):
            with_skeleton = weight.clone()
            layer.set_skeleton(with_skeleton, skeleton_values)
            per_parameter[layer.weight_key], masks[layer.weight_key] = with_skeleton, layer.non_skeleton_mask()
            if bias is not None:
                per_parameter[layer.bias_key] = bias
                masks[layer.bias_key] = torch.ones_like(bias, dtype=torch.bool)
        return BasisPaths(skeleton_values, per_parameter, masks)

    @torch.no_grad()
    def basis_values(self) -> BasisPaths:
        """v: the value of every basis path, v_P = Π_{e∈P} θ_e."""
        skeleton = _Skeleton(self._layers, self._weights())
        weights = [layer.weight * skeleton.weight_coefficient(k, layer.weight) for k, layer in enumerate(self._layers)]
        biases = [
            None if layer.bias is None else layer.bias * skeleton.bias_coefficient(k, layer.bias)
            for k, layer in enumerate(self._layers)
        ]
        return self._paths(skeleton.value, weights, biases)

    @torch.no_grad()
    def basis_gradient(self) -> BasisPaths:
        """δ = ∂ℓ̃/∂v from the parameters' ``.grad`` (the inverse chain rule; a missing grad counts as 0)."""
        skeleton = _Skeleton(self._layers, self._weights())
        gradient = _icr(self._layers, skeleton)
        return self._paths(gradient.skeleton, gradient.weights, gradient.biases)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One G-SGD step from the parameters' ``.grad``: v' = v − η(δ + λv) on every basis path,
        then the weight allocation of SPEC §9. Does nothing when no parameter has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if all(p.grad is None for p in self.param_groups[0]["params"]):
            return loss
        lr, decay = self.param_groups[0]["lr"], self.param_groups[0]["weight_decay"]
        layers = self._layers
        skeleton = _Skeleton(layers, self._weights())
        gradient = _icr(layers, skeleton)
        # v' = v − η(δ + λv) for the skeleton paths; R = v'/v is the ratio the layer-1 skeleton
        # weights take, and every path through them (all c_e of layers ≥ 2) is multiplied by it.
        stepped = skeleton.value - lr * (gradient.skeleton + decay * skeleton.value)
        ratio = stepped / skeleton.value
        inward_after = [inward * ratio for inward in skeleton.inward]
        _check_usable(skeleton, [stepped, *inward_after], layers[0].weight.dtype, f"a step with lr {lr:g}")
        updated = []
        for k, (layer, grad_w, delta_b) in enumerate(zip(layers, gradient.weights, gradient.biases)):
            weight = layer.weight
            coefficient = skeleton.weight_coefficient(k, weight)
            value = weight * coefficient
            new_value = value - lr * (grad_w + decay * value)
            new_weight = new_value / skeleton.weight_coefficient(k, weight, inward_after)
            layer.set_skeleton(new_weight, skeleton.sigma[0] * ratio if k == 0 else skeleton.sigma[k])
            new_bias = None
            if layer.bias is not None:
                bias_coefficient = skeleton.bias_coefficient(k, layer.bias)
                bias_value = layer.bias * bias_coefficient
                new_bias = (bias_value - lr * (delta_b + decay * bias_value)) / bias_coefficient
            updated.append((new_weight, new_bias))
        for layer, (new_weight, new_bias) in zip(layers, updated):
            layer.weight.copy_(new_weight)
            if new_bias is not None:
                layer.bias.copy_(new_bias)
        return loss


@dataclass(frozen=True)
class _Gradient:
    """δ per basis path: one per skeleton path, and at each weight and bias entry δ_{P_e}
    (the entries of skeleton weights hold g/c there, which no step reads)."""

    skeleton: torch.Tensor
    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]


def _grad(parameter: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(parameter) if parameter.grad is None else parameter.grad


def _icr(layers: Sequence[_Layer], skeleton: _Skeleton) -> _Gradient:
    """The inverse chain rule (SPEC §9): δ_{P_e} = g_e θ_e / v_{P_e} = g_e / c_e for every
    non-skeleton parameter; δ_{S_i} = (g_s θ_s − Σ_e g_e θ_e) / v_{S_i}, s the layer-1 skeleton
    weight of neuron i and e the non-skeleton weights leaving neuron i in hidden layers 1..L−1:
    with g_e θ_e = δ_{P_e} v_{P_e}, the chain rule ∂ℓ/∂θ_s · θ_s = Σ_{P ∋ s} δ_P v_P solved for δ_{S_i}."""
    weights, biases = [], []
    through_first = None
    leaving = torch.zeros_like(skeleton.value)
    for k, layer in enumerate(layers):
        grad = _grad(layer.weight)
        weights.append(grad / skeleton.weight_coefficient(k, layer.weight))
        biases.append(None if layer.bias is None else _grad(layer.bias) / skeleton.bias_coefficient(k, layer.bias))
        product = grad * layer.weight
        if k == 0:
            through_first = layer.skeleton(product)
        else:  # column i of weight k leaves hidden neuron (k, i); its skeleton entry is no P_e of its own
            leaving += product.sum(dim=[0, *range(2, product.dim())]) - layer.skeleton(product)
    return _Gradient((through_first - leaving) / skeleton.value, weights, biases)


def _check_usable(skeleton: _Skeleton, after: Sequence[torch.Tensor], dtype: torch.dtype, when: str) -> None:
    """Raise :class:`SingularBasisError` unless every skeleton product (before and, with
    ``after``, after the step) is finite and non-zero: one host synchronisation."""
    products = [*skeleton.inward, *skeleton.outward, skeleton.value, *after]
    usable = torch.stack([torch.all(torch.isfinite(p) & (p != 0)) for p in products]).all()
    if bool(usable):
        return
    zero = [i for i, v in enumerate(skeleton.value.tolist()) if v == 0]
    stepped = after[0].tolist() if after else []
    reached = [i for i, v in enumerate(stepped) if v == 0]
    if zero or reached:
        neurons = zero or reached
        what = "is 0" if zero else "would reach 0 (v − η(δ + λv) = 0)"
        raise SingularBasisError(
            f"G-SGD, {when}: the skeleton path value of hidden neuron(s) {_listed(neurons)} {what}; the basis-path "
            "coordinates are singular there (every path value is divided by it). "
            + (
                "Give the skeleton weights non-zero values (W_1[i, i mod d], W_l[i, i], W_L[i mod K, i]; the centre "
                "taps of a convolution)."
                if zero
                else "A smaller learning rate steps past it."
            )
            + " The model was not changed."
        )
    raise SingularBasisError(
        f"G-SGD, {when}: a product of skeleton weights is not finite or leaves {dtype}'s range (a NaN or infinite "
        "gradient, or skeleton weights too large or too small for the dtype); the basis-path coordinates are singular "
        "there. The model was not changed."
    )


def _listed(indices: Sequence[int]) -> str:
    return ", ".join(map(str, indices[:10])) + (f" and {len(indices) - 10} more" if len(indices) > 10 else "")


def _import(model: torch.nn.Module, input_shape: Sequence[int] | None, source: str):
    """The module's ReLU DAG (torch.fx), its input shape taken from the first 2-d parameter
    (a Linear's in_features) when not given."""
    if input_shape is None:
        weights = [p for p in model.parameters() if p.dim() >= 2]
        if not weights or weights[0].dim() != 2:
            raise UsageError(
                f"{source}: give GSGD the batch-free input_shape (e.g. input_shape=(3, 32, 32)); it is "
                "inferred only for a model whose first layer is a Linear."
            )
        input_shape = (weights[0].shape[1],)
    try:
        return module_import(model, tuple(input_shape), source=source)
    except UnsupportedModelError as error:
        root = error.problems[: len(error.problems) - len(error.follow_on)]
        raise UnsupportedModelError(
            f"{source}: {SETTING}; this module is not even a ReLU DAG:", root, error.follow_on
        ) from None


def _chain(graph: Graph, model: torch.nn.Module, source: str) -> list[_Layer]:
    """The chain's layers with their skeleton weights, or :class:`UnsupportedModelError`
    listing every node, width and parameter that breaks the setting."""
    problems: list[str] = []
    weighted: list[Linear | Conv] = []
    if len(graph.outputs) != 1:
        problems.append(f"{len(graph.outputs)} outputs; G-SGD needs one")
    previous = None  # the last node that is neither a pass-through nor a Flatten of the input
    for node in graph.nodes:
        if isinstance(node, Input):
            previous = node
        elif isinstance(node, _PASS_THROUGH) or (isinstance(node, Flatten) and isinstance(previous, Input)):
            pass
        elif isinstance(node, (Linear, Conv)):
            if not isinstance(previous, (Input, ReLU)):
                problems.append(f"'{node.name}' ({node.op}) follows '{previous.name}' ({previous.op}), not a ReLU")
            if isinstance(node, Conv) and node.groups != 1:
                problems.append(f"'{node.name}' is a grouped convolution (groups={node.groups}); G-SGD needs groups=1")
            weighted.append(node)
            previous = node
        elif isinstance(node, ReLU):
            if not isinstance(previous, (Linear, Conv)):
                problems.append(f"ReLU '{node.name}' follows '{previous.name}' ({previous.op}), not a Linear or Conv")
            previous = node
        else:
            problems.append(f"'{node.name}' ({node.op}) is no part of such a chain")
        if len(node.inputs) > 1:
            problems.append(f"'{node.name}' ({node.op}) reads {len(node.inputs)} tensors; a chain reads one")
    output = graph[graph.outputs[0]]
    while isinstance(output, _PASS_THROUGH):
        output = graph[output.inputs[0]]
    if weighted and output.name != weighted[-1].name:
        problems.append(f"the output is '{output.name}' ({output.op}), not the last layer '{weighted[-1].name}'")
    if len(weighted) < 2:
        problems.append(f"{len(weighted)} Linear/Conv layer(s); G-SGD needs at least one hidden layer (L ≥ 2)")
    if len({type(node) for node in weighted}) > 1:
        problems.append("Linear and Conv layers mixed: " + ", ".join(f"'{n.name}' ({n.op})" for n in weighted))
    parameters = dict(model.named_parameters(remove_duplicate=False))
    tensors = {}
    for node in weighted:
        for role, key in node.parameter_keys().items():
            if key not in parameters:
                problems.append(f"'{node.name}' reads '{key}', a buffer, as its {role}; G-SGD trains parameters")
            elif not parameters[key].requires_grad:
                problems.append(f"parameter '{key}' is frozen (requires_grad=False)")
            else:
                tensors[key] = parameters[key]
    shared = {id(p) for p in tensors.values()}
    if len(shared) < len(tensors):
        problems.append("the layers share parameter tensors (tied weights)")
    untrained = [
        name for name, p in parameters.items() if name not in tensors and p.requires_grad and id(p) not in shared
    ]
    if untrained:
        problems.append(
            f"parameter(s) {', '.join(untrained[:10])} are read by no layer of the chain; G-SGD would "
            "leave them untrained"
        )
    widths = [(parameters[node.weight].shape[0], node.name) for node in weighted[:-1] if node.weight in parameters]
    if len({width for width, _ in widths}) > 1:
        problems.append(
            "hidden widths "
            + ", ".join(f"{width} ('{name}')" for width, name in widths)
            + " differ; G-SGD needs one width (seed 003)"
        )
    devices = {p.device for p in tensors.values()}
    dtypes = {p.dtype for p in tensors.values()}
    if len(devices) > 1 or len(dtypes) > 1:
        problems.append(
            f"the parameters are on {len(devices)} device(s) in {len(dtypes)} dtype(s); G-SGD steps them "
            "together, on one device in one dtype"
        )
    if problems:
        raise UnsupportedModelError(f"{source}: {SETTING}:", problems)
    return _layers(weighted, parameters)


def _layers(weighted: Sequence[Linear | Conv], parameters: dict[str, torch.nn.Parameter]) -> list[_Layer]:
    """The skeleton of SPEC §9: W_1[i, i mod d], W_l[i, i], W_L[i mod K, i], at the centre tap."""
    first, last = parameters[weighted[0].weight], parameters[weighted[-1].weight]
    width, inputs, outputs = first.shape[0], first.shape[1], last.shape[0]
    device = first.device
    neurons = torch.arange(width, device=device)
    layers = []
    for k, node in enumerate(weighted):
        weight = parameters[node.weight]
        rows = neurons % outputs if k == len(weighted) - 1 else neurons
        cols = neurons % inputs if k == 0 else neurons
        centre = tuple(size // 2 for size in weight.shape[2:])
        bias = parameters[node.bias] if node.bias else None
        layers.append(_Layer(node.weight, weight, node.bias, bias, rows, cols, centre))
    return layers
