"""Per-layer cache formats: one model's layers held in different KIVI configs.

Layers differ widely in how much quantization error they tolerate: on SmolLM2-135M one layer
of 30 carries about 40% of what 2-bit keys cost in perplexity (docs/formats.md). A
`MixedCache` spends bits where they matter: it holds one `KiviCache` per distinct config (its
parts), each stacking the layers that use it, and takes the calls a `KiviCache` takes
(`prefill`, `extend`, `advance`, `append`, `write`, and `kivi_jax.decode_attention` /
`chunk_attention`), routing each layer to its part. A part is an ordinary KiviCache, so every
attention implementation that reads one (the Pallas kernel included) reads a mixed cache's
layers.

A layer index is static in an unrolled layer loop (the part is picked at trace time) or
traced under `lax.scan` (a `lax.switch` over the parts picks it at run time). Out of range:
as `kivi_jax.cache.check_layer` (a concrete index raises; a traced one drops the write and
gives NaN attention). `layer_configs` builds the per-layer configs from a base config and
overrides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from kivi_jax.cache import CacheBytes, KiviCache, _check_dims, check_layer
from kivi_jax.config import KiviConfig, is_int

static = dict(static=True)


def parse_layers(text: str, num_layers: int | None = None) -> tuple[int, ...]:
    """ "0-4,10,12-13" -> (0, 1, 2, 3, 4, 10, 12, 13): layer indices and inclusive ranges,
    each layer named once (and within [0, num_layers) when given); ValueError naming `text`
    otherwise."""
    out: list[int] = []
    for item in text.split(","):
        lo, sep, hi = item.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(
                f"layers must be indices or ranges such as 0-4,7; got {text!r}"
            ) from None
        if a < 0 or b < a or (num_layers is not None and b >= num_layers):
            bound = "" if num_layers is None else f" within [0, {num_layers})"
            raise ValueError(f"layers {item.strip()!r} of {text!r}: want a <= b{bound}")
        out.extend(range(a, b + 1))
    if len(set(out)) != len(out):
        raise ValueError(f"layers {text!r} name a layer twice")
    return tuple(out)


def parse_override(text: str) -> tuple[tuple[int, ...], dict]:
    """ "17-18,20 key_bits=4 group_size=64" -> ((17, 18, 20), {"key_bits": 4, "group_size":
    64}): the layers (`parse_layers`), then KiviConfig fields as NAME=VALUE, each value read
    as its field's type (int, "true"/"false", or text). ValueError naming the part that is
    wrong; the values themselves are checked by KiviConfig (`layer_configs`)."""
    layers, *assignments = text.split()
    if not assignments:
        raise ValueError(f"a layer override is 'LAYERS FIELD=VALUE ...', got {text!r}")
    defaults = {f.name: f.default for f in dataclasses.fields(KiviConfig)}
    fields = {}
    for item in assignments:
        name, sep, value = item.partition("=")
        if not sep or name not in defaults:
            raise ValueError(f"{item!r} of {text!r} is not FIELD=VALUE with a KiviConfig field")
        kind = type(defaults[name])
        if kind is bool:
            if value not in ("true", "false"):
                raise ValueError(f"{name} takes true or false, got {value!r}")
            fields[name] = value == "true"
        elif kind is int:
            try:
                fields[name] = int(value)
            except ValueError:
                raise ValueError(f"{name} takes an int, got {value!r}") from None
        else:
            fields[name] = value
    return parse_layers(layers), fields


def layer_configs(
    base: KiviConfig, num_layers: int, overrides: Sequence[tuple[Sequence[int], Mapping]] = ()
) -> tuple[KiviConfig, ...]:
    """Per-layer configs: `base` in every layer, except that each (layers, fields) of
    `overrides` replaces those KiviConfig fields in those layers (dataclasses.replace; a
    layer in two overrides raises ValueError, as an unknown field or a bad value does)."""
    if not isinstance(base, KiviConfig):
        raise ValueError(f"base must be a KiviConfig, got {type(base).__name__}")
    if not is_int(num_layers) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    configs: list[KiviConfig | None] = [None] * num_layers
    names = {f.name for f in dataclasses.fields(KiviConfig)}
    for layers, fields in overrides:
        unknown = set(fields) - names
        if unknown:
            raise ValueError(f"unknown KiviConfig fields {sorted(unknown)}")
        config = dataclasses.replace(base, **fields)
        for layer in layers:
            if not is_int(layer) or not 0 <= layer < num_layers:
                raise ValueError(f"layer {layer!r} outside [0, {num_layers})")
            if configs[layer] is not None:
                raise ValueError(f"layer {layer} is in two overrides")
            configs[layer] = config
    return tuple(base if c is None else c for c in configs)


def mean_bits(configs: Sequence[KiviConfig], head_dim: int) -> float:
    """Stored bits per cached element of a cache whose layers use `configs` (one per layer,
    of equal size): the mean of `KiviConfig.bits_per_element`."""
    return float(np.mean([c.bits_per_element(head_dim) for c in configs]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MixedCache:
    """A KV cache whose layers use different KiviConfigs (module doc)."""

    parts: tuple[KiviCache, ...]  # part i: layers groups[i], stacked [len(groups[i]), B, ...]
    groups: tuple[tuple[int, ...], ...] = dataclasses.field(metadata=static)

    @staticmethod
    def init(
        configs: Sequence[KiviConfig],
        *,
        batch: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype=jnp.bfloat16,
        rope_frequencies=None,
        per_layer: bool = False,
    ) -> MixedCache:
        """An empty cache of len(configs) layers, layer l in configs[l]; the other arguments
        as `KiviCache.init` takes them (rope_frequencies: what pre-RoPE configs need).
        per_layer: one part per layer, even where layers share a config. A part's stores are
        then whole arrays, which XLA's GEMMs read where they lie; a layer of a stacked store
        is a slice, which XLA copies out before a GEMM reads it (what the float formats'
        products read, `kivi_jax.make_cache`)."""
        configs = tuple(configs)
        if not configs or not all(isinstance(c, KiviConfig) for c in configs):
            raise ValueError("configs must be a non-empty sequence of KiviConfig, one per layer")
        if per_layer:
            distinct, groups = list(configs), tuple((i,) for i in range(len(configs)))
        else:
            distinct = list(dict.fromkeys(configs))
            groups = tuple(
                tuple(i for i, c in enumerate(configs) if c == config) for config in distinct
            )
        dims = dict(batch=batch, kv_heads=kv_heads, head_dim=head_dim, max_len=max_len)
        parts = tuple(
            KiviCache.init(
                config, num_layers=len(g), **dims, dtype=dtype, rope_frequencies=rope_frequencies
            )
            for config, g in zip(distinct, groups, strict=True)
        )
        return MixedCache(parts, groups)

    num_layers = property(lambda self: sum(len(g) for g in self.groups))
    batch = property(lambda self: self.parts[0].batch)
    kv_heads = property(lambda self: self.parts[0].kv_heads)
    head_dim = property(lambda self: self.parts[0].head_dim)
    dtype = property(lambda self: self.parts[0].dtype)
    max_len = property(lambda self: self.parts[0].max_len)
    lengths = property(lambda self: self.parts[0].lengths)  # [B] int32, the same in every part
    overflowed = property(lambda self: self.parts[0].overflowed)

    @property
    def configs(self) -> tuple[KiviConfig, ...]:
        """The config of each layer."""
        out: list[KiviConfig | None] = [None] * self.num_layers
        for part, group in zip(self.parts, self.groups, strict=True):
            for layer in group:
                out[layer] = part.config
        return tuple(out)

    def bits_per_element(self) -> float:
        """Stored bits per cached element in the quantized region (`mean_bits`)."""
        return mean_bits(self.configs, self.head_dim)

    def _split(self, x: Array) -> list[Array]:
        """x [L, ...] -> each part's layers, in its order."""
        return [x[np.asarray(g)] for g in self.groups]

    def _check_stacked(self, k: Array, v: Array) -> None:
        want = (self.num_layers, self.batch, self.kv_heads, None, self.head_dim)
        _check_dims("k", k, want)
        _check_dims("v", v, want)

    def prefill(self, k: Array, v: Array, lengths: Array) -> MixedCache:
        """`KiviCache.prefill` of every part with its layers of k, v [L, B, Hkv, S, D]."""
        self._check_stacked(k, v)
        parts = zip(self.parts, self._split(k), self._split(v), strict=True)
        return self._with(p.prefill(pk, pv, lengths) for p, pk, pv in parts)

    def extend(self, k: Array, v: Array, counts: Array) -> MixedCache:
        """`KiviCache.extend` of every part with its layers of k, v [L, B, Hkv, C, D]."""
        self._check_stacked(k, v)
        parts = zip(self.parts, self._split(k), self._split(v), strict=True)
        return self._with(p.extend(pk, pv, counts) for p, pk, pv in parts)

    def advance(self) -> MixedCache:
        """Start a decode step in every part (`KiviCache.advance`; parts of one config, a
        layer each, together: `KiviCache.advance_together`)."""
        if len(self.parts) > 1 and len(set(self.configs)) == 1 == len(self.groups[0]):
            return self._with(KiviCache.advance_together(self.parts))
        return self._with(p.advance() for p in self.parts)

    def append(self, k: Array, v: Array) -> MixedCache:
        """advance() then write() the token k, v [L, B, Hkv, D] into every layer."""
        want = (self.num_layers, self.batch, self.kv_heads, self.head_dim)
        _check_dims("k", k, want)
        _check_dims("v", v, want)
        cache = self.advance()
        for layer in range(self.num_layers):
            cache = cache.write(layer, k[layer], v[layer])
        return cache

    def write(self, layer, k: Array, v: Array) -> MixedCache:
        """Store the new token k, v [B, Hkv, D] of `layer` (after `advance`), in its part."""

        def put(i, local):
            parts = list(self.parts)
            parts[i] = parts[i].write(local, k, v)
            return tuple(parts)

        return dataclasses.replace(self, parts=self.route(layer, put))

    def route(self, layer, fn: Callable[[int, Array | int], object]):
        """fn(part index, layer index in that part) for `layer`: called once with Python ints
        for a concrete layer; for a traced one, once per part under `lax.switch` on the
        layer's part (its results must agree in structure), with an out-of-range layer passed
        as the invalid index -1 (the part drops the write, attention gives NaN)."""
        where = np.zeros(self.num_layers, np.int32)
        local = np.zeros(self.num_layers, np.int32)
        for i, group in enumerate(self.groups):
            where[list(group)], local[list(group)] = i, np.arange(len(group))
        index, in_range = check_layer(layer, self.num_layers)
        if in_range is None:
            i = int(where[int(index)])
            return fn(i, int(local[int(index)]))
        here = jnp.where(in_range, jnp.asarray(local)[index], -1)
        branches = [lambda h, i=i: fn(i, h) for i in range(len(self.parts))]
        return jax.lax.switch(jnp.asarray(where)[index], branches, here)

    def part(self, layer: int) -> tuple[KiviCache, int]:
        """(the part holding concrete `layer`, its index there)."""
        return self.route(layer, lambda i, local: (self.parts[i], local))

    def nbytes(self) -> CacheBytes:
        """Bytes of all parts (each keeps its own [B] lengths)."""
        each = [p.nbytes() for p in self.parts]
        return CacheBytes(*(sum(x) for x in zip(*each, strict=True)))

    def logical_axes(self) -> MixedCache:
        """The same pytree with a PartitionSpec of logical axis names in place of each array."""
        return self._with(p.logical_axes() for p in self.parts)

    def _with(self, parts) -> MixedCache:
        return dataclasses.replace(self, parts=tuple(parts))
