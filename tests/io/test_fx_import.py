"""torch.fx import: supported modules compute what the module computes; the rest is listed."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pathcond_cli.engine.evaluate import forward
from pathcond_cli.engine.graph import FixedFilter
from pathcond_cli.engine.groups import build_groups
from pathcond_cli.errors import InputError, UnsupportedModelError
from pathcond_cli.io.formats.factory import load_factory
from pathcond_cli.io.formats.fx_import import graph_from_module
from pathcond_cli.module_route import module_model, rescale_module


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(8, 8, bias=False)
        self.fc3 = nn.Linear(8, 3)

    def forward(self, x):
        x = self.drop(F.relu(self.fc1(x)))
        x = torch.relu(torch.add(self.fc2(x), x))
        return self.fc3(F.dropout(x, 0.5, self.training))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1, bias=False),
            nn.BatchNorm2d(6),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 8, 3, stride=1, padding="same"),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AvgPool2d(2, stride=1, padding=1, count_include_pad=False),
            nn.Conv2d(8, 8, 3, groups=2, dilation=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d((2, 2)),
        )
        self.flatten = nn.Flatten()
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.flatten(self.features(x)))


class CNN1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 5, stride=2, padding=2)
        self.bn = nn.BatchNorm1d(4)
        self.pool = nn.MaxPool1d(3, stride=2, padding=1, ceil_mode=True)
        self.gap = nn.AdaptiveAvgPool1d(1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        x = self.gap(F.avg_pool1d(self.pool(F.relu(self.bn(self.conv(x)))), 1))
        return self.fc(x.flatten(1))


class ResidualBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)  # one module called twice: fine, it has no parameters
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        out = self.relu(out)
        out = F.max_pool2d(out, 2)
        return self.fc(out.view(out.size(0), -1))


class ConcatBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.a = nn.Conv2d(4, 2, 1)
        self.b = nn.Conv2d(4, 3, 3, padding=1)
        self.fc = nn.Linear(5 * 16, 2)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = torch.cat((F.relu(self.a(x)), self.b(x).relu()), 1)
        return self.fc(x.reshape(x.shape[0], -1))


class Leaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.act = nn.LeakyReLU(0.1)
        self.fc2 = nn.Linear(6, 6)
        self.fc3 = nn.Linear(6, 2)

    def forward(self, x):
        x = self.act(self.fc1(x))
        return self.fc3(F.leaky_relu(self.fc2(x), negative_slope=0.3))


def randomised(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return module.double()


CASES = [
    (MLP, (5,)),
    (CNN, (3, 8, 8)),
    (CNN1d, (2, 16)),
    (ResidualBlock, (4, 4, 4)),
    (ConcatBlock, (3, 4, 4)),
    (Leaky, (4,)),
]


@pytest.mark.parametrize("factory, input_shape", CASES, ids=[c[0].__name__ for c in CASES])
def test_imported_graph_computes_the_module(factory, input_shape):
    module = randomised(factory())
    graph, params = graph_from_module(module, input_shape, source=factory.__name__)
    assert set(params) == set(module.state_dict())
    assert set(graph.parameter_keys()) <= set(params)
    assert module.training, "tracing must restore the module's mode"
    x = torch.randn(3, *input_shape, dtype=torch.float64)
    expected = module.eval()(x)
    got = forward(graph, params, x)[graph.outputs[0]]
    assert (got - expected).abs().max() / expected.abs().max() <= 1e-6
    build_groups(graph, params)


def test_layer_names_follow_module_paths():
    graph, _ = graph_from_module(ResidualBlock(), (4, 4, 4), source="block")
    names = [node.name for node in graph.nodes]
    assert names[:4] == ["x", "conv1", "bn1", "relu"]
    assert "relu_1" in names  # the second call of self.relu
    assert graph["conv1"].weight == "conv1.weight" and graph["conv1"].bias is None
    graph, _ = graph_from_module(CNN(), (3, 8, 8), source="cnn")
    assert graph["features.1"].running_var == "features.1.running_var"
    assert graph["features.4"].padding == (1, 1)


class NotHomogeneous(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.gelu = nn.GELU()
        self.norm = nn.LayerNorm(4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x):
        x = self.norm(self.gelu(self.fc1(x)))
        return torch.sigmoid(self.fc2(F.silu(x)))


def test_every_unsupported_node_is_listed_in_one_error():
    with pytest.raises(UnsupportedModelError) as info:
        graph_from_module(NotHomogeneous(), (4,), source="net.py")
    problems = info.value.problems
    assert len(problems) == 4
    message = str(info.value)
    assert message.startswith("net.py:")
    for line in (
        "GELU ×1: node 'gelu'",
        "LayerNorm ×1: node 'norm'",
        "torch.nn.functional.silu ×1: node 'silu'",
        "torch.sigmoid ×1: node 'sigmoid'",
    ):
        assert line in message
    assert "not positively homogeneous" in message


class AppliedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(F.relu(self.fc(F.relu(self.fc(x)))))


def test_module_applied_twice_is_rejected():
    with pytest.raises(UnsupportedModelError, match=r"module 'fc' \(Linear\) is applied 2 times \(fx nodes fc, fc_1\)"):
        graph_from_module(AppliedTwice(), (4,), source="twice")


class OddShapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding_mode="reflect", padding=1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        y = self.conv(x)
        y = torch.cat([y, y], dim=0) + 1
        return self.fc(y.view(-1, 4) * self.fc.weight.sum())


def test_configurations_outside_the_dag_are_explained():
    with pytest.raises(UnsupportedModelError) as info:
        graph_from_module(OddShapes(), (3, 2, 2), source="odd")
    # Nodes that read a refused node's output are explained in the complete list.
    message = info.value.complete
    assert "only concatenation along dim 1" in message
    assert "adding the number 1" in message and any("adding the number 1" in p for p in info.value.follow_on)
    assert "_operator.mul ×1: node 'mul'" in message or "operator.mul ×1: node 'mul'" in message
    assert "a parameter or constant used outside its module" in message


class RefusedResizes(nn.Module):
    def __init__(self):
        super().__init__()
        self.cubic = nn.Upsample(scale_factor=2, mode="bicubic")
        self.area = nn.Upsample(size=(2, 2), mode="area")

    def forward(self, x):
        return torch.cat(
            [
                self.cubic(x)[:, :, :2, :2],
                self.area(x),
                F.interpolate(x, scale_factor=1.0, mode="bilinear", antialias=True)[:, :, :2, :2],
                F.interpolate(x, scale_factor=1.0, recompute_scale_factor=True)[:, :, :2, :2],
                F.interpolate(x, scale_factor=1.5, mode="nearest-exact")[:, :, :2, :2],
            ],
            dim=1,
        )


def test_resizes_other_than_nearest_and_linear_are_refused_with_the_reason():
    with pytest.raises(UnsupportedModelError) as info:
        graph_from_module(RefusedResizes(), (1, 3, 3), source="resize")
    message = str(info.value)
    assert "node 'cubic'" in message and "mode='bicubic' is not supported" in message
    assert "mode='area' is not supported" in message
    assert "antialias=True is not supported" in message
    assert "recompute_scale_factor=True is not supported" in message
    assert "mode='nearest-exact' with scale_factor=1.5 of an input of spatial size (3, 3) is not supported" in message


class DataDependent(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


def test_untraceable_module_is_unsupported():
    with pytest.raises(UnsupportedModelError, match="torch.fx cannot trace"):
        graph_from_module(DataDependent(), (3,), source="dd")


def test_load_factory(tmp_path, monkeypatch):
    (tmp_path / "my_factories.py").write_text(
        textwrap.dedent("""
        import torch.nn as nn

        def mlp():
            return nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))

        class Zoo:
            @staticmethod
            def small():
                return nn.Linear(2, 2)

        def not_a_module():
            return 42

        def broken():
            raise RuntimeError("no weights here")

        NOT_CALLABLE = 3
    """)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(load_factory("my_factories:mlp"), nn.Sequential)
    assert isinstance(load_factory("my_factories:Zoo.small"), nn.Linear)
    failures = {
        "no_such_module_xyz:build": "cannot import module 'no_such_module_xyz'",
        "my_factories:missing": "has no attribute 'missing'",
        "my_factories:not_a_module": "returned int, not a torch.nn.Module",
        "my_factories:broken": "no weights here",
        "my_factories:NOT_CALLABLE": "is not callable",
        "my_factories": "expected the form module.path:callable",
    }
    for spec, fragment in failures.items():
        with pytest.raises(InputError, match=fragment):
            load_factory(spec)


class _CatForms(nn.Module):
    """torch.cat with its dim positional, as a keyword, and its tensors as a keyword."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 3, 1), nn.Conv2d(2, 2, 1)

    def forward(self, x):
        a, b = F.relu(self.a(x)), F.relu(self.b(x))
        return torch.cat([torch.cat((a, b), 1), torch.cat(tensors=[b, a], dim=1)], dim=1)


