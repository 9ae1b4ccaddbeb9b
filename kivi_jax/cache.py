"""The quantized KV cache (KiviCache) and its full-precision twin (DenseCache).

Both are registered dataclass pytrees with a fixed capacity `max_len` (static shapes under
jit), layers stacked on a leading axis, and per-row lengths (ragged batches). Every method is
pure and returns a new cache. The layout of the quantized arrays is the kernels' layout and is
documented once, in docs/layout.md; the packing rule lives in kivi_jax/quant.py.

Decode protocol: `advance()` once per step (lengths += 1), then `write(layer, k, v)` for each
layer stores the new token at position lengths - 1, then attention reads positions
[0, lengths). `append(k, v)` does both for all layers at once.

Capacity policy: a row never holds more than `max_len` tokens. Outside jit, `prefill` or
`advance` past capacity raises ValueError. Inside jit, tokens past capacity are dropped (never
written over older ones), `lengths` keeps counting so that `overflowed` is True for that row,
attention reads only the first `max_len` tokens, and a `checkify.debug_check` reports it
under `checkify.checkify`. Call `check_capacity(cache)` on the host to raise.

The same policy covers prefill's `lengths` (`_CacheOps._prefill_lengths`): outside jit a length
outside [0, S] raises ValueError; inside jit the row stores its tokens up to the length clamped
to [0, S], is marked `overflowed` (its length is set to max_len + 1, so later appends to it are
dropped too), and a `checkify.debug_check` reports it. A layer index outside [0, L) raises
ValueError when concrete; a traced one drops the write (`check_layer`). Every case, with the
non-finite and out-of-range values of quantization: docs/what_happens_when.md.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.experimental import checkify

from kivi_jax import formats, rotation
from kivi_jax.config import KiviConfig, is_int

if TYPE_CHECKING:  # kivi_jax.mixed builds on this module
    from kivi_jax.mixed import MixedCache
from kivi_jax.quant import (
    CACHE_PLANE,
    CODE_BLOCK,
    block_columns,
    cache_slot,
    codes_per_byte,
    dequantize_codes,
    minmax_quantize,
    outlier_channels,
    overlay_outliers,
    pack_tokens,
    stored_byte,
    to_cache_order,
    to_stored_bytes,
    unblock_columns,
    unpack,
    unpack_tokens,
    value_codes_blocked,
)

static = dict(static=True)
WHOLE = slice(None)  # a whole axis, in the index tuples of `put_dropped`
BLOCK_TOKENS = 256  # quantized capacity is a multiple of this (a block of the cache order)


class CacheBytes(NamedTuple):
    """Bytes held by a cache, by kind. `total` is their sum."""

    codes: int
    scales: int
    residual: int
    metadata: int

    @property
    def total(self) -> int:
        return self.codes + self.scales + self.residual + self.metadata


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_dims(name: str, x, want: tuple, dtype_kind="floating") -> None:
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != len(want):
        raise ValueError(f"{name} must have shape {want}, got {shape}")
    for got, w in zip(shape, want, strict=True):
        if w is not None and got != w:
            raise ValueError(f"{name} must have shape {want} (None = any), got {shape}")
    if dtype_kind == "floating" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
    if dtype_kind == "integer" and not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")


def check_layer(layer, num_layers: int) -> tuple[Array | int, Array | None]:
    """Validate a layer index of a cache of `num_layers` layers -> (index, in_range).

    A concrete index (a Python or NumPy int, or an integer scalar array outside jit) must lie in
    [0, num_layers) (negative indices do not wrap: -1 is as likely a bug as 7); else ValueError
    naming `layer`. It is returned as given, with in_range None. A traced index cannot raise:
    it comes back clamped into range (so every read is defined) with in_range, a traced bool
    the caller must act on (a write is dropped, attention gives NaN), and a
    `checkify.debug_check` reports it under `checkify.checkify`.
    """
    shape, dtype = getattr(layer, "shape", None), getattr(layer, "dtype", None)
    scalar_array = shape == () and dtype is not None and jnp.issubdtype(dtype, jnp.integer)
    if not (is_int(layer) or isinstance(layer, np.integer) or scalar_array):
        raise ValueError(f"layer must be an integer scalar, got {layer!r}")
    if _is_concrete(layer):
        if not 0 <= int(layer) < num_layers:
            raise ValueError(f"layer must be in [0, {num_layers}), got {layer}")
        return layer, None
    in_range = (layer >= 0) & (layer < num_layers)
    checkify.debug_check(in_range, f"layer {{layer}} outside [0, {num_layers})", layer=layer)
    return jnp.clip(layer, 0, num_layers - 1), in_range


def runtime_layer(layer) -> Array:
    """A layer index checked by `check_layer` as an int32 scalar that XLA cannot fold into a
    constant. The quantized caches index their [L, ...] arrays with it: in a model that
    unrolls its layers, every layer's writes and reads are then the same fusions, which XLA
    compiles once, where a constant index makes each layer's fusions kernels of their own and
    the compile time grows with the layers."""
    return jax.lax.optimization_barrier(jnp.asarray(layer, jnp.int32))


def put_dropped(buf: Array, index: tuple, x: Array, add: bool = False) -> Array:
    """`buf.at[index].set(x, mode="drop")` (`add`: `.add`), one token per row, where index
    holds per leading axis of buf an int or scalar, a [B] array (one position per row) or
    slice(None); an index out of bounds drops that row's write, negative ones wrap.

    With one row (every array entry of size 1) it is a dynamic_update_slice of a select
    against the old slice, which XLA fuses with x's producer into one launch that writes in
    place; the scatter it stands for is two (its bounds check reads the old slice in a fusion
    of its own), twice per layer in a decode step at batch 1. Several rows: the scatter."""
    entries = [i if isinstance(i, slice) else jnp.asarray(i) for i in index]
    one_row = all(
        (isinstance(i, slice) and i == slice(None)) or (not isinstance(i, slice) and i.size == 1)
        for i in entries
    )
    if not one_row:
        at = buf.at[index]
        return at.add(x, mode="drop") if add else at.set(x, mode="drop")
    entries += [slice(None)] * (buf.ndim - len(entries))
    starts, sizes, inside = [], [], jnp.bool_(True)
    for i, n in zip(entries, buf.shape, strict=True):
        if isinstance(i, slice):
            starts.append(0)
            sizes.append(n)
            continue
        i = i.reshape(()).astype(jnp.int32)
        i = jnp.where(i < 0, i + n, i)
        inside &= (i >= 0) & (i < n)
        starts.append(i)
        sizes.append(1)
    old = jax.lax.dynamic_slice(buf, starts, sizes)
    new = x.reshape(sizes).astype(buf.dtype)
    new = old + new if add else new
    return jax.lax.dynamic_update_slice(buf, jnp.where(inside, new, old), starts)


def token_rows(t: Array, bits: int) -> tuple[Array, Array]:
    """Byte row and bit shift of token positions t in the cache's packed token axis (in the
    cache order, `kivi_jax.quant.cache_slot`, token-planar)."""
    per = codes_per_byte(bits)
    s = cache_slot(t)
    row = (s // (CACHE_PLANE * per)) * CACHE_PLANE + s % CACHE_PLANE
    shift = (bits * ((s // CACHE_PLANE) % per)).astype(jnp.uint8)
    return row, shift


# ---------------------------------------------------------------------------------------------
# One quantized tensor (keys or values) of all layers.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedStore:
    """Keys or values of every layer: packed codes, scales, minimums and a residual window.

    axis="channel": one (scale, min) per channel and group of G tokens; a window of W =
    max(R, G) tokens, each full block of which is quantized at once when the next token
    arrives (KIVI keys).
    axis="token": one (scale, min) per token and group of G channels; a window of W = R tokens,
    each quantized when it leaves (KIVI values).
    Either way the window is a ring holding the newest W tokens (token p in slot p % W), and
    readers take positions [n - W, n) of a row of n tokens from it, in full precision: a key
    block stays in its window after it is quantized, until the next block's tokens replace it
    one by one (`full_precision_from`).
    transposed=False keeps tokens on the rows of the codes (keys); True keeps them on the
    columns, i.e. stores V^T (values), which is what the kernel's P.V product wants; at 2 bits
    in blocks of 64 byte columns (`kivi_jax.quant.block_columns`, `value_codes_blocked`: one
    contiguous block per kernel step).
    fmt: the element format (`kivi_jax.formats`); the float formats are per token, with one
    scale per block of `formats.block_size` channels and `minimum` holding their per-group
    side values (the FP32 group scale of "nvfp4"; none for "fp8" and "mxfp4").
    The first N positions (sinks) are kept in full precision too, in `sink`; per channel they
    are left out of their group's range (`_exclude_sinks`).
    Per channel, each group of G tokens may also keep its K channels of widest range in
    `outlier` (dense-and-sparse, `kivi_jax.quant.outlier_channels`): their codes are written
    but never read.
    """

    # [L, B, Hkv, Tq/P, D]; transposed: [L, B, Hkv, D, Tq/P], blocked [L, B, Hkv, Tq/(64 P), D, 64]
    codes: Array  # uint8
    # channel: [L, B, Hkv, Tq/G, D]; token: [L, B, Hkv, D/blk, Tq] (blk = G for "int")
    scale: Array
    # "int": the minimums, shaped as scale; "nvfp4": [L, B, Hkv, D/G, Tq]; None for "fp8" and
    # "mxfp4" (absent arrays are None, never zero-sized: XLA's CPU compiler crashes on those
    # inside shard_map)
    minimum: Array | None
    # [L, B, Hkv, W, D] in the model dtype, token p in slot p % W; transposed: [L, B, Hkv, D, W]
    residual: Array
    # [L, B, Hkv, N, D] in the model dtype: position j < N once it is quantized (until then
    # readers take it from the window), zeros before (`_store_sinks`); None if N = 0
    sink: Array | None
    outlier: Array | None  # [L, B, Hkv, Tq, K] in the scale dtype: K channels' values; or None
    outlier_channel: Array | None  # [L, B, Hkv, Tq/G, K] uint8: which channels, per group
    bits: int = dataclasses.field(metadata=static)
    group_size: int = dataclasses.field(metadata=static)
    axis: str = dataclasses.field(metadata=static)
    transposed: bool = dataclasses.field(metadata=static)
    fmt: str = dataclasses.field(default="int", metadata=static)

    @property
    def window(self) -> int:
        return self.residual.shape[-1 if self.transposed else -2]

    def window_tokens(self) -> Array:
        """The windows of all layers as [L, B, Hkv, W, D]."""
        return self.residual.swapaxes(-1, -2) if self.transposed else self.residual

    def layer_window(self, layer) -> Array:
        """The window of `layer` as [B, Hkv, W, D]."""
        x = self.residual[layer]
        return x.swapaxes(-1, -2) if self.transposed else x

    @property
    def sinks(self) -> int:
        """N: the leading positions also kept in full precision (`sink`)."""
        return 0 if self.sink is None else self.sink.shape[-2]

    @property
    def outliers(self) -> int:
        """K: the channels per group of G tokens kept in `outlier` (0: none)."""
        return 0 if self.outlier is None else self.outlier.shape[-1]

    def _store_sinks(self, sink: Array, x: Array, start: Array, stop: Array) -> Array:
        """Sink buffer `sink` [..., B, H, N, D] with x (broadcasting to it) in slots j of
        [start, stop) [B]: the positions quantized by the caller. Sink j is stored when
        position j is quantized (global positions: every token shard keeps the sinks): with a
        window, in `flush`, once per step for all layers, not in each layer's `write`. A
        select over the slots (N is small): a scatter into them led XLA to lay the sink
        buffer out slot-minor, and with it the window, which the kernel then took transposed."""
        j = jnp.arange(self.sinks)[None, :]
        hit = (j >= start[:, None]) & (j < stop[:, None])  # [B, N]
        return jnp.where(hit[:, None, :, None], x.astype(sink.dtype), sink)

    def _exclude_sinks(self, xg: Array, pos: Array) -> Array:
        """Channel groups xg [..., n/G, G, D] of global positions pos (broadcasting to xg) with
        the sink positions replaced by their group's last element: their codes are never read
        (the sink buffer is), and so they do not widen the group's range. A group of sinks
        only stays a group of sinks."""
        if not self.sinks:
            return xg
        return jnp.where(pos < self.sinks, xg[..., -1:, :], xg)

    def _overlay_sinks(self, x: Array, sinks: Array, t: Array) -> Array:
        """x where global positions t (broadcasting to x) are >= N, else `sinks` (float32)."""
        return jnp.where(t < self.sinks, sinks.astype(jnp.float32), x)

    @property
    def blocked(self) -> bool:
        """V^T codes in blocks of 64 byte columns (`kivi_jax.quant.block_columns`)."""
        return self.transposed and self.codes.ndim == 6

    @property
    def packed_len(self) -> int:
        """Tq / P: packed token rows (byte columns of V^T) per row."""
        if self.blocked:
            return self.codes.shape[-3] * CODE_BLOCK
        return self.codes.shape[-1] if self.transposed else self.codes.shape[-2]

    @property
    def capacity(self) -> int:
        """Tq: quantized positions per row."""
        return self.packed_len * codes_per_byte(self.bits)

    def num_quantized(self, lengths: Array) -> Array:
        """Per row, how many leading positions have codes for rows holding `lengths` tokens: per
        channel, the whole blocks of W before the newest token's block (a full block is
        quantized when the next token arrives, `flush`); per token, all but the newest W."""
        w = self.window
        if self.axis == "channel":
            return (jnp.maximum(lengths - 1, 0) // w) * w
        return jnp.maximum(lengths - w, 0)

    def full_precision_from(self, lengths: Array) -> Array:
        """Per row, the first position read from the window (full precision): the newest W
        positions [n - W, n) of a row of n tokens; those before are read from the codes."""
        return jnp.maximum(lengths - self.window, 0)

    @staticmethod
    def init(
        bits,
        group_size,
        axis,
        transposed,
        *,
        num_layers,
        batch,
        kv_heads,
        head_dim,
        capacity,
        window,
        dtype,
        scale_dtype,
        fmt="int",
        sinks=0,
        outliers=0,
    ) -> QuantizedStore:
        lbh = (num_layers, batch, kv_heads)
        per = codes_per_byte(bits)
        if transposed and value_codes_blocked(bits):
            codes = (*lbh, capacity // per // CODE_BLOCK, head_dim, CODE_BLOCK)
        elif transposed:
            codes = (*lbh, head_dim, capacity // per)
        else:
            codes = (*lbh, capacity // per, head_dim)
        if axis == "channel":
            scale = aux = (*lbh, capacity // group_size, head_dim)
        else:
            scale = (*lbh, head_dim // formats.block_size(fmt, group_size), capacity)
            aux = (*lbh, head_dim // group_size * formats.aux_count(fmt), capacity)
        scale_dt = formats.block_scale_dtype(fmt, scale_dtype)
        return QuantizedStore(
            codes=jnp.zeros(codes, jnp.uint8),
            scale=jnp.full(scale, formats.empty_scale(scale_dt), scale_dt),
            minimum=(jnp.zeros(aux, formats.aux_dtype(fmt, scale_dtype)) if aux[-2] else None),
            residual=jnp.zeros(
                (*lbh, head_dim, window) if transposed else (*lbh, window, head_dim), dtype
            ),
            sink=jnp.zeros((*lbh, sinks, head_dim), dtype) if sinks else None,
            outlier=jnp.zeros((*lbh, capacity, outliers), scale_dt) if outliers else None,
            outlier_channel=(
                jnp.zeros((*lbh, capacity // group_size, outliers), jnp.uint8) if outliers else None
            ),
            bits=bits,
            group_size=group_size,
            axis=axis,
            transposed=transposed,
            fmt=fmt,
        )

    def logical_axes(self) -> QuantizedStore:
        lbh = ("layers", "batch", "kv_heads")
        if self.transposed:
            codes = (
                jax.P(*lbh, "cache_seq_packed", "head_dim", None)
                if self.blocked
                else jax.P(*lbh, "head_dim", "cache_seq_packed")
            )
        else:
            codes = jax.P(*lbh, "cache_seq_packed", "head_dim")
        if self.axis == "channel":
            scale = jax.P(*lbh, "cache_seq_groups", "head_dim")
        else:
            scale = jax.P(*lbh, "head_dim_groups", "cache_seq")
        res = (
            jax.P(*lbh, "head_dim", "residual")
            if self.transposed
            else jax.P(*lbh, "residual", "head_dim")
        )
        sink = jax.P(*lbh, None, "head_dim")  # replicated over token shards: N is small
        return dataclasses.replace(
            self,
            codes=codes,
            scale=scale,
            minimum=None if self.minimum is None else scale,
            residual=res,
            sink=None if self.sink is None else sink,
            outlier=None if self.outlier is None else jax.P(*lbh, "cache_seq", None),
            outlier_channel=(
                None if self.outlier is None else jax.P(*lbh, "cache_seq_groups", None)
            ),
        )

    # -- scatter helpers: rows, groups or slots pushed out of bounds are dropped (mode="drop"),
    # which is how a write is skipped for rows that do not flush, or past capacity.

    def _add_codes(self, layer, b, rows, vals) -> Array:
        """OR packed code bits `vals` [B, (W,) H, D] into token rows `rows` [B(, W)] of a layer
        (in the stored byte order of a row: `kivi_jax.quant.stored_byte`). 8-bit codes
        fill their byte and are set (an add reads the old byte first)."""

        put = lambda index, x: put_dropped(self.codes, index, x, add=self.bits != 8)
        if self.blocked:  # a token row is a byte column of V^T, in blocks of 64 columns
            col = stored_byte(rows, self.bits)
            return put((layer, b, WHOLE, col // CODE_BLOCK, WHOLE, col % CODE_BLOCK), vals)
        if self.transposed:  # a token row is a byte column of the stored [D, T/P] rows
            return put((layer, b, WHOLE, WHOLE, stored_byte(rows, self.bits)), vals)
        return put((layer, b, WHOLE, rows, WHOLE), to_stored_bytes(vals, self.bits))

    def _set_scales(self, layer, b, idx, scale, mn) -> QuantizedStore:
        index = (layer, b, WHOLE, idx, WHOLE)
        if self.axis != "channel":
            index = (layer, b, WHOLE, WHOLE, idx)
        return dataclasses.replace(
            self,
            scale=put_dropped(self.scale, index, scale.astype(self.scale.dtype)),
            minimum=(
                None
                if self.minimum is None
                else put_dropped(self.minimum, index, mn.astype(self.minimum.dtype))
            ),
        )

    def _local(self, pos: Array, valid: Array, origin) -> tuple[Array, Array]:
        """Positions pos (global) as this store's (its slot 0 holds position `origin`: a shard
        of the token axis, `KiviCache.seq_axis`), valid only where the store holds them."""
        local = pos - origin
        return local, valid & (local >= 0) & (local < self.capacity)

    def write(self, layer, pos: Array, x: Array, valid: Array, origin=0) -> QuantizedStore:
        """Store token x [B, Hkv, D] at positions pos [B] of `layer` where valid [B]: into its
        window slot pos % W (what left that slot was quantized by `flush`), or, with no
        window, quantized at once (where this store holds pos: `origin`, `_local`)."""
        nb = x.shape[0]
        w = self.window
        b = jnp.arange(nb)
        store = self
        if self.sinks and not w:  # quantized now (with a window: as it leaves, `flush`)
            stop = jnp.where(valid, pos + 1, pos)
            layer_sink = self._store_sinks(self.sink[layer], x[:, :, None, :], pos, stop)
            store = dataclasses.replace(self, sink=self.sink.at[layer].set(layer_sink))
        if w:
            slot = jnp.where(valid, pos % w, w)
            idx = (layer, b, WHOLE) + ((WHOLE, slot) if self.transposed else (slot,))
            res = put_dropped(self.residual, idx, x.astype(self.residual.dtype))
            return dataclasses.replace(store, residual=res)
        return store._put_tokens(layer, b, x, *self._local(pos, valid, origin))

    def flush(self, pos: Array, valid: Array, origin=0) -> QuantizedStore:
        """Quantize, in every layer, what the write of position pos [B] (`valid` [B]: rows
        that write) is about to replace in the window: per token, the token at pos - W; per
        channel, the block [pos - W, pos) when pos starts a new block. Runs once per decode
        step, before the layers' writes (`KiviCache.advance`).

        Done for all layers at once, every read of the windows comes before any write of
        them: inside the layer loop the read had no data path to the next layer's write, and
        XLA copied the [L, ...] window, scales and codes, per layer, to keep both. Codes and
        scales are written only where this store holds the positions (`origin`, `_local`).
        """
        if self.window == 0:
            return self
        if self.axis == "channel":
            store, out = self._flush_block(pos, valid, origin)
            window = self.residual  # the block's quantization only read it
        else:
            store, out = self._flush_token(pos, valid, origin)
            window = store.residual  # out of the leaving tokens' barrier
        # The window comes out of the barrier after the reads above: the layers' in-place
        # writes of the vacated slots are ordered after them. The sinks come out of it too:
        # otherwise XLA fuses their select, and with it a read of the window, into the
        # layers' consumers, after those writes (a copy of the window per step).
        residual, _, sink = jax.lax.optimization_barrier((window, out, store.sink))
        return dataclasses.replace(store, residual=residual, sink=sink)

    def _flush_token(self, pos, valid, origin):
        (nl, nb), w = self.residual.shape[:2], self.window
        b = jnp.arange(nb)
        # The leaving tokens come out of a barrier with the window, and are quantized from
        # there: otherwise XLA fuses their gather into the quantization, which then reads the
        # window itself, unordered with the layers' in-place writes, and with several rows (a
        # gather, not a slice) it copied the whole [L, ...] window twice per step to keep both.
        residual, out_x = jax.lax.optimization_barrier((self.residual, self._leaving(pos)))
        store = dataclasses.replace(self, residual=residual)
        local, ok = self._local(pos - w, valid & (pos >= w), origin)
        store = store._put_tokens(jnp.arange(nl)[:, None], b[None], out_x, local[None], ok[None])
        if self.sinks:  # position pos - W, quantized here, is sink pos - W if below N
            stop = jnp.where(valid & (pos >= w), pos - w + 1, pos - w)
            sink = self._store_sinks(self.sink, out_x[..., None, :], pos - w, stop)
            store = dataclasses.replace(store, sink=sink)
        return store, out_x

    def _leaving(self, pos: Array) -> Array:
        """The window's tokens at pos - W (slot pos % W) of every layer, [L, B, H, D]."""
        b, slot = jnp.arange(self.residual.shape[1]), pos % self.window
        if self.transposed:
            return self.residual[:, b, :, :, slot].transpose(1, 0, 2, 3)  # from [B, L, H, D]
        return self.residual[:, b, :, slot].transpose(1, 0, 2, 3)

    @staticmethod
    def flush_together(stores, pos: Array, valid: Array, origin=0) -> list[QuantizedStore]:
        """`flush` of stores that differ only in their arrays (the single-layer parts of a
        per-layer cache, `kivi_jax.MixedCache`): per token and without sinks, the leaving
        tokens of all of them are quantized in one pass and only stored part by part (a
        flush of its own is a dozen launches per store). Otherwise each store flushes alone."""
        first = stores[0]
        if first.window == 0 or first.axis != "token" or first.sinks:
            return [s.flush(pos, valid, origin) for s in stores]
        w, nb = first.window, first.residual.shape[1]
        residuals, leaving = jax.lax.optimization_barrier(
            ([s.residual for s in stores], [s._leaving(pos) for s in stores])
        )
        local, ok = first._local(pos - w, valid & (pos >= w), origin)
        at_each = lambda a: jnp.broadcast_to(a, (len(stores), nb))
        enc = first._encode_tokens(jnp.concatenate(leaving), at_each(local), at_each(ok))
        out = []
        for i, (s, r) in enumerate(zip(stores, residuals, strict=True)):
            # a runtime index: every part's writes are then the same fusions (`runtime_layer`)
            at = runtime_layer(i)
            part = [None if a is None else jax.lax.dynamic_slice_in_dim(a, at, 1) for a in enc]
            s = dataclasses.replace(s, residual=r)
            out.append(s._store_tokens(0, jnp.arange(nb)[None], *part))
        residuals, _ = jax.lax.optimization_barrier(([s.residual for s in out], leaving))
        return [dataclasses.replace(s, residual=r) for s, r in zip(out, residuals, strict=True)]

    def _flush_block(self, pos, valid, origin):
        w = self.window
        # the window holds [pos - W, pos), whole; its block is this store's if it starts here
        # (a store's positions are whole blocks: its capacity is a multiple of W)
        start, flush = self._local(pos - w, valid & (pos >= w) & (pos % w == 0), origin)

        def quantize(store):
            local = start[:, None] + jnp.arange(w)  # [B, W]
            ok = jnp.broadcast_to(flush[:, None], local.shape)
            return store._put_blocks(store.window_tokens().swapaxes(2, 3), local, ok, origin)

        # Most steps start no block: the quantization runs only when some row does.
        store = jax.lax.cond(jnp.any(flush), quantize, lambda st: st, self)
        if self.sinks:  # those in the block [pos - W, pos), from their window slots, on every
            # token shard (`flush` above is this shard's alone)
            block = valid & (pos >= w) & (pos % w == 0)
            x = jnp.take(self.window_tokens(), np.arange(self.sinks) % w, axis=3)  # [L,B,H,N,D]
            sink = self._store_sinks(self.sink, x, pos - w, jnp.where(block, pos, pos - w))
            store = dataclasses.replace(store, sink=sink)
        return store, store.codes

    def _put_tokens(self, layer, b, x, pos, valid) -> QuantizedStore:
        """Token axis: quantize tokens x [..., H, D] into positions pos where valid; layer, b,
        pos and valid broadcast to x's leading shape (one token, or one per layer)."""
        return self._store_tokens(layer, b, *self._encode_tokens(x, pos, valid))

    def _encode_tokens(self, x, pos, valid):
        """`_put_tokens`' quantization: (code rows, shifted codes [..., H, D], scale slots,
        scales and side values [..., H, D/G]) of tokens x [..., H, D] at positions pos."""
        *lead, nh, d = x.shape
        g = self.group_size
        codes, scale, aux = formats.encode(
            self.fmt, x.reshape(*lead, nh, d // g, g), self.bits, self.scale.dtype
        )
        row, shift = token_rows(pos, self.bits)
        row = jnp.where(valid, row, self.packed_len)
        vals = codes.reshape(*lead, nh, d) << shift[..., None, None]
        # per-token scales sit in the cache order too (the kernel loads a plane's as one row)
        idx = jnp.where(valid, cache_slot(pos), self.scale.shape[-1])
        per_token = lambda a: None if a is None else a.reshape(*lead, nh, -1)
        return row, vals, idx, per_token(scale), per_token(aux)

    def _store_tokens(self, layer, b, row, vals, idx, scale, aux) -> QuantizedStore:
        """`_put_tokens`' writes of `_encode_tokens`' results."""
        store = dataclasses.replace(self, codes=self._add_codes(layer, b, row, vals))
        return store._set_scales(layer, b, idx, scale, aux)

    def extend(self, x: Array, n: Array, c: Array, origin=0) -> QuantizedStore:
        """Append x [L, B, Hkv, C, D] (in the window's dtype): row b's first c[b] tokens at
        positions n[b], n[b] + 1, ..., stored exactly as streaming them one at a time through
        `flush` and `write` would (bit for bit), codes only where this store holds them
        (`origin`, `_local`). Rows must stay within capacity (`KiviCache.extend` clamps c).

        What gets quantized is [num_quantized(n), num_quantized(n + c)): the older part lies
        in the window (n - num_quantized(n) <= W), the rest in the chunk, so one span of
        W + C positions from num_quantized(n) holds it all, in order. Per channel that start is
        a multiple of W, so the span's groups are the blocks' groups, as in `_flush_block`.
        """
        nl, nb, _, nc, _ = x.shape
        w = self.window
        a, a_new = self.num_quantized(n), self.num_quantized(n + c)
        span = _round_up(w + nc, w) if self.axis == "channel" else w + nc
        pos = a[:, None] + jnp.arange(span)  # [B, N]
        xt = x.swapaxes(2, 3)  # [L, B, C, Hkv, D]
        at = lambda t, i: jnp.take_along_axis(t, i[None, :, :, None, None], axis=2)
        span_x = at(xt, jnp.clip(pos - n[:, None], 0, nc - 1))  # [L, B, N, Hkv, D]
        ring = self.window_tokens().swapaxes(2, 3) if w else None  # [L, B, W, Hkv, D]
        if w:
            span_x = jnp.where((pos < n[:, None])[None, ..., None, None], at(ring, pos % w), span_x)
        quantize = (pos >= a[:, None]) & (pos < a_new[:, None])
        local, ok = self._local(pos, quantize, origin)
        layers, b = jnp.arange(nl)[:, None, None], jnp.arange(nb)[None, :, None]
        if self.axis == "token":
            store = self._put_tokens(layers, b, span_x, local[None], ok[None])
        else:
            store = self._put_blocks(span_x, local, ok, origin)
        if self.sinks:  # sink j where this quantizes position j (a <= j < a_new), from the span
            j = jnp.arange(self.sinks)[None, :]  # [1, N]
            from_span = at(span_x, jnp.clip(j - a[:, None], 0, span - 1)).swapaxes(2, 3)
            store = dataclasses.replace(
                store, sink=self._store_sinks(store.sink, from_span, a, a_new)
            )
        if not w:
            return store
        # Window slot j: the newest position p < n + c with p % W == j; from the chunk if p >= n.
        last = (n + c - 1)[:, None]
        p = last - ((last - jnp.arange(w)) % w)  # [B, W]
        new_ring = jnp.where(
            (p >= n[:, None])[None, ..., None, None],
            at(xt, jnp.clip(p - n[:, None], 0, nc - 1)),
            ring,
        ).swapaxes(2, 3)
        return dataclasses.replace(
            store, residual=new_ring.swapaxes(-1, -2) if self.transposed else new_ring
        )

    def _put_blocks(self, x: Array, local: Array, ok: Array, origin=0) -> QuantizedStore:
        """Channel axis: quantize x [L, B, N, Hkv, D] (N a multiple of G, its first position a
        multiple of G) per group of G tokens into local positions `local` [B, N] where ok; a
        group is kept or dropped whole (ok is constant over each block of W). This store's
        slot 0 holds position `origin` (`_local`)."""
        nl, nb, n, nh, d = x.shape
        g = self.group_size
        xg = x.transpose(0, 1, 3, 2, 4).reshape(nl, nb, nh, n // g, g, d)
        pos = (local + origin).reshape(1, nb, 1, n // g, g, 1)
        xg = self._exclude_sinks(xg, pos)
        codes, scale, mn = minmax_quantize(xg, self.bits, axis=-2, scale_dtype=self.scale.dtype)
        rows, shifts = token_rows(local, self.bits)
        rows = jnp.where(ok, rows, self.packed_len)
        vals = codes.reshape(nl, nb, nh, n, d).transpose(0, 1, 3, 2, 4)  # [L, B, N, H, D]
        vals = vals << shifts[None, :, :, None, None]
        layers, b = jnp.arange(nl)[:, None, None], jnp.arange(nb)[None, :, None]
        store = dataclasses.replace(self, codes=self._add_codes(layers, b, rows[None], vals))
        groups = jnp.where(ok[:, ::g], local[:, ::g] // g, self.scale.shape[-2])  # [B, N/G]
        per_group = lambda a: a[..., 0, :].transpose(0, 1, 3, 2, 4)  # [L, B, N/G, H, D]
        store = store._set_scales(layers, b, groups[None], per_group(scale), per_group(mn))
        if not self.outliers:
            return store
        idx, vals = outlier_channels(xg, self.outliers, self.outlier.dtype)
        tokens = jnp.where(ok, local, self.capacity)[None]  # [1, B, N]
        vals = vals.reshape(nl, nb, nh, n, -1).transpose(0, 1, 3, 2, 4)  # [L, B, N, H, K]
        return dataclasses.replace(
            store,
            outlier=self.outlier.at[layers, b, :, tokens, :].set(vals, mode="drop"),
            outlier_channel=self.outlier_channel.at[layers, b, :, groups[None], :].set(
                idx.transpose(0, 1, 3, 2, 4), mode="drop"
            ),
        )

    def prefill(self, x: Array, lengths: Array, origin=None) -> QuantizedStore:
        """The canonical store for x [L, B, Hkv, S, D] with rows holding `lengths` tokens; with
        `origin`, this store holds positions [origin, origin + capacity) of them (a shard of
        the token axis, `KiviCache.seq_axis`)."""
        nl, nb, nh, s, d = x.shape
        g, w, tq = self.group_size, self.window, self.capacity
        pad = lambda a, n: jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, n), (0, 0)))
        if origin is None:  # the prompt's blocks only: the rest of the capacity stays zero
            s_pad = _round_up(s, BLOCK_TOKENS)
            xp, t = pad(x, s_pad - s), jnp.arange(s_pad)
        else:  # a start past the prompt is clamped back onto its padding: nothing kept there
            s_pad = tq
            xp = jax.lax.dynamic_slice_in_dim(pad(x, tq), origin, tq, axis=3)
            t = origin + jnp.arange(tq)
        nq = self.num_quantized(lengths)
        keep = (t[None, :] < nq[:, None])[None, :, None]  # [1, B, 1, S_pad]
        if self.axis == "channel":
            xg = self._exclude_sinks(
                xp.reshape(nl, nb, nh, s_pad // g, g, d), t.reshape(s_pad // g, g, 1)
            )
            codes, scale, mn = minmax_quantize(xg, self.bits, axis=-2, scale_dtype=self.scale.dtype)
            gkeep = keep[..., ::g, None]
            scale, mn = (jnp.where(gkeep, a[..., 0, :], 0) for a in (scale, mn))
            codes = codes.reshape(nl, nb, nh, s_pad, d)
            outlier, outlier_channel = self._prefill_outliers(xg, keep, s_pad)
        else:
            outlier = outlier_channel = None
            codes, scale, mn = formats.encode(
                self.fmt, xp.reshape(nl, nb, nh, s_pad, d // g, g), self.bits, self.scale.dtype
            )
            per_token = lambda a, empty: to_cache_order(
                jnp.where(keep[..., None], a.reshape(nl, nb, nh, s_pad, -1), empty)
                .swapaxes(-1, -2)
                .astype(a.dtype),
                -1,
            )
            scale = per_token(scale, formats.empty_scale(scale.dtype))
            mn = None if mn is None else per_token(mn, 0)
            codes = codes.reshape(nl, nb, nh, s_pad, d)
        codes = jnp.where(keep[..., None], codes, 0).astype(jnp.uint8)
        if self.transposed:
            packed = pack_tokens(codes.swapaxes(-1, -2), self.bits, axis=-1)
            if self.blocked:
                packed = block_columns(packed)
                new_codes = jnp.zeros_like(self.codes).at[..., : packed.shape[-3], :, :].set(packed)
            else:
                new_codes = jnp.zeros_like(self.codes).at[..., : packed.shape[-1]].set(packed)
        else:
            packed = pack_tokens(codes, self.bits, axis=-2)
            new_codes = jnp.zeros_like(self.codes).at[..., : packed.shape[-2], :].set(packed)
        if self.axis == "channel":
            new_scale = jnp.zeros_like(self.scale).at[..., : s_pad // g, :].set(scale)
            new_min = jnp.zeros_like(self.minimum).at[..., : s_pad // g, :].set(mn)
        else:
            empty = jnp.full_like(self.scale, formats.empty_scale(self.scale.dtype))
            new_scale = empty.at[..., :s_pad].set(scale[..., :tq])
            new_min = None
            if self.minimum is not None:
                new_min = jnp.zeros_like(self.minimum).at[..., :s_pad].set(mn[..., :tq])
        # Window slot j holds the newest position p < lengths with p % W == j (module doc of
        # the class: the window is a ring of the newest W tokens, on both axes).
        if w == 0:
            res = jnp.zeros_like(self.residual)  # a new array: never alias the input cache's
        else:
            j = jnp.arange(w)
            p = (lengths[:, None] - 1) - ((lengths[:, None] - 1 - j) % w)  # [B, W]
            ok = (p >= 0) & (p < lengths[:, None])
            pc = jnp.clip(p, 0, s - 1)
            res = jnp.take_along_axis(x, pc[None, :, None, :, None], axis=3)
            res = jnp.where(ok[None, :, None, :, None], res, 0).astype(self.residual.dtype)
            if self.transposed:
                res = res.swapaxes(-1, -2)
        sink = self.sink
        if self.sinks:  # sink j holds position j where the row has quantized it, else zeros
            first = jnp.take(x, jnp.clip(jnp.arange(self.sinks), 0, s - 1), axis=3)
            zero = jnp.zeros_like(lengths)
            sink = self._store_sinks(
                jnp.zeros_like(self.sink), first, zero, self.num_quantized(lengths)
            )
        return dataclasses.replace(
            self,
            codes=new_codes,
            scale=new_scale,
            minimum=new_min,
            residual=res,
            sink=sink,
            outlier=outlier,
            outlier_channel=outlier_channel,
        )

    def _prefill_outliers(self, xg: Array, keep: Array, s_pad: int):
        """`prefill`'s outlier channels (None without) of channel groups xg [L, B, Hkv, S/G, G,
        D] whose tokens `keep` [1, B, 1, S] are quantized, in new arrays."""
        if not self.outliers:
            return None, None
        g = self.group_size
        idx, vals = outlier_channels(xg, self.outliers, self.outlier.dtype)
        idx = jnp.where(keep[..., ::g, None], idx, 0)
        vals = jnp.where(keep[..., None], vals.reshape(*vals.shape[:3], s_pad, -1), 0)
        return (
            jnp.zeros_like(self.outlier).at[..., :s_pad, :].set(vals),
            jnp.zeros_like(self.outlier_channel).at[..., : s_pad // g, :].set(idx),
        )

    def gather(self, layer, t: Array, lengths: Array, origin=0) -> Array:
        """Full-precision float32 K or V of `layer` at positions t [B, N] -> [B, Hkv, N, D].

        Quantized positions are dequantized (slot t - origin: a shard of the token axis holds
        positions from `origin`), the sinks come from their buffers and the newest from the
        residual; positions a row (or a shard) does not hold read as garbage and must be masked
        by the caller.
        """
        nb = t.shape[0]
        b = jnp.arange(nb)[:, None]
        tq = self.capacity
        tc = jnp.clip(t - origin, 0, tq - 1)
        rows, shifts = token_rows(tc, self.bits)
        if self.blocked:
            col = stored_byte(rows, self.bits)
            packed = self.codes[layer, b, :, col // CODE_BLOCK, :, col % CODE_BLOCK]  # [B, N, H, D]
        elif self.transposed:
            packed = self.codes[layer, b, :, :, stored_byte(rows, self.bits)]  # [B, N, H, D]
        else:
            packed = to_stored_bytes(self.codes[layer, b, :, rows, :], self.bits)
        codes = (packed >> shifts[..., None, None]) & jnp.uint8((1 << self.bits) - 1)
        g = self.group_size
        if self.axis == "channel":
            sc, mn = (a[layer, b, :, tc // g, :] for a in (self.scale, self.minimum))
            deq = dequantize_codes(codes, sc, mn)
        else:  # [B, N, H, D/blk], [B, N, H, D/G * aux]
            sc, aux = (
                None if a is None else a[layer, b, :, :, cache_slot(tc)]
                for a in (self.scale, self.minimum)
            )
            deq = self._decode_tokens(codes, sc, aux)
        if self.outliers:  # [B, N, H, K] each
            idx = self.outlier_channel[layer, b, :, tc // g, :]
            deq = overlay_outliers(deq, idx, self.outlier[layer, b, :, tc, :])
        if self.sinks:
            sv = self.sink[layer, b, :, jnp.clip(t, 0, self.sinks - 1)]  # [B, N, H, D]
            deq = self._overlay_sinks(deq, sv, t[..., None, None])
        if self.window:
            if self.transposed:
                res = self.residual[layer, b, :, :, t % self.window]  # [B, N, H, D]
            else:
                res = self.residual[layer, b, :, t % self.window]
            res = res.astype(jnp.float32)
            full = t >= self.full_precision_from(lengths)[:, None]
            deq = jnp.where(full[..., None, None], res, deq)
        return deq.transpose(0, 2, 1, 3)

    def _decode_tokens(self, codes: Array, scale: Array, aux: Array) -> Array:
        """Per-token codes [..., D] with their scales [..., D/blk] and side values
        [..., D/G * aux] -> float32 [..., D] (`kivi_jax.formats.decode`)."""
        *lead, d = codes.shape
        g = self.group_size
        per_group = lambda a: None if a is None else a.reshape(*lead, d // g, -1)
        out = formats.decode(self.fmt, per_group(codes), per_group(scale), per_group(aux), g)
        return out.reshape(*lead, d)

    def _stored_order(self, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
        """A per-token store's stored order: the cache slot of each stored token column [Tq]
        and the model channel of each stored channel [D]. The middle bytes of every 4 of a
        stored row of sub-byte codes are swapped (`kivi_jax.quant.stored_byte`): token slots for
        V^T rows, channels for key rows (which stay in their blocks); 8-bit rows are in order."""
        slots, channels = np.arange(self.capacity), np.arange(head_dim)
        if self.transposed:
            return stored_byte(slots, self.bits), channels
        return slots, stored_byte(channels, self.bits)

    def token_slots(self, layer) -> tuple[Array, np.ndarray, np.ndarray]:
        """A per-token store's quantized slots of `layer` as float32 [B, Hkv, Tq, D] in the
        order they are stored, with the sinks overlaid; the position of each slot's token [Tq]
        (before the store's `origin`) and the model channel of each stored channel [D].
        Attention is the same over any order of the tokens, and q can take the channels'
        order: read as stored, dequantizing is elementwise, where the model's order is a
        gather (`dense_layer`). The order:
        tokens in the cache order (`cache_slot`), and a row in the stored byte order
        (`stored_byte`: channels for keys, token slots for V^T). NotImplementedError
        for per-channel or blocked stores."""
        if self.axis != "token" or self.blocked:
            raise NotImplementedError("token slots: per-token stores, unblocked, only")
        token_axis = -1 if self.transposed else -2
        c = unpack(self.codes[layer], self.bits, axis=token_axis, plane=CACHE_PLANE)
        if self.transposed:
            c = c.swapaxes(-1, -2)  # [B, H, Tq, D]
        slots, channels = self._stored_order(c.shape[-1])

        def per_slot(a):  # [B, H, D/blk, Tq] in the cache order -> [B, H, Tq, D/blk], as c
            return None if a is None else jnp.take(a[layer], slots, axis=-1).swapaxes(-1, -2)

        x = self._decode_tokens(c, per_slot(self.scale), per_slot(self.minimum))
        positions = cache_slot(slots)
        if self.sinks:
            sv = jnp.take(self.sink[layer], np.clip(positions, 0, self.sinks - 1), axis=2)
            x = self._overlay_sinks(x, jnp.take(sv, channels, axis=-1), positions[:, None])
        return x, positions, channels

    def fp8_slots(self, layer) -> tuple[Array, Array, np.ndarray, np.ndarray]:
        """An fp8 store's quantized slots of `layer` left as they lie: the elements as
        float8_e4m3fn in the stored orientation ([B, Hkv, Tq, D]; V^T rows [B, Hkv, D, Tq]),
        their block scales as float32 [B, Hkv, D/G, Tq] per stored slot, and the positions and
        channels of `token_slots`. An element's value is its block's scale times the element,
        so a product can read the elements where they lie (XLA converts them inside the GEMM)
        and scale its per-block results; a dequantized copy would be written and read again.
        NotImplementedError for other formats and for stores with sinks (`token_slots`
        overlays those)."""
        if self.fmt != "fp8" or self.sinks or self.blocked:
            raise NotImplementedError("fp8 slots: unblocked fp8 stores without sinks")
        elements = jax.lax.bitcast_convert_type(self.codes[layer], jnp.float8_e4m3fn)
        slots, channels = self._stored_order(elements.shape[-2 if self.transposed else -1])
        # 8-bit rows are stored unswapped (`stored_byte`): V^T's column i is slot i, as the
        # scales are held, and the key channels are in order
        scale = self.scale[layer].astype(jnp.float32)
        return elements, scale, cache_slot(slots), channels

    def dense_layer(self, layer, lengths: Array, dtype, origin=0) -> Array:
        """Every position of `layer` as [B, Tq, Hkv, D] in `dtype`: dequantized, and for rows
        holding `lengths` tokens their newest W from the window (what `gather` reads, in one
        pass over the layer's codes, which XLA fuses). Slot i holds position origin + i (a
        shard of the token axis, `KiviCache.seq_axis`). Positions a row does not hold are
        unspecified."""
        codes = self.codes[layer]
        if self.blocked:
            codes = unblock_columns(codes)
        c = unpack_tokens(codes, self.bits, axis=-1 if self.transposed else -2)
        if self.transposed:
            c = c.swapaxes(-1, -2)  # [B, H, Tq, D]
        g = self.group_size
        t = origin + jnp.arange(self.capacity)
        if self.axis == "channel":  # [B, H, Tq/G, D]
            per_token = lambda a: jnp.repeat(a[layer], g, axis=-2)
            x = dequantize_codes(c, per_token(self.scale), per_token(self.minimum))
        else:  # [B, H, D/blk, Tq] in the cache order -> [B, H, Tq, D/blk]
            token_order = lambda a: (
                None if a is None else to_cache_order(a[layer], -1).swapaxes(-1, -2)
            )
            x = self._decode_tokens(c, token_order(self.scale), token_order(self.minimum))
        if self.outliers:  # [B, H, Tq, K] each
            idx = jnp.repeat(self.outlier_channel[layer], g, axis=-2)
            x = overlay_outliers(x, idx, self.outlier[layer])
        if self.sinks:
            sv = jnp.take(self.sink[layer], jnp.clip(t, 0, self.sinks - 1), axis=2)
            x = self._overlay_sinks(x, sv, t[:, None])
        if self.window:
            ring = jnp.take(self.layer_window(layer).astype(jnp.float32), t % self.window, axis=2)
            full = t[None, :] >= self.full_precision_from(lengths)[:, None]  # [B, Tq]
            x = jnp.where(full[:, None, :, None], ring, x)
        return x.astype(dtype).swapaxes(1, 2)

    def nbytes(self) -> CacheBytes:
        return CacheBytes(
            codes=self.codes.nbytes,
            scales=sum(
                0 if a is None else a.nbytes
                for a in (self.scale, self.minimum, self.outlier, self.outlier_channel)
            ),
            residual=self.residual.nbytes + (0 if self.sink is None else self.sink.nbytes),
            metadata=0,
        )


# ---------------------------------------------------------------------------------------------
# Shared decode-protocol logic of both caches.


class _CacheOps:
    lengths: Array
    max_len: int

    @property
    def overflowed(self) -> Array:
        """[B] bool: rows that were asked to hold more than max_len tokens, or were prefilled
        under jit with lengths outside [0, S] (module doc)."""
        return self.lengths > self.max_len

    def advance(self):
        """Start a decode step: every row's length grows by one."""
        new = self.lengths + 1
        if _is_concrete(new):
            if bool(jnp.any(new > self.max_len)):
                raise ValueError(
                    f"cache is full: a row would hold {int(jnp.max(new))} tokens, "
                    f"max_len={self.max_len}"
                )
        else:
            checkify.debug_check(
                jnp.all(new <= self.max_len), "KV cache overflow: a row exceeded max_len"
            )
        return dataclasses.replace(self, lengths=new)

    def _write_position(self):
        pos = self.lengths - 1
        return pos, (pos >= 0) & (pos < self.max_len)

    def append(self, k: Array, v: Array):
        """advance() then write() the token k, v [L, B, Hkv, D] into every layer."""
        nl = self.num_layers
        _check_dims("k", k, (nl, self.batch, self.kv_heads, self.head_dim))
        _check_dims("v", v, (nl, self.batch, self.kv_heads, self.head_dim))
        cache = self.advance()
        return jax.lax.fori_loop(0, nl, lambda l, c: c.write(l, k[l], v[l]), cache)

    def extend(self, k: Array, v: Array, counts: Array):
        """Append chunks k, v [L, B, Hkv, C, D] to every layer: row b takes its first
        counts[b] tokens at positions lengths[b], lengths[b] + 1, ... (chunked prefill).

        The result equals appending those tokens one at a time (`append`), bit for bit, and
        costs one pass over the chunk. Capacity policy as `advance`'s (module doc): outside
        jit a row going past max_len raises ValueError; under jit its tokens past capacity
        are dropped and the row is marked `overflowed`. Counts outside [0, C] raise when
        concrete and are clamped (the row marked) when traced, as prefill's lengths are.
        """
        c, recorded = self._extend_counts(k, v, counts)
        return self._extend_jit(k, v, c, recorded)

    def _extend_counts(self, k, v, counts) -> tuple[Array, Array]:
        """Check extend's arguments -> (int32 tokens to store per row, lengths to record)."""
        want = (self.num_layers, self.batch, self.kv_heads, None, self.head_dim)
        _check_dims("k", k, want)
        _check_dims("v", v, want)
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
        _check_dims("counts", counts, (self.batch,), dtype_kind="integer")
        nc = k.shape[3]
        counts = counts.astype(jnp.int32)
        new = self.lengths + counts
        if _is_concrete(counts) and _is_concrete(self.lengths):
            if bool(jnp.any((counts < 0) | (counts > nc))):
                raise ValueError(f"counts must lie in [0, C={nc}], got {np.asarray(counts)}")
            if bool(jnp.any(new > self.max_len)):
                raise ValueError(
                    f"cache is full: a row would hold {int(jnp.max(new))} tokens, "
                    f"max_len={self.max_len}"
                )
            return counts, new
        ok = (counts >= 0) & (counts <= nc) & (new <= self.max_len)
        checkify.debug_check(jnp.all(ok), "extend: counts outside [0, C] or past max_len")
        stored = jnp.clip(jnp.clip(counts, 0, nc), 0, jnp.maximum(self.max_len - self.lengths, 0))
        return stored, jnp.where(ok, self.lengths + stored, self.max_len + 1)

    def _prefill_lengths(self, k, v, lengths) -> tuple[Array, Array]:
        """Check prefill's arguments -> (int32 lengths to store, int32 lengths to record).

        S <= max_len is checked on shapes, so a valid length, in [0, S], fits the cache.
        Concrete lengths outside [0, S] raise ValueError; traced ones are clamped for storing
        and their rows recorded as holding max_len + 1 tokens (`overflowed`, module doc).
        """
        self._check_prefill(k, v, lengths)
        lengths = lengths.astype(jnp.int32)
        if _is_concrete(lengths):
            return lengths, lengths
        s = k.shape[3]
        ok = (lengths >= 0) & (lengths <= s)
        checkify.debug_check(
            jnp.all(ok), f"prefill: lengths {{lengths}} outside [0, S={s}]", lengths=lengths
        )
        stored = jnp.clip(lengths, 0, s)
        return stored, jnp.where(ok, stored, self.max_len + 1)

    def _check_prefill(self, k, v, lengths):
        want = (self.num_layers, self.batch, self.kv_heads, None, self.head_dim)
        _check_dims("k", k, want)
        _check_dims("v", v, want)
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
        s = k.shape[3]
        if s > self.max_len:
            raise ValueError(f"prompt length S={s} exceeds the cache's max_len={self.max_len}")
        _check_dims("lengths", lengths, (self.batch,), dtype_kind="integer")
        if _is_concrete(lengths):  # in numpy: under a jit, jnp on a closed-over constant traces
            n = np.asarray(lengths)
            if np.any((n < 0) | (n > s)):
                raise ValueError(f"lengths must lie in [0, S={s}], got {n}")

    def _check_token(self, layer, k, v):
        """Check write's arguments -> (layer index, write position [B], valid [B]); a traced
        layer out of range makes no row valid: the write is dropped in every layer (clamped,
        it would land in the last layer)."""
        _check_dims("k", k, (self.batch, self.kv_heads, self.head_dim))
        _check_dims("v", v, (self.batch, self.kv_heads, self.head_dim))
        layer, in_range = check_layer(layer, self.num_layers)
        pos, valid = self._write_position()
        if in_range is not None:
            valid = valid & in_range
        return layer, pos, valid


def _key_rope(config: KiviConfig, head_dim: int, rope_frequencies) -> Array | None:
    """`KiviCache.key_rope`: the RoPE frequencies [D/2] of a pre-RoPE cache, float32."""
    if not config.pre_rope:
        return None
    if rope_frequencies is None:
        raise ValueError("pre_rope=True needs the model's rope_frequencies [head_dim / 2]")
    inv = np.asarray(rope_frequencies, np.float64)
    if inv.shape != (head_dim // 2,) or not np.isfinite(inv).all():
        raise ValueError(
            f"rope_frequencies must be finite, shaped [head_dim / 2] = [{head_dim // 2}], got "
            f"shape {inv.shape}"
        )
    return jnp.asarray(inv, jnp.float32)


def _check_init(num_layers, batch, kv_heads, head_dim, max_len, dtype) -> None:
    dims = dict(
        num_layers=num_layers, batch=batch, kv_heads=kv_heads, head_dim=head_dim, max_len=max_len
    )
    for name, val in dims.items():
        if not isinstance(val, int | np.integer) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")


def check_capacity(cache) -> None:
    """Raise ValueError on the host if any row of `cache` overflowed its capacity (or was
    prefilled under jit with lengths outside [0, S])."""
    over = np.asarray(cache.overflowed)
    if over.any():
        raise ValueError(
            f"KV cache overflow in rows {np.nonzero(over)[0].tolist()} "
            f"(max_len={cache.max_len}); tokens past capacity were dropped, or a prefill "
            "under jit got lengths outside [0, S]"
        )


# ---------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KiviCache(_CacheOps):
    """KIVI-quantized KV cache of all layers (layout: docs/layout.md)."""

    keys: QuantizedStore  # codes [L, B, Hkv, Tq/Pk, D]; scale/min [L, B, Hkv, Tq/G, D]
    # codes [L, B, Hkv, D, Tq/Pv] (2-bit: blocked [L, B, Hkv, Tq/256, D, 64]); scale/min
    values: QuantizedStore  # [L, B, Hkv, D/G, Tq]
    lengths: Array  # [B] int32: tokens held per row
    config: KiviConfig = dataclasses.field(metadata=static)
    max_len: int = dataclasses.field(metadata=static)
    # Inside `jax.shard_map` over a mesh axis that splits the token axes: its name, so that the
    # stores hold positions [shard * capacity, (shard + 1) * capacity) and write only those
    # (`kivi_jax.parallel`); None everywhere else.
    seq_axis: str | None = dataclasses.field(default=None, metadata=static)
    # [D/2] float32: the inverse frequencies of the keys' RoPE (`KiviConfig.pre_rope`), or None
    key_rope: Array | None = None

    def _origin(self):
        """The position of this store's first quantized slot (0 unless sharded, `seq_axis`)."""
        if self.seq_axis is None:
            return 0
        return jax.lax.axis_index(self.seq_axis) * self.keys.capacity

    @staticmethod
    def init(
        config: KiviConfig,
        *,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype=jnp.bfloat16,
        rope_frequencies=None,
    ) -> KiviCache:
        """An empty cache for `max_len` tokens per row; residual windows in `dtype`.
        rope_frequencies [D/2]: the inverse frequencies of the model's RoPE (half-split layout,
        `kivi_jax.rotation.rope`), which a cache of pre-RoPE keys (`KiviConfig.pre_rope`)
        needs; other caches do not keep them."""
        if not isinstance(config, KiviConfig):
            raise ValueError(f"config must be a KiviConfig, got {type(config).__name__}")
        _check_init(num_layers, batch, kv_heads, head_dim, max_len, dtype)
        config.check_head_dim(head_dim)
        key_rope = _key_rope(config, head_dim, rope_frequencies)
        g, r = config.group_size, config.residual_length
        cap = _round_up(max_len, max(BLOCK_TOKENS, g))
        common = dict(
            num_layers=num_layers,
            batch=batch,
            kv_heads=kv_heads,
            head_dim=head_dim,
            capacity=cap,
            dtype=dtype,
            scale_dtype=config.scale_jnp_dtype,
        )

        def store(side: str, transposed: bool) -> QuantizedStore:
            axis = getattr(config, f"{side}_axis")
            return QuantizedStore.init(
                getattr(config, f"{side}_bits"),
                g,
                axis,
                transposed,
                window=max(r, g) if axis == "channel" else r,
                fmt=getattr(config, f"{side}_format"),
                sinks=config.sinks,
                outliers=config.outlier_channels if side == "key" else 0,
                **common,
            )

        keys, values = store("key", False), store("value", True)
        lengths = jnp.zeros((batch,), jnp.int32)
        return KiviCache(keys, values, lengths, config, int(max_len), key_rope=key_rope)

    num_layers = property(lambda self: self.keys.residual.shape[0])
    batch = property(lambda self: self.keys.residual.shape[1])
    kv_heads = property(lambda self: self.keys.residual.shape[2])
    head_dim = property(lambda self: self.keys.residual.shape[4])
    dtype = property(lambda self: self.keys.residual.dtype)

    def prefill(self, k: Array, v: Array, lengths: Array) -> KiviCache:
        """Replace the contents with prompts k, v [L, B, Hkv, S, D] of `lengths` [B] tokens.

        Quantizes every full group at once and leaves the rest in the residual, exactly as
        streaming the same tokens through `append` would (bit for bit).
        """
        return _kivi_prefill(self, k, v, *self._prefill_lengths(k, v, lengths))

    def _rotated(self, k: Array, v: Array, positions: Array) -> tuple[Array, Array]:
        """k, v [..., D] at `positions` (broadcasting to k.shape[:-1]) as the stores hold them:
        pre-RoPE keys (`KiviConfig.pre_rope`) and rotated (`KiviConfig.rotation`), in their
        dtypes."""
        if self.config.pre_rope:
            k = rotation.rope(k, -positions, self.key_rope)
        if self.config.rotates_keys:
            k = rotation.rotate(k).astype(k.dtype)
        return k, self.rotate_values(v)

    def read_keys(self, k: Array, positions: Array, *, by_matrix: bool = False) -> Array:
        """Keys k [..., D] at `positions` (broadcasting to k.shape[:-1]) as read from the
        stores (`QuantizedStore.gather`, `dense_layer`) -> the keys attention compares
        `rotate_query(q)` with: as stored, except that pre-RoPE keys are rotated back into
        the model's basis and RoPE is applied again, in float32. `by_matrix`: rotated back by
        the matrix (`rotation.unrotate_rows`, one fused product; equal up to float32 rounding)
        instead of the transform's stages, for the few keys a decode step reads beside a
        kernel."""
        if not self.config.pre_rope:
            return k
        if self.config.rotates_keys:
            k = rotation.unrotate_rows(k) if by_matrix else rotation.unrotate(k)
        return rotation.rope(k.astype(jnp.float32), positions, self.key_rope)

    def _prefill(self, k: Array, v: Array, lengths: Array, recorded: Array) -> KiviCache:
        origin = None if self.seq_axis is None else self._origin()
        k, v = self._rotated(k, v, jnp.arange(k.shape[3]))
        return dataclasses.replace(
            self,
            keys=self.keys.prefill(k, lengths, origin),
            values=self.values.prefill(v, lengths, origin),
            lengths=recorded,
        )

    def _extend(self, k: Array, v: Array, counts: Array, recorded: Array) -> KiviCache:
        n, o = self.lengths, self._origin()
        positions = n[:, None] + jnp.arange(k.shape[3])  # [B, C]
        k, v = self._rotated(k, v, positions[:, None])
        cast = lambda x: x.astype(self.dtype)
        return dataclasses.replace(
            self,
            keys=self.keys.extend(cast(k), n, counts, o),
            values=self.values.extend(cast(v), n, counts, o),
            lengths=recorded,
        )

    def advance(self) -> KiviCache:
        """Start a decode step: every row's length grows by one, and in every layer what the
        new token's slot held is quantized (`QuantizedStore.flush`): `write` then fills it."""
        c = super().advance()
        pos, valid = c._write_position()
        o = c._origin()
        return dataclasses.replace(
            c, keys=c.keys.flush(pos, valid, o), values=c.values.flush(pos, valid, o)
        )

    @staticmethod
    def advance_together(caches) -> list[KiviCache]:
        """`advance` of caches of one config and shape holding the same lengths (the
        single-layer parts of a per-layer cache, `kivi_jax.MixedCache`): their stores flush
        together (`QuantizedStore.flush_together`)."""
        moved = [super(KiviCache, c).advance() for c in caches]
        pos, valid = moved[0]._write_position()
        o = moved[0]._origin()
        keys = QuantizedStore.flush_together([c.keys for c in moved], pos, valid, o)
        values = QuantizedStore.flush_together([c.values for c in moved], pos, valid, o)
        return [
            dataclasses.replace(c, keys=k, values=v)
            for c, k, v in zip(moved, keys, values, strict=True)
        ]

    def write(self, layer, k: Array, v: Array) -> KiviCache:
        """Store the new token k, v [B, Hkv, D] at position lengths - 1 of `layer` (after
        `advance`, which starts the step for all layers)."""
        layer, pos, valid = self._check_token(layer, k, v)
        layer, o = runtime_layer(layer), self._origin()
        k, v = self._rotated(k, v, pos[:, None])
        return dataclasses.replace(
            self,
            keys=self.keys.write(layer, pos, k, valid, o),
            values=self.values.write(layer, pos, v, valid, o),
        )

    def nbytes(self) -> CacheBytes:
        kb, vb = self.keys.nbytes(), self.values.nbytes()
        return CacheBytes(
            kb.codes + vb.codes,
            kb.scales + vb.scales,
            kb.residual + vb.residual,
            self.lengths.nbytes,
        )

    def logical_axes(self) -> KiviCache:
        """The same pytree with a PartitionSpec of logical axis names in place of each array."""
        return dataclasses.replace(
            self,
            keys=self.keys.logical_axes(),
            values=self.values.logical_axes(),
            lengths=jax.P("batch"),
            key_rope=None if self.key_rope is None else jax.P(None),
        )

    def layer_kv(self, layer, dtype=None) -> tuple[Array, Array]:
        """K and V of `layer`, [B, Tq, Hkv, D] each in `dtype` (default the windows'), as
        `DenseCache.layer_kv` gives them: dequantized, the newest positions from the windows
        (`QuantizedStore.dense_layer`); on a token shard (`seq_axis`) the shard's positions.
        Chunked prefill reads the past this way. With a rotation (`KiviConfig.rotation`) they
        are as stored, rotated: attend with `rotate_query` and `unrotate_output`; pre-RoPE keys
        come back post-RoPE, in the model's basis (`read_keys`)."""
        n = jnp.minimum(self.lengths, self.max_len)
        dtype = self.dtype if dtype is None else dtype
        o = self._origin()
        k = self.keys.dense_layer(layer, n, jnp.float32 if self.config.pre_rope else dtype, o)
        positions = o + jnp.arange(self.keys.capacity)[:, None]  # [Tq, 1] against [B, Tq, H]
        return (
            self.read_keys(k, positions).astype(dtype),
            self.values.dense_layer(layer, n, dtype, o),
        )

    def rotate_query(self, q: Array) -> Array:
        """q [..., D] in the basis of the keys as read (`read_keys`: rotated when the keys are
        and RoPE is not between, i.e. not for pre-RoPE keys), q.dtype (`rotation.rotate_rows`)."""
        if self.config.rotates_keys and not self.config.pre_rope:
            return rotation.rotate_rows(q).astype(q.dtype)
        return q

    def rotate_keys(self, k: Array) -> Array:
        """New keys k [..., D] (a chunk's own) in the basis `rotate_query` puts q in, rotated as
        the stores rotate them (`rotation.rotate`), k.dtype."""
        if self.config.rotates_keys and not self.config.pre_rope:
            return rotation.rotate(k).astype(k.dtype)
        return k

    def rotate_values(self, v: Array) -> Array:
        """v [..., D] in the basis of the stored values (rotated when they are), v.dtype."""
        return rotation.rotate(v).astype(v.dtype) if self.config.rotates_values else v

    def unrotate_output(self, o: Array) -> Array:
        """An attention output [..., D] over the stored values back in the model's basis."""
        return rotation.unrotate_rows(o).astype(o.dtype) if self.config.rotates_values else o

    def local_lengths(self) -> Array:
        """[B]: how many of each row's positions this store holds from its first slot (all of
        them, capped at max_len, unless it is a token shard, `seq_axis`)."""
        n = jnp.minimum(self.lengths, self.max_len)
        return jnp.clip(n - self._origin(), 0, self.keys.capacity)

    def quantized_split(self) -> Array:
        """[B] int32: positions [0, m) read K and V from the codes (the kernel's region); the
        tail [m, lengths) lies in the newest `tail_window` positions."""
        n = jnp.minimum(self.lengths, self.max_len)
        return jnp.minimum(self.keys.full_precision_from(n), self.values.full_precision_from(n))

    @property
    def tail_window(self) -> int:
        """Positions [m, lengths) of a row always lie in its last `tail_window` positions."""
        return max(self.keys.window, self.values.window)

    @property
    def windows_aligned(self) -> bool:
        """Keys and values keep windows of the same size W > 0 (R >= G): the tail is then the
        two windows themselves, slot for slot (slots [0, min(n, W)) hold a row's newest
        tokens), read without gathering."""
        return self.keys.window == self.values.window > 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseCache(_CacheOps):
    """Full-precision KV cache behind the same interface: the baseline for every comparison.

    Tokens before heads, the layout cuDNN's attention reads: with layers held as [B, Hkv, T, D],
    XLA met cuDNN's layout by carrying the whole cache transposed through the decode loop (a
    copy of it on entry and on exit). `k` and `v` give the [L, B, Hkv, T, D] view of the
    other caches (a copy: for inspection, never the decode path).

    Stacked ([L, ...] arrays) or per layer (tuples of L arrays, `init(per_layer=True)`): a
    layer of a stacked array is a slice, which XLA copies before a custom call (cuDNN) reads
    it, every layer of every step; a per-layer buffer is read where it lies. Per layer, the
    layer index must be concrete (a Python int: an unrolled loop over layers); stacked, it may
    be traced (a scan over layers).
    """

    k_seq: Array | tuple[Array, ...]  # [L, B, T, Hkv, D], or per layer L x [B, T, Hkv, D]
    v_seq: Array | tuple[Array, ...]  # same as k_seq
    lengths: Array  # [B] int32
    max_len: int = dataclasses.field(metadata=static)

    @staticmethod
    def init(
        *,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype=jnp.bfloat16,
        per_layer: bool = False,
    ) -> DenseCache:
        _check_init(num_layers, batch, kv_heads, head_dim, max_len, dtype)
        shape = (batch, max_len, kv_heads, head_dim)
        if per_layer:
            make = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        else:
            make = lambda: jnp.zeros((num_layers, *shape), dtype)
        return DenseCache(make(), make(), jnp.zeros((batch,), jnp.int32), int(max_len))

    per_layer = property(lambda self: isinstance(self.k_seq, tuple | list))
    num_layers = property(lambda self: len(self.k_seq) if self.per_layer else self.k_seq.shape[0])
    _layer_shape = property(
        lambda self: self.k_seq[0].shape if self.per_layer else self.k_seq.shape[1:]
    )
    batch = property(lambda self: self._layer_shape[0])
    kv_heads = property(lambda self: self._layer_shape[2])
    head_dim = property(lambda self: self._layer_shape[3])
    dtype = property(lambda self: jax.tree.leaves(self.k_seq)[0].dtype)
    k = property(lambda self: self._stacked(self.k_seq).swapaxes(2, 3))  # [L, B, Hkv, T, D]
    v = property(lambda self: self._stacked(self.v_seq).swapaxes(2, 3))  # [L, B, Hkv, T, D]

    def _stacked(self, x):
        return jnp.stack(x) if self.per_layer else x

    def layer_kv(self, layer) -> tuple[Array, Array]:
        """K and V of one layer, [B, T, Hkv, D] each (`layer` already checked, `check_layer`)."""
        if not self.per_layer:
            return self.k_seq[layer], self.v_seq[layer]
        i = self._static_layer(layer)
        return self.k_seq[i], self.v_seq[i]

    def _static_layer(self, layer) -> int:
        if not _is_concrete(layer):
            raise ValueError(
                "a per-layer DenseCache needs a concrete layer index (an unrolled loop over "
                "layers), got a traced one; use a stacked cache (per_layer=False) under a scan"
            )
        return int(layer)

    def prefill(self, k: Array, v: Array, lengths: Array) -> DenseCache:
        """Replace the contents with prompts k, v [L, B, Hkv, S, D] of `lengths` [B] tokens."""
        return _dense_prefill(self, k, v, *self._prefill_lengths(k, v, lengths))

    def _prefill(self, k: Array, v: Array, lengths: Array, recorded: Array) -> DenseCache:
        s = k.shape[3]
        keep = (jnp.arange(s)[None, :] < lengths[:, None])[None, :, None, :, None]

        def put(buf, x):  # x [L, B, Hkv, S, D] -> buf's layout, zero past each row's length
            x = jnp.where(keep, x, 0).swapaxes(2, 3)
            if self.per_layer:
                return tuple(
                    jnp.zeros_like(b).at[:, :s].set(x[i].astype(b.dtype)) for i, b in enumerate(buf)
                )
            return jnp.zeros_like(buf).at[:, :, :s].set(x.astype(buf.dtype))

        return dataclasses.replace(
            self, k_seq=put(self.k_seq, k), v_seq=put(self.v_seq, v), lengths=recorded
        )

    def _extend(self, k: Array, v: Array, counts: Array, recorded: Array) -> DenseCache:
        nc = k.shape[3]
        b = jnp.arange(self.batch)[:, None]
        i = jnp.arange(nc)[None, :]
        pos = jnp.where(i < counts[:, None], self.lengths[:, None] + i, self.max_len)  # [B, C]

        def put(buf, x):  # x [L, B, Hkv, C, D] -> buf's [.., B, T, Hkv, D] at pos (drop the rest)
            x = x.swapaxes(2, 3)
            if self.per_layer:
                return tuple(
                    a.at[b, pos].set(x[j].astype(a.dtype), mode="drop") for j, a in enumerate(buf)
                )
            return buf.at[:, b, pos].set(x.astype(buf.dtype), mode="drop")

        return dataclasses.replace(
            self, k_seq=put(self.k_seq, k), v_seq=put(self.v_seq, v), lengths=recorded
        )

    def write(self, layer, k: Array, v: Array) -> DenseCache:
        layer, pos, valid = self._check_token(layer, k, v)
        b = jnp.arange(self.batch)
        pos = jnp.where(valid, pos, self.max_len)
        if self.per_layer:
            i = self._static_layer(layer)
            put = lambda bufs, x: tuple(
                put_dropped(buf, (b, pos), x.astype(buf.dtype)) if j == i else buf
                for j, buf in enumerate(bufs)
            )
        else:
            put = lambda buf, x: put_dropped(buf, (layer, b, pos), x.astype(buf.dtype))
        return dataclasses.replace(self, k_seq=put(self.k_seq, k), v_seq=put(self.v_seq, v))

    def nbytes(self) -> CacheBytes:
        size = lambda x: sum(a.nbytes for a in jax.tree.leaves(x))
        return CacheBytes(0, 0, size(self.k_seq) + size(self.v_seq), self.lengths.nbytes)

    def logical_axes(self) -> DenseCache:
        if self.per_layer:
            layer = jax.P("batch", "cache_seq", "kv_heads", "head_dim")
            spec = (layer,) * self.num_layers
        else:
            spec = jax.P("layers", "batch", "cache_seq", "kv_heads", "head_dim")
        return dataclasses.replace(self, k_seq=spec, v_seq=spec, lengths=jax.P("batch"))


# Jitted once per shape so that eager callers (notebooks, tests) do not dispatch op by op.
_kivi_prefill = jax.jit(KiviCache._prefill)
_dense_prefill = jax.jit(DenseCache._prefill)
KiviCache._extend_jit = jax.jit(KiviCache._extend)
DenseCache._extend_jit = jax.jit(DenseCache._extend)


# ---------------------------------------------------------------------------------------------
# Named cache configurations, shared by the CLI, evaluation and benchmarks.

_NAMED = {
    "kivi2": dict(key_bits=2, value_bits=2),
    "kivi4": dict(key_bits=4, value_bits=4),
    "kivi8": dict(key_bits=8, value_bits=8),
    "k4v2": dict(key_bits=4, value_bits=2),
    "k2v4": dict(key_bits=2, value_bits=4),
    # Ablations (KIVI paper, Table 1): the naive per-token keys, and values on the wrong axis.
    "pertoken2": dict(key_bits=2, value_bits=2, key_axis="token"),
    "pertoken4": dict(key_bits=4, value_bits=4, key_axis="token"),
    "valchannel2": dict(key_bits=2, value_bits=2, value_axis="channel"),
    "valchannel4": dict(key_bits=4, value_bits=4, value_axis="channel"),
    # Hardware float formats, per token on both sides (`kivi_jax.formats`); G sets the span of
    # a scale (fp8) or of the FP32 second-level scale (nvfp4); mxfp4's blocks are always 32.
    "fp8": dict(key_bits=8, value_bits=8, key_format="fp8", value_format="fp8", key_axis="token"),
    "nvfp4": dict(
        key_bits=4, value_bits=4, key_format="nvfp4", value_format="nvfp4", key_axis="token"
    ),
    "mxfp4": dict(
        key_bits=4, value_bits=4, key_format="mxfp4", value_format="mxfp4", key_axis="token"
    ),
    # The most accurate configurations measured at <= 3.0 and <= 2.5 bits per element
    # (docs/formats.md, SmolLM2-135M streaming perplexity): KIVI-2 with 8 sinks, keys and
    # values rotated and the keys quantized before RoPE (which the kernel does not read:
    # without it the same knobs lose more and take the kernel). Each fixes its group size,
    # which sets its bits.
    "best3": dict(key_bits=2, value_bits=2, group_size=32, sinks=8, rotation="both", pre_rope=True),
    "best25": dict(
        key_bits=2, value_bits=2, group_size=64, sinks=8, rotation="both", pre_rope=True
    ),
}
DEFAULT_GROUP_SIZE = 32
DENSE_NAMES = ("fp16",)
CACHE_NAMES = DENSE_NAMES + tuple(_NAMED)


def read_by_gemms(config: KiviConfig) -> bool:
    """Whether XLA's attention path reads stores of `config` as they lie, through GEMMs: fp8
    keys and values without sinks (`QuantizedStore.fp8_slots`; the other formats are
    dequantized by a fusion, which reads a layer's slice in place)."""
    return config.key_format == config.value_format == "fp8" and not config.sinks


def cache_config(
    name: str,
    group_size: int | None = None,
    residual_length: int = 128,
    *,
    sinks: int = 0,
    rotation: str = "none",
    outlier_channels: int = 0,
    pre_rope: bool = False,
) -> KiviConfig | None:
    """The KiviConfig of a named cache ("kivi2", ...), or None for the dense "fp16" cache.

    group_size: None for the name's own (best3: 32, best25: 64), else DEFAULT_GROUP_SIZE; a name
    that fixes it takes only the same value. `sinks`, `rotation`, `outlier_channels`, `pre_rope`
    (`KiviConfig`) apply to every quantized name (a name that sets its own takes only the same
    value); the dense cache takes none. Raises ValueError for an unknown name or a conflicting
    knob."""
    knobs = (
        ("group_size", group_size, None),
        ("sinks", sinks, 0),
        ("rotation", rotation, "none"),
        ("outlier_channels", outlier_channels, 0),
        ("pre_rope", pre_rope, False),
    )
    if name in DENSE_NAMES:
        if any(value != unset for key, value, unset in knobs[1:]):
            raise ValueError(
                f"the dense {name!r} cache takes no sinks, rotation, outlier channels or pre_rope"
            )
        return None
    if name not in _NAMED:
        raise ValueError(f"unknown cache name {name!r}; choose one of {', '.join(CACHE_NAMES)}")
    fields = dict(_NAMED[name])
    fields.setdefault("group_size", DEFAULT_GROUP_SIZE)
    for key, value, unset in knobs:
        if value == unset:
            continue
        if key in _NAMED[name] and _NAMED[name][key] != value:
            raise ValueError(
                f"cache {name!r} is defined with {key}={_NAMED[name][key]!r}; got {value!r}"
            )
        fields[key] = value
    return KiviConfig(residual_length=residual_length, **fields)


def make_cache(
    name: str,
    *,
    num_layers: int,
    batch: int,
    kv_heads: int,
    head_dim: int,
    max_len: int,
    dtype=jnp.bfloat16,
    group_size: int | None = None,
    residual_length: int = 128,
    per_layer: bool = False,
    sinks: int = 0,
    rotation: str = "none",
    outlier_channels: int = 0,
    pre_rope: bool = False,
    rope_frequencies=None,
    layer_overrides=(),
) -> KiviCache | DenseCache | MixedCache:
    """An empty cache by name: "fp16" is the dense cache in `dtype` (`per_layer`: one buffer per
    layer, DenseCache's docstring), the others KIVI variants with `group_size`, `sinks`,
    `rotation`, `outlier_channels` and `pre_rope` as `cache_config` takes them;
    `rope_frequencies` as `KiviCache.init` takes them (the model's: what pre_rope needs).
    layer_overrides: (layers, KiviConfig fields) pairs (`kivi_jax.mixed.layer_configs`)
    changing the named config in those layers: a `kivi_jax.MixedCache` (KIVI names only).
    per_layer, for a quantized cache: where a layer's config is one that XLA reads through
    GEMMs over its stored elements (`read_by_gemms`), a MixedCache of one part per layer, so
    that the GEMMs read each layer's stores in place instead of a copy of their slice (the
    layer index must then be concrete to avoid a switch over the layers, as in an unrolled
    layer loop); otherwise stacked stores, which the kernel reads in place at any index."""
    config = cache_config(
        name,
        group_size,
        residual_length,
        sinks=sinks,
        rotation=rotation,
        outlier_channels=outlier_channels,
        pre_rope=pre_rope,
    )
    dims = dict(
        num_layers=num_layers,
        batch=batch,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_len=max_len,
        dtype=dtype,
    )
    if config is None:
        if layer_overrides:
            raise ValueError(f"the dense {name!r} cache takes no layer overrides")
        return DenseCache.init(**dims, per_layer=per_layer)
    from kivi_jax.mixed import MixedCache, layer_configs

    configs = layer_configs(config, num_layers, layer_overrides)
    split = per_layer and any(map(read_by_gemms, configs))
    if not (layer_overrides or split):
        return KiviCache.init(config, **dims, rope_frequencies=rope_frequencies)
    del dims["num_layers"]
    return MixedCache.init(configs, **dims, rope_frequencies=rope_frequencies, per_layer=split)
