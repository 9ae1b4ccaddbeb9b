"""Sequence parallelism: a KIVI cache whose token axes are sharded over a mesh axis, attended
and written where its tokens are.

Attention (`sequence_parallel_attention`): each device attends over the quantized positions
it holds (the Pallas kernel on a Hopper GPU, the folded jnp form elsewhere), the device of the
first shard also over the residual windows (replicated: every device holds each row's newest
tokens), and the partial results, normalized outputs and log-sum-exps, are merged across the
axis by one max and two sums of B x Hq x (D + 1) floats. No cache byte crosses devices. Built
with `jax.shard_map`, so what runs is what is written here, whatever the compiler would have
chosen for the global computation.

Writes (`sequence_parallel_append`, `sequence_parallel_prefill`): inside the same shard_map
each device's cache knows its shard (`KiviCache.seq_axis`): every device writes the new token
into its copy of the windows, and codes and scales only at the positions it holds, so the
result is the unsharded cache bit for bit with no communication.

A `MixedCache` (per-layer configs) is sharded part by part, each part a KiviCache as above.

The sharding follows the logical axis rules of `kivi_jax.sharding` (`LONG_CONTEXT_RULES`: rows
over "data", kv heads over "model", tokens over "seq"); the query's rows and heads follow the
cache's rows and kv heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.sharding import AxisType, Mesh, NamedSharding

from kivi_jax.attention import (
    _check_query,
    _check_scale,
    _group_query,
    _kernel_applies,
    _prerope_beside,
    _softmax_attend,
    kernel_on_cache,
    merge_across,
    merge_partials,
    quantized_region_dense,
    quantized_region_folded,
    tail_attention,
)
from kivi_jax.cache import BLOCK_TOKENS, KiviCache, check_layer, runtime_layer
from kivi_jax.mixed import MixedCache
from kivi_jax.sharding import LONG_CONTEXT_RULES, cache_specs, logical_to_mesh

IMPLEMENTATIONS = ("auto", "folded", "pallas")
ShardedCache = KiviCache | MixedCache  # a MixedCache's parts are sharded alike


def _mesh_axis(rules: Mapping, name: str) -> str | None:
    axis = rules.get(name)
    if axis is not None and not isinstance(axis, str):
        raise ValueError(f"rule {name!r} -> {axis!r}: one mesh axis name (or None) expected")
    return axis


def local_attention(qg, q, cache: KiviCache, layer, seq_axis, impl, scale, interpret):
    """(o [B, Hkv, r, D], lse [B, Hkv, r]) of this device's quantized positions, and on the
    first shard of `seq_axis` the windows and the sinks too."""
    shard = lax.axis_index(seq_axis)
    cap = cache.keys.capacity  # this shard's positions [shard * cap, (shard + 1) * cap)
    m = cache.quantized_split()  # global: lengths and windows are replicated over the axis
    m_local = jnp.clip(m - shard * cap, 0, cap)
    config = cache.config
    parts, beside = [], tail_attention
    if impl == "pallas":
        # The integer kernel skips a static count of slots: every shard's first N (N sinks),
        # attended beside it (the first shard's are the sinks, read from their buffers). The
        # pre-RoPE kernel masks the sinks by position; they are attended with the tail.
        o, lse = kernel_on_cache(
            q, cache, layer, m_local, scale=scale, interpret=interpret, skip_sinks=True
        )
        parts.append((o.reshape(qg.shape), lse.reshape(qg.shape[:-1])))
        if config.prerope_kernel_layout:
            beside = _prerope_beside
        elif config.sinks:
            parts.append(_first_slots(qg, cache, layer, m, shard * cap))
    elif config.plain_kivi:
        parts.append(quantized_region_folded(qg, cache.keys, cache.values, layer, m_local))
    else:  # sinks, other formats, keys before RoPE (read back at the shard's positions)
        parts.append(quantized_region_dense(qg, cache, layer, m_local))
    o_w, lse_w = beside(qg, cache, layer, m)
    lse_w = jnp.where(shard == 0, lse_w, -jnp.inf)  # the windows (and sinks) count once
    return merge_partials([*parts, (o_w, lse_w)])


def _first_slots(qg, cache: KiviCache, layer, m, origin) -> tuple[Array, Array]:
    """Attention over a token shard's first N slots (N sinks; positions origin + [0, N) below
    the quantized split m), which the integer kernel skips: on the first shard the sinks from
    their buffers, elsewhere quantized positions. Keys as stored (q is in their basis)."""
    n = jnp.minimum(cache.lengths, cache.max_len)
    t = origin + jnp.broadcast_to(jnp.arange(cache.keys.sinks), (cache.batch, cache.keys.sinks))
    k = cache.keys.gather(layer, t, n, origin)
    v = cache.values.gather(layer, t, n, origin)
    return _softmax_attend(qg, k, v, (t < m[:, None]) & (t < n[:, None]))


def shard_attention(qg, q, cache: KiviCache, layer, implementation, scale, interpret) -> Array:
    """`decode_attention` on a cache that holds one shard of the token axes, inside
    `jax.shard_map` over `cache.seq_axis`: this device's part, merged across the axis ->
    [B, Hkv, r, D]. implementation: "pallas" the kernel; "reference" / "folded" the folded jnp
    form; "auto" the kernel where it applies."""
    if not cache.windows_aligned:
        raise NotImplementedError(
            "sequence-parallel attention needs key and value windows of one size (R >= G)"
        )
    if implementation not in ("auto", "pallas", "folded", "reference"):
        raise NotImplementedError(f"{implementation!r} on a sequence-sharded cache")
    impl = implementation
    if impl == "auto":
        impl = "pallas" if _kernel_applies(q, cache) else "folded"
    axis = cache.seq_axis
    o, lse = local_attention(qg, q, cache, layer, axis, impl, scale, interpret)
    return merge_across(o, lse, axis)


def on_token_shards(fn, seq_axis: str):
    """fn wrapped to run inside `jax.shard_map` over `seq_axis`: every KiviCache among its
    arguments knows its shard of the token axes (`KiviCache.seq_axis`), so that its writes and
    `decode_attention` are sequence-parallel; every KiviCache it returns is plain again (the
    same pytree as outside)."""
    mark = lambda tree, axis: jax.tree.map(
        lambda x: dataclasses.replace(x, seq_axis=axis) if isinstance(x, KiviCache) else x,
        tree,
        is_leaf=lambda x: isinstance(x, KiviCache),
    )
    return lambda *args: mark(fn(*mark(args, seq_axis)), None)


def sequence_parallel_attention(
    q: Array,
    cache: ShardedCache,
    layer,
    *,
    mesh: Mesh,
    rules: Mapping | None = None,
    implementation: str = "auto",
    scale: float | None = None,
    interpret: bool = False,
) -> Array:
    """Decode attention over `layer` of a KIVI cache whose token axes are sharded over a mesh
    axis (`rules["cache_seq"]`, default `LONG_CONTEXT_RULES`: "seq"), computed where the tokens
    are; returns [B, Hq, D] in q.dtype, equal to `decode_attention` up to float32 rounding. A
    `MixedCache` (per-layer configs) is attended in the part that holds `layer`.

    implementation: "pallas" (the kernel per shard, Hopper GPUs, or `interpret=True`),
    "folded" (jnp), "auto" (the kernel where it applies, else "folded"). The cache's arrays
    may be sharded already (`kivi_jax.sharding.shard_cache` with the same rules) or not (they
    are then moved). Raises ValueError for a token axis the rules do not map, a capacity that
    does not split into whole blocks of 256 tokens per shard, or an unknown implementation;
    NotImplementedError for caches whose key and value windows differ (R < G: the tail would
    read quantized values of other shards).
    """
    rules = LONG_CONTEXT_RULES if rules is None else rules
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if isinstance(cache, MixedCache):  # the layer's part (`MixedCache.route`)
        kw = dict(
            mesh=mesh, rules=rules, implementation=implementation, scale=scale, interpret=interpret
        )
        return cache.route(
            layer, lambda i, local: sequence_parallel_attention(q, cache.parts[i], local, **kw)
        )
    _parts(cache)  # ValueError for anything but a KiviCache here
    _check_query(q, cache)
    scale = _check_scale(scale, q.shape[-1])
    seq_axis, specs = _sequence_sharding(cache, mesh, rules)
    impl = implementation  # "auto" is decided inside, on a shard's cache (`shard_attention`)
    layer, in_range = check_layer(layer, cache.num_layers)
    layer = runtime_layer(layer)
    q_spec = logical_to_mesh(jax.P("batch", "kv_heads", None), rules)

    def local(q, cache, layer):
        q = cache.rotate_query(q)  # the stored keys' basis (`KiviConfig.rotation`)
        qg = _group_query(q, cache.kv_heads, scale)
        o = cache.unrotate_output(shard_attention(qg, q, cache, layer, impl, scale, interpret))
        return o.reshape(q.shape).astype(q.dtype)

    q, cache, layer = _place(
        mesh, (q, cache, jnp.asarray(layer, jnp.int32)), (q_spec, specs, jax.P())
    )
    o = jax.shard_map(
        on_token_shards(local, seq_axis),
        mesh=mesh,
        in_specs=(q_spec, specs, jax.P()),
        out_specs=q_spec,
        check_vma=False,
    )(q, cache, layer)
    if in_range is not None:  # a traced layer out of range: never another layer's answer
        o = jnp.where(in_range, o, jnp.nan).astype(q.dtype)
    return o


def _parts(cache) -> tuple[KiviCache, ...]:
    """The KiviCaches a sequence-sharded cache is made of: itself, or a MixedCache's parts;
    ValueError for anything else."""
    if isinstance(cache, KiviCache):
        return (cache,)
    if isinstance(cache, MixedCache):
        return cache.parts
    raise ValueError(f"cache must be a KiviCache or a MixedCache, got {type(cache).__name__}")


def _sequence_sharding(cache: ShardedCache, mesh: Mesh, rules: Mapping):
    """The mesh axis of the token axes and the cache's PartitionSpecs under `rules`; checks
    that the shards hold whole blocks and that the tail reads the windows alone (in every
    part of a MixedCache)."""
    seq_axis = _mesh_axis(rules, "cache_seq")
    if seq_axis is None or seq_axis not in mesh.axis_names:
        raise ValueError(f"rules map the tokens to {seq_axis!r}, not an axis of {mesh.axis_names}")
    for name in ("cache_seq_packed", "cache_seq_groups"):
        if _mesh_axis(rules, name) != seq_axis:
            raise ValueError(f"rule {name!r} must map to the tokens' axis {seq_axis!r}")
    shards = mesh.shape[seq_axis]
    for part in _parts(cache):
        if part.keys.capacity % (BLOCK_TOKENS * shards):
            raise ValueError(
                f"capacity {part.keys.capacity} does not split into whole blocks of "
                f"{BLOCK_TOKENS} tokens over {shards} shards of {seq_axis!r}: make max_len a "
                f"multiple of {BLOCK_TOKENS * shards}"
            )
        if not part.windows_aligned:
            raise NotImplementedError(
                "sequence-parallel attention needs key and value windows of one size (R >= G)"
            )
    specs = cache_specs(cache, rules)
    return seq_axis, specs


def _place(mesh: Mesh, args, specs):
    """Explicit axes: the arguments placed as shard_map takes them (no-ops where they are
    already); under Auto axes shard_map places them itself."""
    if not all(t == AxisType.Explicit for t in mesh.axis_types):
        return args
    return jax.tree.map(
        lambda x, spec: jax.reshard(x, NamedSharding(mesh, spec)),
        args,
        specs,
        is_leaf=lambda x: isinstance(x, jax.P),
    )


def _per_shard(fn, cache: ShardedCache, mesh: Mesh, rules: Mapping | None, args, arg_specs):
    """fn(local cache, *args) -> local cache, run where the tokens are: each device's cache
    holds its shard of the token axis (`KiviCache.seq_axis`) and writes only its positions."""
    rules = LONG_CONTEXT_RULES if rules is None else rules
    seq_axis, specs = _sequence_sharding(cache, mesh, rules)
    for part in _parts(cache):
        if part.keys.capacity // mesh.shape[seq_axis] % part.keys.window:
            raise ValueError(
                f"each shard's {part.keys.capacity // mesh.shape[seq_axis]} positions must be "
                f"whole key blocks of {part.keys.window}"
            )
    arg_specs = tuple(logical_to_mesh(a, rules) for a in arg_specs)

    local = on_token_shards(fn, seq_axis)
    cache, *args = _place(mesh, (cache, *args), (specs, *arg_specs))
    return jax.shard_map(
        local, mesh=mesh, in_specs=(specs, *arg_specs), out_specs=specs, check_vma=False
    )(cache, *args)


def sequence_parallel_append(cache: ShardedCache, k: Array, v: Array, *, mesh: Mesh, rules=None):
    """`cache.append(k, v)` (k, v [L, B, Hkv, D]) on a cache whose token axes are sharded over
    a mesh axis: every device writes the token into its replicated windows and quantizes what
    leaves them only where it holds the positions, so no cache byte crosses devices. Equal to
    the unsharded append bit for bit. Errors as `sequence_parallel_attention`'s."""
    spec = jax.P(None, "batch", "kv_heads", None)
    return _per_shard(lambda c, k, v: c.append(k, v), cache, mesh, rules, (k, v), (spec, spec))