def test_cat_is_read_from_its_raw_arguments_in_every_form():
    module = randomised(_CatForms())
    graph, params = graph_from_module(module, (2, 3, 3), source="cat")
    assert [n.op for n in graph.nodes].count("concat") == 3
    x = torch.randn(2, 2, 3, 3, dtype=torch.float64)
    assert torch.allclose(forward(graph, params, x)[graph.outputs[0]], module.eval()(x), rtol=1e-12, atol=1e-12)


def test_cat_along_another_dim_is_refused():
    class Batched(nn.Module):
        def forward(self, x):
            return torch.cat([x, x], 0)

    with pytest.raises(UnsupportedModelError, match="only concatenation along dim 1"):
        graph_from_module(Batched(), (2, 3, 3), source="cat")


# -- modules written as timm writes them ------------------------------------------

sys.path.insert(0, str(Path(__file__).parents[1]))
import timm_like  # noqa: E402


@pytest.mark.parametrize("name", sorted(timm_like.TIMM_LIKE))
def test_timm_like_modules_are_rescaled_and_verified(name):
    module, shape = timm_like.TIMM_LIKE[name]()
    module = module.double()
    x = torch.randn(3, *shape, dtype=torch.float64)
    expected = module(x)
    graph, params = graph_from_module(module, shape, source=name)
    got = forward(graph, params, x)[graph.outputs[0]]
    assert (got - expected).abs().max() / expected.abs().max() <= 1e-9
    before = {key: tensor.clone() for key, tensor in module.state_dict().items()}
    result = rescale_module(module, shape)
    assert result.verification.passed
    assert any(not torch.equal(before[key], tensor) for key, tensor in module.state_dict().items())
    assert torch.allclose(module(x), expected, rtol=1e-9, atol=1e-9)


