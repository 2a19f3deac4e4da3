"""--threads and the default thread count: the CPUs this process may use, as the scheduler says."""

from __future__ import annotations

import os

import pytest
import torch
from cli_support import assert_clean_exit, invoke, write_mlp

import pathcond_cli as pathcond
from pathcond_cli import threads
from pathcond_cli.errors import UsageError


@pytest.fixture
def eight_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)


@pytest.fixture
def torch_threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, 8),
        ({"SLURM_CPUS_PER_TASK": "4"}, 4),
        ({"OMP_NUM_THREADS": "2"}, 2),
        ({"SLURM_CPUS_PER_TASK": "3", "OMP_NUM_THREADS": "6"}, 3),
        ({"SLURM_CPUS_PER_TASK": "16"}, 8),  # never more than the affinity allows
        ({"OMP_NUM_THREADS": "3,2"}, 3),  # nested OpenMP levels: the first is this process's
        ({"OMP_NUM_THREADS": "0", "SLURM_CPUS_PER_TASK": "many"}, 8),  # not a count: ignored, as OpenMP does
        ({"OMP_NUM_THREADS": " 5 "}, 5),
    ],
)
def test_available_cpus_is_the_affinity_capped_by_the_scheduler(eight_cpus, environ, expected):
    assert threads.available_cpus(environ) == expected


def test_available_cpus_reads_the_process_environment(eight_cpus, monkeypatch):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.available_cpus() == 2


def test_available_cpus_without_affinity_uses_the_cpu_count(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert threads.available_cpus({}) == 6


def test_set_threads_sets_torch_and_defaults_to_the_available_cpus(eight_cpus, monkeypatch, torch_threads_restored):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert pathcond.set_threads() == 1 and torch.get_num_threads() == 1
    assert pathcond.set_threads(2) == 2 and torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [0, -3, 1.5, "2", True])
def test_set_threads_refuses_what_is_no_thread_count(bad):
    with pytest.raises(UsageError, match="positive number of threads") as caught:
        pathcond.set_threads(bad)
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("command", ["inspect", "rescale", "spec"])
def test_threads_option_reaches_torch(tmp_path, command, torch_threads_restored):
    checkpoint, spec = write_mlp(tmp_path)
    torch.set_num_threads(2)
    extra = ["-o", tmp_path / "out.safetensors"] if command == "rescale" else []
    result = invoke(command, checkpoint, "--arch", spec, "--threads", "1", *extra)
    assert_clean_exit(result, 0)
    assert torch.get_num_threads() == 1


def test_threads_option_default_is_the_available_cpus(tmp_path, monkeypatch, eight_cpus, torch_threads_restored):
    checkpoint, spec = write_mlp(tmp_path)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    torch.set_num_threads(2)
    assert_clean_exit(invoke("inspect", checkpoint, "--arch", spec), 0)
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("command", ["inspect", "rescale", "compare", "prune", "spec"])
@pytest.mark.parametrize("bad", ["0", "-2", "1.5", "two"])
def test_bad_thread_counts_are_usage_errors(tmp_path, command, bad):
    checkpoint, spec = write_mlp(tmp_path)
    models = [checkpoint, checkpoint] if command == "compare" else [checkpoint]
    extra = ["--sparsity", "0.5"] if command == "prune" else []
    result = invoke(command, *models, "--arch", spec, *extra, "--threads", bad)
    assert result.exit_code == 2, result.stderr
    assert "--threads" in result.stderr
