"""The new operations through the fx importer: the imported graph computes the module, and
the module rescaled in place computes what it computed before (checked by torch itself)."""

from __future__ import annotations

import copy

import pytest
import torch
from ops_models import OPS_MODELS, build

from pathcond_cli.engine.evaluate import forward
from pathcond_cli.module_route import module_model, rescale_module


@pytest.mark.parametrize("name", sorted(OPS_MODELS))
def test_fx_graph_computes_the_module(name):
    module, shape = build(name)
    module = module.double()
    model = module_model(module, shape)
    x = torch.randn((3, *shape), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = module(x)
    got = forward(model.graph, model.params, x)[model.graph.outputs[0]]
    assert (got - expected).abs().max() <= 1e-12 * expected.abs().max()


@pytest.mark.parametrize("name", sorted(OPS_MODELS))
def test_rescaled_module_computes_the_same_function(name):
    module, shape = build(name)
    x = torch.randn((4, *shape), generator=torch.Generator().manual_seed(2))
    before_eval, before_train = module.eval()(x), copy.deepcopy(module).train()(x)
    result = rescale_module(module, shape, device="cpu")
    assert result.analysis.groups.num_free > 0 and result.changed
    after_eval, after_train = module.eval()(x), copy.deepcopy(module).train()(x)
    for before, after in ((before_eval, after_eval), (before_train, after_train)):
        assert (after - before).abs().max() <= 1e-5 * before.abs().max()
    assert result.solve.objective[-1] <= result.solve.objective[0]
