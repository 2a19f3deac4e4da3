"""``RescaleResult.changed``, the lazily rescaled tensors, used as a dict is used: saved with
``torch.save`` after the input is gone, copied, compared with the rescaled module, and asked
for membership without reading any tensor."""

from __future__ import annotations

import copy

import torch
from cli_support import CountingReads, mlp_tensors, write_mlp

import pathcond_cli as pathcond


def _mlp(x: torch.Tensor, tensors) -> torch.Tensor:
    """The checkpoint's function, evaluated by hand (fc1, ReLU, fc2, ReLU, fc3)."""
    h = x
    for i in (1, 2, 3):
        h = h @ tensors[f"fc{i}.weight"].double().T + tensors[f"fc{i}.bias"].double()
        h = h.relu() if i < 3 else h
    return h


def _rescaled(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    return checkpoint, pathcond.rescale(pathcond.load(checkpoint, arch=str(spec)), device="cpu")


def test_changed_saved_with_torch_save_after_the_input_is_deleted_reloads_as_the_rescaled_tensors(tmp_path):
    """``changed`` pickles without the open checkpoint (a ``safe_open`` handle cannot be pickled)
    and leaves no truncated .pt behind."""
    checkpoint, result = _rescaled(tmp_path)
    checkpoint.unlink()
    torch.save(result.changed, tmp_path / "changed.pt")
    saved = torch.load(tmp_path / "changed.pt", weights_only=True)
    assert isinstance(saved, dict) and list(saved) == list(result.changed)
    assert all(torch.equal(saved[key], result.changed[key]) for key in saved)
    original = mlp_tensors()
    x = torch.randn(32, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    rescaled = {**original, **saved}
    assert not all(torch.equal(rescaled[key], original[key]) for key in original)
    assert torch.allclose(_mlp(x, rescaled), _mlp(x, original), rtol=1e-5, atol=1e-6)


def test_changed_copies_as_a_dict_and_says_what_it_holds(tmp_path):
    _, result = _rescaled(tmp_path)
    for snapshot in (result.changed.copy(), copy.deepcopy(result.changed), copy.copy(result.changed)):
        assert isinstance(snapshot, dict) and list(snapshot) == list(result.changed)
        assert all(torch.equal(snapshot[key], result.changed[key]) for key in snapshot)
    assert repr(result.changed).startswith(f"RescaledTensors({len(result.changed)} tensors computed when read: 'fc1.")


def test_changed_after_rescale_module_holds_what_the_module_now_holds():
    """``changed`` computes its tensors from the module's own (detached) tensors: read after
    rescale_module had rescaled the module, every read applied the rescaling a second time
    (e^{2u}: the function still preserved, so nothing caught it)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).eval()
    with torch.no_grad():
        module[0].weight.mul_(10)
    original = {key: tensor.clone() for key, tensor in module.state_dict().items()}
    result = pathcond.rescale_module(module, (6,), device="cpu")
    state = module.state_dict()
    assert any(not torch.equal(state[key], original[key]) for key in original)
    assert all(torch.equal(result.changed[key], state[key]) for key in result.changed)
    assert all(torch.equal(tensor, state[key]) for key, tensor in result.rescaled_params.items())


def test_membership_and_the_verifications_chain_map_read_no_tensor_for_nothing(tmp_path):
    """``key in changed`` computed the rescaled tensor (Mapping's default __contains__), and an
    unchanged key read its checkpoint tensor before failing, so the verification's
    ChainMap(changed, params) read every unchanged tensor twice."""
    from collections import ChainMap

    _, result = _rescaled(tmp_path)
    params = CountingReads(mlp_tensors())
    params["extra"] = torch.ones(3)
    changed = result.analysis.groups.apply(params, result.solve.u)
    assert "fc1.weight" in changed and "extra" not in changed and params.reads == {}
    assert torch.equal(ChainMap(changed, params)["extra"], params["extra"])
    assert params.reads == {"extra": 2}
