"""What the importers refuse: the exceptions they raise for a node that cannot become part of
the ReLU DAG (one set, shared by the fx and ONNX importers and the data-movement reader), and
the non-homogeneous operations, listed by operation type in one line each.

A transformer has dozens of GELUs, softmaxes and LayerNorms; one line per node would bury the
message. Importers collect ``(operation, node)`` pairs and report each operation once with
its count and every node.
"""

from __future__ import annotations


class Unsupported(Exception):
    """Why one node of an imported graph (fx or ONNX) cannot become part of the ReLU DAG. Importers
    collect these, so that one error lists every unsupported node; one is never shown alone."""


class NotHomogeneous(Unsupported):
    """The node computes a function that is not positively homogeneous (grouped by op type)."""


class UnsupportedMovement(Unsupported):
    """Why a data movement is not one the ReLU DAG can represent."""


# Lower-case names of layer types, modules and functions that are not positively homogeneous:
# fx reports them by name, and a spec that names one describes a network pathcond cannot rescale.
NOT_HOMOGENEOUS_TYPES = {
    "gelu",
    "silu",
    "sigmoid",
    "tanh",
    "softmax",
    "log_softmax",
    "layernorm",
    "layer_norm",
    "hardswish",
    "hardsigmoid",
    "relu6",
    "hardtanh",
    "elu",
    "selu",
    "celu",
    "mish",
    "softplus",
    "groupnorm",
    "group_norm",
    "instancenorm",
    "multiheadattention",
    "scaled_dot_product_attention",
    "matmul",
    "bmm",
    "exp",
    "clamp",
    "clip",
    "sqrt",
    "pow",
    "instance_norm",
    "instancenorm1d",
    "instancenorm2d",
    "instancenorm3d",
    "logsigmoid",
    "softsign",
    "tanhshrink",
    "rrelu",
    "glu",
    "swish",
}

NOT_HOMOGENEOUS = "not positively homogeneous, so no rescaling preserves the function (pathcond needs a ReLU network)"

# Node names shown per operation type; the count tells how many there are.
SHOWN_NODES = 4

# Operations that are a ReLU capped at a fixed value.
_CLIPPED = ("clip", "relu6", "hardtanh", "clamp")


def grouped(offenders: list[tuple[str, str]]) -> list[str]:
    """One problem line per operation type: ``Clip ×35: node 'a', node 'b', … and 31 more``; the
    reason is given once, by :func:`offender_note`."""
    by_op: dict[str, list[str]] = {}
    for op, node in offenders:
        by_op.setdefault(op, []).append(node)
    lines = []
    for op, nodes in by_op.items():
        shown = ", ".join(f"node {node!r}" for node in nodes[:SHOWN_NODES])
        more = f" and {len(nodes) - SHOWN_NODES} more" if len(nodes) > SHOWN_NODES else ""
        lines.append(f"{op} ×{len(nodes)}: {shown}{more}")
    return lines


def offender_note(offenders: list[tuple[str, str]]) -> str | None:
    """Why the operations :func:`grouped` lists cannot be rescaled, and what would make the network
    rescalable: one paragraph, or None without offenders."""
    if not offenders:
        return None
    note = (
        f"Why: these operations are {NOT_HOMOGENEOUS}: rescaling a neuron by λ > 0 must scale its output by λ "
        "(f(λx) = λ·f(x)), as ReLU, LeakyReLU/PReLU, pooling and linear layers do."
    )
    if any(any(word in op.lower() for word in _CLIPPED) for op, _ in offenders):
        note += (
            " A clipped ReLU (ReLU6, Clip or Hardtanh with an upper bound) caps at a fixed value that does not "
            "scale with its neuron; without the cap it is a ReLU."
        )
    return note + (
        " What would make it rescalable: replace each listed operation by ReLU (and fine-tune), then export again."
    )
