"""Review of trust round 5 (issue 38 I and M): the thread count under an address-space limit
(``ulimit -v``) is grounded in what threads take, measured here, and an explicit --threads that
fits is never refused; messages are printed as written, with no emoji and no markup taken from
a name; a long list of problems is summarised wherever it is raised; a checkpoint of another
model is said to be one, and the remedy never sends the user down the route they took; a
BatchNorm with eps = 0 is read where every running_var + eps > 0; and the out-of-memory advice
fits where the memory ran out.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import fake_cuda
import pytest
import safetensors.torch
import torch
from cli_support import CLEAN_ENV, assert_clean_exit, invoke, write_mlp
from rich.console import Console
from torch import nn

from pathcond_cli.cli.guard import CommandGuard
from pathcond_cli.errors import PROBLEMS_SHOWN, InputError
from pathcond_cli.model_files import load
from pathcond_cli.module_route import rescale_module

# A script's preamble: the libraries pathcond loads, then the limit: VmSize now plus ``extra`` bytes.
_LIMITED_PREAMBLE = """
import os, resource, sys
import pathcond_cli.pipeline, pathcond_cli.io.formats, pathcond_cli.report.render, onnx, torch
from pathcond_cli import threads
def mapped():
    return next(int(line.split()[1]) * 1024 for line in open('/proc/self/status') if line.startswith('VmSize:'))
def tasks():
    return len(os.listdir('/proc/self/task'))
limit = mapped() + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
"""


def _run_limited(body: str, extra: int) -> subprocess.CompletedProcess:
    script = _LIMITED_PREAMBLE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script, str(extra)], capture_output=True, text=True, env=CLEAN_ENV, timeout=300
    )


def test_a_threads_estimate_covers_what_torch_threads_take_under_a_limit():
    """The oracle: the address space 24 threads took, started under a limit as set_threads starts
    them and put to work. pathcond assumed 80 MiB a thread; measured, with malloc kept to one arena,
    about two stacks."""
    result = _run_limited(
        """
        before = mapped()
        threads.set_threads(24)
        x = torch.randn(256, 256)
        (x @ x).relu_(); torch.randn(24 * 65536).sort()
        print((mapped() - before) / 23, threads.thread_address_space(True))  # 23 threads beside this one
    """,
        2 << 30,
    )
    assert result.returncode == 0, result.stderr
    measured, estimate = map(float, result.stdout.split())
    assert measured <= estimate < 1.25 * measured


def test_every_thread_count_said_to_fit_starts_without_libgomp_ending_the_process():
    """The most threads set_threads accepts under a tight limit do start (libgomp ended the process,
    exit 1, when the first threads' malloc arenas took the room of the later threads' stacks), and
    one more is refused."""
    result = _run_limited(
        """
        from pathcond_cli.errors import InputError
        from pathcond_cli.io.formats.common import address_space_left
        most = threads.threads_that_fit(address_space_left(), True)
        try:
            threads.set_threads(most + 1)
        except InputError as refused:
            print('refused', str(refused).split('pass ')[1].split(' or')[0])
        threads.set_threads(most)
        x = torch.randn(64, 64)
        (x @ x).relu_()
        print(most, tasks())
    """,
        400 << 20,
    )
    assert result.returncode == 0, result.stderr
    refusal, counts = result.stdout.strip().split("\n")
    most, started = map(int, counts.split())
    assert refusal == f"refused --threads {most}"
    assert most > 1 and started >= most


def test_the_default_on_a_many_core_node_is_not_cut_where_the_threads_fit():
    """64 CPUs under ``ulimit -v`` with 6 GiB left: 64 threads fit (the cap gave 24)."""
    result = _run_limited(
        """
        threads.available_cpus = lambda environ=None: 64
        print(threads.set_threads(), tasks())
    """,
        6 << 30,
    )
    assert result.returncode == 0, result.stderr
    count, started = map(int, result.stdout.split())
    assert count == 64 and started >= 64


# ``python -m pathcond_cli ARGS`` (on the fake CUDA device, whose module is in the folder argv[1],
# when the suite runs on it) whose address space is limited, once its libraries are imported, to
# what they mapped plus argv[2] bytes.
_LIMITED_COMMAND = """
import resource, sys
fake_cuda_folder, extra = sys.argv.pop(1), int(sys.argv.pop(1))
if fake_cuda_folder:
    sys.path.insert(0, fake_cuda_folder)
    from fake_cuda import installed
