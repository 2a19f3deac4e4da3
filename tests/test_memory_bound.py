"""Peak host memory of a real `pathcond rescale` process, measured against the checkpoint's size.

The child's own peak resident set (ru_maxrss from wait4, file pages it mapped included) less
that of a process that only imports torch must stay within ``SLOPE`` times the checkpoint's
bytes plus ``SLACK``. 0.2.1 used 12.9 times the checkpoint above that floor on this model
(0.56 GiB), this version 7.2 times (0.31 GiB), both without an iteration cap: see
benchmarks/README.md. The issue's target,
1.5 times plus 1 GiB at any size, is not reached yet (docs/changes/clustermem.md says why).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_memory import build_mlp, checkpoint_bytes, child_peak, torch_floor  # noqa: E402

GIB = 2**30
SLOPE = 6.0
SLACK = 0.15 * GIB


@pytest.fixture(scope="module")
def sharded_mlp(tmp_path_factory) -> Path:
    """11 hidden layers of 1024 units: 11.6 M fp32 parameters, 46 MB in two shards."""
    return build_mlp(tmp_path_factory.mktemp("mlp"), inputs=1024, width=1024, depth=11, outputs=10, shards=2)


def test_peak_memory_of_a_rescale_stays_within_its_bound_shape(sharded_mlp, tmp_path):
    size = checkpoint_bytes(sharded_mlp)
    floor = torch_floor(tmp_path / "torch.log")
    log = tmp_path / "rescale.log"
    out = tmp_path / "out" / "mlp.safetensors.index.json"
    out.parent.mkdir()
    peak, _, status = child_peak([sys.executable, "-m", "pathcond_cli", "rescale", str(sharded_mlp), "-o", str(out),
                                  "--device", "cpu", "--max-iter", "3", "-q"], log)
    assert status == 0, log.read_text()[-2000:]
    assert out.is_file()
    above = peak - floor
    assert above <= SLOPE * size + SLACK, (
        f"peak RSS {peak / GIB:.2f} GiB is {above / GIB:.2f} GiB above `import torch` ({floor / GIB:.2f} GiB): "
        f"{above / size:.1f} x the {size / 2**20:.0f} MiB checkpoint, bound {SLOPE:g} x + {SLACK / GIB:g} GiB"
    )
