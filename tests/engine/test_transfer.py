"""engine.transfer.to_host: many tensors of mixed dtypes read on the host in one transfer, exactly."""

from __future__ import annotations

import torch

from pathcond_cli.engine.transfer import to_host


def test_every_dtype_and_shape_comes_back_bit_for_bit():
    tensors = [
        torch.tensor([True, False, True]),
        torch.tensor([2**53 + 1, -(2**62)], dtype=torch.int64),
        torch.tensor(0.1, dtype=torch.float64),
        torch.randn(2, 3, dtype=torch.float32),
        torch.empty(0, 4),
        torch.tensor([1 + 2j], dtype=torch.complex128),
        torch.randn(5, dtype=torch.float16),
        torch.randn(4, 6, dtype=torch.float64).t(),  # not contiguous
        torch.tensor([3 - 4j], dtype=torch.complex64).conj(),  # a conjugate view
        torch.tensor([3 - 4j], dtype=torch.complex64).conj().imag,  # a negative view
        torch.randn(3, dtype=torch.complex128).imag,  # strided
        torch.tensor([7], dtype=torch.uint8),
    ]
    copies = to_host(tensors)
    assert len(copies) == len(tensors)
    for original, copy in zip(tensors, copies):
        assert copy.device.type == "cpu" and copy.dtype == original.dtype and copy.shape == original.shape
        assert torch.equal(copy, original)
    assert to_host([]) == []


def test_one_transfer_whatever_the_count(monkeypatch):
    transfers = []
    cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: transfers.append(1) or cpu(self, *a, **k))
    to_host([torch.zeros(3, dtype=torch.bool), torch.ones(2, dtype=torch.float64), torch.arange(5)])
    assert len(transfers) == 1


def test_copies_are_not_the_originals():
    original = torch.zeros(3)
    (copy,) = to_host([original])
    original += 1
    assert torch.equal(copy, torch.zeros(3))