def test_batchnorm_act_reads_its_own_tensors_and_asserts_are_skipped():
    module, shape = timm_like.TIMM_LIKE["timm_bn_act"]()
    graph, _ = graph_from_module(module, shape, source="bnact")
    norms = [node for node in graph.nodes if type(node).__name__ == "BatchNorm"]
    assert [(n.weight, n.bias, n.running_mean, n.running_var) for n in norms] == [
        (f"{bn}.weight", f"{bn}.bias", f"{bn}.running_mean", f"{bn}.running_var") for bn in ("bn1", "bn2")
    ]
    convs = [node for node in graph.nodes if type(node).__name__ == "Conv"]
    assert convs[0].weight == "conv1.weight"  # StdConv2d's F.conv2d on its own weight
    assert not any("assert" in node.name for node in graph.nodes)


@pytest.mark.parametrize("persistent", [True, False])
def test_a_depthwise_filter_buffer_is_a_fixed_filter(persistent):
    """A buffer is a constant, persistent or not: timm's BlurPool2d filter is a fixed filter
    node holding its coefficients, no parameter, and rescale_module leaves it as it is."""
    module = timm_like.randomized(timm_like.BlurNet(persistent=persistent))
    graph, params = graph_from_module(module, (3, 8, 8), source="blur")
    (blur,) = [node for node in graph.nodes if isinstance(node, FixedFilter)]
    assert blur.name == "aa" and blur.kernel == (3, 3) and blur.stride == (2, 2) and blur.padding == (0, 0)
    assert torch.equal(torch.tensor(blur.coefficients, dtype=torch.float32).reshape(4, 1, 3, 3), module.aa.filt)
    assert not any("aa.filt" in node.parameter_keys().values() for node in graph.nodes)
    filt = module.aa.filt.clone()
    assert rescale_module(module, (3, 8, 8)).verification.passed
    assert torch.equal(module.aa.filt, filt)