import pathcond_cli.__main__ as entry  # before torch, as `python -m pathcond_cli` runs it
import pathcond_cli.pipeline, pathcond_cli.io.formats, pathcond_cli.report.render, onnx
if fake_cuda_folder:
    sys.path.remove(fake_cuda_folder)  # the tests' helper modules must not shadow anything pathcond imports
limit = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:")) + extra
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.argv[0] = "pathcond"
if fake_cuda_folder:
    with installed():
        entry.main()
else:
    entry.main()
"""


def test_an_explicit_thread_count_that_fits_is_not_refused(tmp_path):
    """--threads 16 with 1 GiB of address space left exited 3 ('pass --threads 4 or fewer').
    One process: pathcond's libraries imported, the limit set 1 GiB above what they mapped, then the command."""
    checkpoint, spec = write_mlp(tmp_path)
    fake_cuda_folder = str(Path(fake_cuda.__file__).parent) if fake_cuda.requested() else ""
    result = subprocess.run(
        [sys.executable, "-c", _LIMITED_COMMAND, fake_cuda_folder, str(1 << 30)]
        + [str(a) for a in ("inspect", checkpoint, "--arch", spec, "--threads", "16")],
        capture_output=True,
        text=True,
        env=CLEAN_ENV,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["no:b:model.safetensors", "no:smile:[bold]x[/bold].safetensors"])
def test_names_in_messages_are_printed_as_written(tmp_path, name):
    """rich turned ':b:' into an emoji ('facs:b' printed as 'facs🅱'); markup in a name stays text."""
    stderr = assert_clean_exit(invoke("inspect", tmp_path / name), 3)
    assert name in stderr


# -- a long list of problems is summarised wherever it is raised -----------------------------------------


def _fp8_mlp(tmp_path, layers: int):
    tensors = {
        f"fc{i}.{role}": torch.zeros(shape).to(torch.float8_e4m3fn)
        for i in range(layers)
        for role, shape in (("weight", (4, 4)), ("bias", (4,)))
    }
    spec = {
        "layers": [{"name": "x", "type": "input", "shape": [4]}]
        + [
            layer
            for i in range(layers)
            for layer in ({"name": f"fc{i}", "type": "linear"}, {"name": f"r{i}", "type": "relu"})
        ]
    }
    return write_mlp(tmp_path, tensors=tensors, spec=spec)


def _dangling_mlp(tmp_path, layers: int):
    tensors = {
        f"fc{i}.{role}": torch.zeros(shape)
        for i in range(layers)
        for role, shape in (("weight", (4, 4)), ("bias", (4,)))
    }
    spec = {
        "layers": [{"name": "x", "type": "input", "shape": [4]}]
        + [{"name": f"fc{i}", "type": "linear", "inputs": f"nowhere{i}"} for i in range(layers)]
    }
    return write_mlp(tmp_path, tensors=tensors, spec=spec)


