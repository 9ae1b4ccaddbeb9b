"""Logical axis names -> mesh axes.

Every cache array carries logical axis names (`cache.logical_axes()`): layers, batch, kv_heads,
head_dim, cache_seq (tokens), cache_seq_packed (packed token rows), cache_seq_groups (key scale
groups along tokens), head_dim_groups (value scale groups along channels), residual. A rule
table maps each name to a mesh axis (or None: replicated), as in MaxText and jax-llm-examples.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from jax.sharding import Mesh, NamedSharding

LOGICAL_AXES = (
    "layers",
    "batch",
    "kv_heads",
    "head_dim",
    "cache_seq",
    "cache_seq_packed",
    "cache_seq_groups",
    "head_dim_groups",
    "residual",
)

# Data parallel over rows, tensor parallel over KV heads: what a decode server usually wants.
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {"batch": "data", "kv_heads": "model"}

# Long context: the token axes split over "seq" too (each device holds a slice of every row).
# The cache permutes tokens only within blocks of 256 (the cache order, docs/layout.md), so with
# a capacity that is a multiple of 256 x the "seq" size every shard holds whole blocks and a
# token's codes, scales and minimums live on the device that holds its position.
LONG_CONTEXT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": "data",
    "kv_heads": "model",
    "cache_seq": "seq",
    "cache_seq_packed": "seq",
    "cache_seq_groups": "seq",
}


def logical_to_mesh(spec: jax.P, rules: Mapping[str, str | tuple[str, ...] | None]) -> jax.P:
    """Map a PartitionSpec of logical names to one of mesh axis names."""
    for name in rules:
        if name not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {name!r} in rules; known: {LOGICAL_AXES}")
    axes = [rules.get(name) if name is not None else None for name in spec]
    # Trailing replicated axes dropped: the form XLA gives a jitted update's outputs back in
    # (the blocked value codes' 6-D array came back as P(None, 'data', 'model') from an
    # in-place append and recompiled the next call), so shardings round-trip unchanged.
    while axes and axes[-1] is None:
        axes.pop()
    return jax.P(*axes)


def cache_specs(cache, rules: Mapping):
    """A pytree like `cache` holding each array's PartitionSpec of mesh axes under `rules`
    (what `jax.shard_map` takes as the cache's in and out specs)."""
    return jax.tree.map(
        lambda spec: logical_to_mesh(spec, rules),
        cache.logical_axes(),
        is_leaf=lambda x: isinstance(x, jax.P),
    )


def cache_shardings(cache, mesh: Mesh, rules: Mapping | None = None):
    """A pytree like `cache` holding the NamedSharding of each array under `rules`."""
    rules = DEFAULT_RULES if rules is None else rules
    for name, axes in rules.items():
        for ax in (axes,) if isinstance(axes, str) else (axes or ()):
            if ax not in mesh.axis_names:
                raise ValueError(
                    f"rule {name!r} -> {ax!r}: mesh has no axis {ax!r} (axes {mesh.axis_names})"
                )
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        cache_specs(cache, rules),
        is_leaf=lambda x: isinstance(x, jax.P),
    )


def shard_cache(cache, mesh: Mesh, rules: Mapping | None = None):
    """Place every array of `cache` on `mesh` according to `rules`."""
    return jax.device_put(cache, cache_shardings(cache, mesh, rules))
