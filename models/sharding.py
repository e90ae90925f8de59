"""Tensor parallelism for models: place each parameter on a 1-D mesh by the model's plan.

A model's ``tensor_parallel_plan(tp)`` names, for the parameters it splits, which of
their axes is split over the mesh (Megatron style: q/k/v and the MLP's gate/up split by
output columns, o and down by input rows, the vocabulary of the embedding and LM head
when it divides); every other parameter is replicated. Under ``jax.jit`` XLA then inserts
the collectives (an all-reduce after o and down, an all-gather of the logits). Packed
layers (:mod:`.quant_linear`) split their values, scales and mins alike and run their
kernel per device under ``jax.shard_map`` (``tp`` set here); so do the experts of a
mixture of experts (:mod:`.moe`), split along their intermediate units.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .moe import MoE
from .quant_linear import PackedWeight


def shard_model(model: Any, mesh: Mesh) -> Any:
    """Places ``model``'s parameters on ``mesh`` (one axis) in place and returns it.

    Raises ValueError (from the model's plan) when its heads do not split over the mesh.
    """
    if len(mesh.axis_names) != 1:
        raise ValueError(f"tensor parallelism takes a 1-D mesh, got axes {mesh.axis_names}")
    axis = mesh.axis_names[0]
    tp = mesh.devices.size
    entries = model.tensor_parallel_plan(tp)
    plan = {id(getattr(m, attr)): dim for m, attr, dim in entries}
    for m, attr, dim in entries:  # packed layers and experts run per device
        if isinstance(m, PackedWeight) and attr == "q":
            m.tp = (mesh, "out" if dim == len(m.q.get_value().shape) - 2 else "in")
        if isinstance(m, MoE) and attr == "gate_up":
            m.tp = mesh
    for _, param in nnx.iter_graph(model):
        if not isinstance(param, nnx.Param):
            continue
        value = param.get_value()
        spec = [None] * value.ndim
        dim = plan.get(id(param))
        if dim is not None:
            spec[dim] = axis
        param.set_value(jax.device_put(value, NamedSharding(mesh, PartitionSpec(*spec))))
    return model
