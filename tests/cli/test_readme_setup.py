"""The README's set-up: a virtual environment first, and the onnx-check extra (onnxruntime,
the independent check of written ONNX files), which pyproject.toml defines."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_set_up_uses_a_virtual_environment_and_names_the_onnx_check_extra():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    assert "python3 -m venv" in setup and "activate" in setup
    assert setup.index("python3 -m venv") < setup.index("python3 -m pip install")
    assert "onnx-check" in setup and "onnxruntime" in setup
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dependency.startswith("onnxruntime") for dependency in extras["onnx-check"])