def sequence_parallel_prefill(
    cache: ShardedCache, k: Array, v: Array, lengths: Array, *, mesh: Mesh, rules=None
):
    """`cache.prefill(k, v, lengths)` (k, v [L, B, Hkv, S, D], replicated over the token
    axis's mesh axis) on a cache whose token axes are sharded over it: each device quantizes
    only the positions it holds. Equal to the unsharded prefill bit for bit. Errors as
    `sequence_parallel_attention`'s, and `KiviCache.prefill`'s."""
    return _tokens_per_shard("prefill", cache, k, v, lengths, mesh, rules)


def sequence_parallel_extend(
    cache: ShardedCache, k: Array, v: Array, counts: Array, *, mesh: Mesh, rules=None
):
    """`cache.extend(k, v, counts)` (a chunk k, v [L, B, Hkv, C, D], replicated over the token
    axis's mesh axis; chunked prefill) on a cache whose token axes are sharded over it: every
    device updates its replicated windows and quantizes only the positions it holds. Equal to
    the unsharded extend bit for bit. Errors as `sequence_parallel_attention`'s, and
    `KiviCache.extend`'s."""
    return _tokens_per_shard("extend", cache, k, v, counts, mesh, rules)


def _tokens_per_shard(method: str, cache: ShardedCache, k, v, per_row, mesh, rules):
    """`cache.<method>(k, v, per_row)` for k, v [L, B, Hkv, S, D] replicated over the token
    axis's mesh axis and per_row [B] (prefill's lengths, extend's counts), per shard."""
    spec = jax.P(None, "batch", "kv_heads", None, None)
    return _per_shard(
        lambda c, k, v, n: getattr(c, method)(k, v, n),
        cache,
        mesh,
        rules,
        (k, v, jnp.asarray(per_row)),
        (spec, spec, jax.P("batch")),
    )