@pytest.mark.parametrize(
    ("make", "problems", "needle"), [(_fp8_mlp, 60, "float8_e4m3fn"), (_dangling_mlp, 30, "which no node produces")]
)
def test_a_long_list_of_problems_shows_ten_and_counts_the_rest(tmp_path, make, problems, needle):
    """An fp8 checkpoint of 30 layers printed 60 problem lines, a spec of 30 dangling inputs 31."""
    checkpoint, spec = make(tmp_path, problems // 2 if make is _fp8_mlp else problems)
    stderr = assert_clean_exit(
        invoke("inspect", checkpoint, "--arch", spec), 3, needle, f"and {problems - PROBLEMS_SHOWN} more problem(s)"
    )
    assert sum(line.startswith("  - ") for line in stderr.splitlines()) == PROBLEMS_SHOWN
    with pytest.raises(InputError) as raised:
        load(checkpoint, arch=str(spec))
    assert len(raised.value.problems) == problems and all(needle in problem for problem in raised.value.problems)


# -- the remedy for a checkpoint that does not match its architecture -----------------------------------

_FACTORIES = """
import torch
from torch import nn


class Saved(nn.Module):  # the checkpoint's model: conv without bias, then BatchNorm
    def __init__(self):
        super().__init__()
        self.stem, self.stem_bn, self.head = nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.stem_bn(self.stem(x))).mean((2, 3)))


class Other(nn.Module):  # another model, sharing only 'head.*'
    def __init__(self):
        super().__init__()
        self.features, self.block, self.head = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3, padding=1), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.block(torch.relu(self.features(x)))).mean((2, 3)))


class SavedWithBiases(nn.Module):  # the checkpoint's model's variant: conv with bias, no BatchNorm
    def __init__(self):
        super().__init__()
        self.stem, self.head = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.stem(x)).mean((2, 3)))
"""


@pytest.fixture
def saved_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "review_factories.py").write_text(_FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    import review_factories

    checkpoint = tmp_path / "saved.safetensors"
    safetensors.torch.save_file(review_factories.Saved().state_dict(), str(checkpoint))
    yield checkpoint
    sys.modules.pop("review_factories", None)


def test_a_factory_for_another_model_is_said_to_be_another_models_not_a_folded_export(saved_checkpoint):
    """The fix printed said a BatchNorm was folded by an ONNX export and told the user to pass
    --arch module:factory, which they had passed."""
    stderr = assert_clean_exit(
        invoke("inspect", saved_checkpoint, "--arch", "review_factories:Other", "--input-shape", "3,8,8"),
        3,
        "another model",
        "'features.weight'",
    )
    assert "folded" not in stderr and "module:factory" not in stderr and "bias: null" not in stderr
    assert "\U0001f171" not in stderr and "review_factories:Other" in stderr


def test_a_factory_building_another_variant_is_told_so_not_sent_to_the_factory_route(saved_checkpoint):
    stderr = assert_clean_exit(
        invoke("inspect", saved_checkpoint, "--arch", "review_factories:SavedWithBiases", "--input-shape", "3,8,8"),
        3,
        "'stem.bias'",
        "another variant",
        "BatchNorm statistics",
    )
    assert "module:factory" not in stderr and "bias: null" not in stderr


def test_a_spec_of_another_model_missing_weights_says_so_before_any_bias_advice(tmp_path):
    """A 30-layer spec on a 1-layer checkpoint, missing 58 tensors, weights included: the only fix
    printed was "a layer without bias needs 'bias: null'"."""
    tensors = {"fc0.weight": torch.randn(4, 4), "fc0.bias": torch.randn(4)}
    spec = {
        "layers": [{"name": "x", "type": "input", "shape": [4]}]
        + [
            layer
            for i in range(30)
            for layer in ({"name": f"fc{i}", "type": "linear"}, {"name": f"r{i}", "type": "relu"})
        ]
    }
    checkpoint, spec_path = write_mlp(tmp_path, tensors=tensors, spec=spec)
    stderr = assert_clean_exit(
        invoke("inspect", checkpoint, "--arch", spec_path),
        3,
        "holds 2 of the 60 tensors",
        "'fc1.weight'",
        "another model",
    )
    assert "bias: null" not in stderr


# -- a BatchNorm with eps = 0 ------------------------------------------------------------------------


_EPS0_SPEC = {
    "layers": [
        {"name": "x", "type": "input", "shape": [3]},
        {"name": "fc1", "type": "linear"},
        {"name": "bn1", "type": "batchnorm", "eps": 0},
        {"name": "relu1", "type": "relu"},
        {"name": "fc2", "type": "linear"},
    ]
}


def _eps0_mlp(variance: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    batchnorm = nn.BatchNorm1d(4, eps=0.0)
    batchnorm.running_var.copy_(variance)
    batchnorm.running_mean.normal_()
    layers = {"fc1": nn.Linear(3, 4), "bn1": batchnorm, "relu1": nn.ReLU(), "fc2": nn.Linear(4, 2)}
    return nn.Sequential(OrderedDict(layers)).eval()  # named as _EPS0_SPEC names them


def _torch_computes_eps_zero() -> bool:
    """torch 2.13's batch_norm computes eps = 0 in eval mode; 2.11's refuses it whatever the mode."""
    try:
        torch.nn.functional.batch_norm(torch.ones(2, 1), torch.zeros(1), torch.ones(1), eps=0.0)
    except (ValueError, RuntimeError):
        return False
    return True


EPS_ZERO_COMPUTED = pytest.mark.skipif(
    not _torch_computes_eps_zero(), reason="this torch's batch_norm refuses eps = 0, so no oracle computes it"
)


@EPS_ZERO_COMPUTED
def test_a_batchnorm_with_eps_zero_and_positive_variances_is_rescaled(tmp_path):
    """eps = 0 was refused ('must be a number > 0') although every running_var + eps was > 0."""
    module = _eps0_mlp(torch.tensor([0.5, 2.0, 1.0, 3.0]))
    tensors = {key: value for key, value in module.state_dict().items() if not key.endswith("num_batches_tracked")}
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors, spec=_EPS0_SPEC)
    output = tmp_path / "rescaled.safetensors"
    assert_clean_exit(invoke("rescale", checkpoint, "--arch", spec, "-o", output), 0)
    rescaled = safetensors.torch.load_file(str(output))
    replica = _eps0_mlp(torch.ones(4))
    replica.load_state_dict(rescaled, strict=False)
    x = torch.randn(16, 3, dtype=torch.float64)
    with torch.no_grad():  # the oracle: torch's own BatchNorm with eps = 0, before and after
        before, after = module.double()(x), replica.eval().double()(x)
    assert any(not torch.equal(rescaled[key], value) for key, value in tensors.items())
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)