class _BufferWeights(nn.Module):
    """Buffers read where only parameters are layer weights: a full conv filter, a linear weight."""

    def __init__(self):
        super().__init__()
        self.register_buffer("full", torch.rand(4, 3, 3, 3))
        self.register_buffer("projection", torch.rand(2, 4), persistent=False)

    def forward(self, x):
        return F.linear(F.relu(F.conv2d(x, self.full, padding=1)).mean((2, 3)), self.projection)


def test_a_buffer_read_as_any_other_weight_is_refused_as_a_constant():
    with pytest.raises(UnsupportedModelError) as info:
        graph_from_module(_BufferWeights(), (3, 8, 8), source="buffers")
    assert len(info.value.problems) == 2
    for key in ("full", "projection"):
        assert any(
            f"'{key}' is a buffer of the module, a constant and not a parameter" in problem
            and "nn.Parameter" in problem
            for problem in info.value.problems
        )


def test_operations_reaching_no_output_are_dropped_and_counted():
    model = module_model(timm_like.randomized(timm_like.DlaLikeNet()), (3, 8, 8))
    assert not any(node.name.startswith("project") for node in model.graph.nodes)
    assert model.warnings == [
        "DlaLikeNet: 2 operation(s) whose result reaches no output were dropped, as the ONNX "
        "exporters drop them: 'project.0', 'project.1'"
    ]


class UnusedInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.fc(x)
        self.act(y)  # its result is unused, but it writes into y, which is read next
        return y * 2


def test_an_unused_operation_that_may_write_its_input_is_not_dropped():
    with pytest.raises(UnsupportedModelError, match="act"):
        graph_from_module(UnusedInPlace(), (4,), source="inplace")


def test_a_forward_branching_on_its_input_shape_is_read_through_torch_export():
    module = timm_like.ShapeBranchNet()
    big, _ = graph_from_module(module, (3, 16, 16), source="branch")
    small, _ = graph_from_module(module, (3, 8, 8), source="branch")
    assert any(type(node).__name__ == "MaxPool" for node in big.nodes)
    assert not any(type(node).__name__ == "MaxPool" for node in small.nodes)
    assert big["conv"].weight == "conv.weight"


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.conv(x).cumsum(1)


class ThreeOdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.a, self.b, self.c = Odd(), Odd(), Odd()

    def forward(self, x):
        x = self.stem(x)
        return torch.cat([self.a(x), self.b(x), self.c(x)], 1)


def test_a_root_cause_is_listed_once_per_module_type():
    with pytest.raises(UnsupportedModelError) as info:
        graph_from_module(ThreeOdd(), (3, 4, 4), source="odd")
    roots = info.value.problems[: len(info.value.problems) - len(info.value.follow_on)]
    assert roots == [
        "fx node 'cumsum' (method Tensor.cumsum): not supported (and the same in 2 more Odd module(s): 'b', 'c')"
    ]


def test_a_factory_whose_unused_branch_was_dropped_says_so_for_its_checkpoint(tmp_path):
    """`--arch module:factory` with the module's state_dict: the dropped projection's tensors are
    unused, which the error explains; --allow-unused carries them with the note as a warning."""
    import safetensors.torch
    from cli_support import assert_clean_exit, invoke

    state = tmp_path / "dla.safetensors"
    safetensors.torch.save_file(timm_like.randomized(timm_like.DlaLikeNet()).state_dict(), str(state))
    arguments = (
        "rescale",
        state,
        "--arch",
        "timm_like:DlaLikeNet",
        "--input-shape",
        "3,8,8",
        "-o",
        tmp_path / "out.safetensors",
    )
    assert_clean_exit(invoke(*arguments), 3, "project.0.weight", "reaches no output were dropped", "--allow-unused")
    assert_clean_exit(invoke(*arguments, "--allow-unused"), 0, "reaches no output were dropped")
