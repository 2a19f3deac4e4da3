"""One SolveOptions, validated once, shared by the command line, the API and the solvers: a bad
choice is refused the same way everywhere, naming the option as the command line spells it."""

from __future__ import annotations

import dataclasses

import pytest
from cli_support import assert_clean_exit, invoke, write_mlp

import pathcond_cli as pathcond
from pathcond_cli.errors import UsageError
from pathcond_cli.solve.options import AUTO, NONE, USER, InvalidOption, SolveOptions

REFUSED = [
    ({"criterion": "sgd"}, "--criterion", "unknown criterion"),
    ({"solver": "adam"}, "--solver", "unknown solver"),
    ({"criterion": "enorm", "solver": "lbfgs"}, "--solver", "closed-form"),
    ({"tol": float("nan")}, "--tol", "finite tolerance"),
    ({"tol": -1.0}, "--tol", "finite tolerance"),
    ({"max_iter": -1}, "--max-iter", "iteration count"),
    ({"max_log_scale": "big"}, "--max-log-scale", "'auto', 'none' or a number"),
    ({"max_log_scale": -1.0}, "--max-log-scale", "finite number ≥ 0"),
    ({"max_log_scale": float("inf")}, "--max-log-scale", "finite number ≥ 0"),
    ({"criterion": "enorm", "max_log_scale": 1.0}, "--max-log-scale", "take no bound"),
    ({"solver": "lbfgs", "max_log_scale": "2"}, "--solver", "unconstrained"),
]


@pytest.mark.parametrize("fields, option, message", REFUSED, ids=[str(case[0]) for case in REFUSED])
def test_a_bad_choice_is_refused_when_made_and_when_replaced(fields, option, message):
    with pytest.raises(InvalidOption, match=message) as refused:
        SolveOptions(**fields)
    assert refused.value.option == option
    assert isinstance(refused.value, UsageError) and isinstance(
        refused.value, ValueError
    )  # exit 2; API users catch ValueError
    with pytest.raises(InvalidOption, match=message):
        dataclasses.replace(SolveOptions(), **fields)


@pytest.mark.parametrize(
    "value, rule, bound",
    [("auto", AUTO, None), (" None ", NONE, None), (None, NONE, None), ("0.5", USER, 0.5), (3, USER, 3.0)],
)
def test_the_bound_rule_and_value(value, rule, bound):
    options = SolveOptions(max_log_scale=value)
    assert (options.bound_rule, options.bound) == (rule, bound)
    assert SolveOptions(criterion="enorm", max_log_scale=value if rule != USER else "auto").bound_rule == NONE


@pytest.mark.parametrize("fields, option, message", REFUSED[:3] + REFUSED[9:], ids=str)
def test_the_api_and_the_command_line_refuse_alike(tmp_path, fields, option, message):
    checkpoint, spec = write_mlp(tmp_path)
    model = pathcond.load(checkpoint, arch=str(spec))
    with pytest.raises(InvalidOption, match=message):
        pathcond.rescale(model, **fields)
    arguments = [f"--{key.replace('_', '-')}={value}" for key, value in fields.items()]
    assert_clean_exit(
        invoke("rescale", checkpoint, "--arch", spec, "-o", tmp_path / "o.safetensors", *arguments), 2, option
    )


def test_options_and_keywords_combine(tmp_path):
    checkpoint, spec = write_mlp(tmp_path)
    model = pathcond.load(checkpoint, arch=str(spec))
    result = pathcond.rescale(model, SolveOptions(solver="block", tol=1e-3), tol=1e-4, device="cpu")
    assert (result.solve.method, result.solve.tol) == ("block", 1e-4)