@EPS_ZERO_COMPUTED
def test_a_batchnorm_with_eps_zero_and_a_zero_variance_is_refused(tmp_path):
    variance = torch.tensor([0.5, 0.0, 1.0, 3.0])
    with torch.no_grad():  # the oracle: torch's own BatchNorm gives no finite output
        assert not torch.isfinite(_eps0_mlp(variance)(torch.randn(5, 3))).all()
    tensors = {
        "fc1.weight": torch.randn(4, 3),
        "fc1.bias": torch.randn(4),
        "bn1.weight": torch.ones(4),
        "bn1.bias": torch.zeros(4),
        "bn1.running_mean": torch.zeros(4),
        "bn1.running_var": variance,
        "fc2.weight": torch.randn(2, 4),
        "fc2.bias": torch.randn(2),
    }
    checkpoint, spec = write_mlp(tmp_path, tensors=tensors, spec=_EPS0_SPEC)
    assert_clean_exit(
        invoke("inspect", checkpoint, "--arch", spec), 3, "'bn1.running_var'", "channel 1", "running_var + eps"
    )


@EPS_ZERO_COMPUTED
def test_a_module_with_a_batchnorm_of_eps_zero_is_rescaled_in_place():
    """The module route verified in train mode too, where torch refuses eps = 0 ('batch_norm eps
    must be positive during training'): exit 5 for a module that computes in eval mode."""
    module = _eps0_mlp(torch.tensor([0.5, 2.0, 1.0, 3.0])).double()
    before_state = {key: value.clone() for key, value in module.state_dict().items()}
    x = torch.randn(16, 3, dtype=torch.float64)
    with torch.no_grad():
        before = module(x)
    result = rescale_module(module, (3,))
    with torch.no_grad():  # the oracle: the module's own forward, before and after
        torch.testing.assert_close(module(x), before, rtol=1e-10, atol=1e-12)
    assert any(not torch.equal(value, before_state[key]) for key, value in module.state_dict().items())
    assert result.verification.modes == ("eval",)


@pytest.mark.parametrize(
    ("left", "remedy"), [(1 << 20, "address-space limit (ulimit -v)"), (None, "machine with more memory")]
)
def test_out_of_memory_advice_fits_where_the_memory_ran_out(monkeypatch, left, remedy):
    """Under ulimit -v 1G a spec of a fixed input shape was told to 'check the input shape
    (--input-shape)', and to find a machine with more memory where the limit had run out."""
    monkeypatch.setattr("pathcond_cli.io.formats.common.address_space_left", lambda: left)
    code, label, message = CommandGuard(Console()).failure(
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 288000000 bytes")
    )
    assert (code, label) == (3, "error") and remedy in message
    assert "for a network that takes inputs of any size, pass a smaller --input-shape" in message
