"""Decode attention of one new query per row over a KV cache.

implementation:
  "reference"  dequantize every held position, then plain softmax attention (float32).
  "folded"     the kernel's algebra in jnp: on the quantized region the key scale is folded into
               q per token group and the value scale into p per token, minimums become biases;
               the residual tail is attended separately and the two merged by log-sum-exp.
               Agrees with "reference" to float32 rounding.
  "pallas"     the fused Mosaic GPU kernels (Hopper): KIVI's integer caches
               (`pallas_kernels.kivi_decode`), fp8 caches without sinks, post-RoPE
               (`pallas_kernels.fp8_decode`), integer caches of keys before RoPE
               (`pallas_kernels.prerope_decode`); raises NotImplementedError where they do not
               apply. `interpret=True` runs them under the GPU interpreter on any backend.
  "xla"        dense caches: XLA attention reading K/V in the cache dtype with float32
               accumulation (multiply-and-reduce; reads each layer of the cache in place).
               KIVI caches whose keys and values are both per token (the float formats fp8,
               nvfp4, mxfp4): read in the order they are stored by two XLA products with
               float32 accumulation in a 16-bit query's dtype (else float32): fp8 without
               sinks as stored, its block scales applied to the products' results; the
               others dequantized first. With a float32 query it agrees with "reference" to
               float32 rounding. Caches of pre-RoPE keys (`best3`, `best25`): the layer
               dequantized to that dtype, keys turned by RoPE at their positions
               (`KiviCache.layer_kv`), then the same two products;
               NotImplementedError for other caches (per-channel keys, blocked codes).
  "cudnn"      dense caches only: cuDNN's fused attention (`jax.nn.dot_product_attention`,
               implementation="cudnn"); raises NotImplementedError where it does not apply
               (no GPU or cuDNN, a float32 cache, a head dim cuDNN rejects).
  "auto"       "pallas" where it applies (sm_90 GPU, KIVI axes or fp8, supported shapes; keys
               before RoPE up to PRE_ROPE_KERNEL_TOKENS slots per launch),
               else on a GPU "xla" where it applies, else "reference". On a dense cache: "cudnn" on
               a GPU for a 16-bit cache, else (or where cuDNN declines) "xla" ("reference"
               converts K/V to float32 first).
               `dense_path` names the one that applies.
  "pallas-lowp", "auto-lowp"
               the same with the kernel's opt-in low-precision value product where it applies
               (G = D: values on fp8 tensor cores, `TuningConfig.fp8_values`; keys stay exact):
               ~1.08x faster at 2 bits, ~1.10x at 4 bits (H200, B=8, T=128k), at a measured
               cost in accuracy (docs/performance.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from kivi_jax import rotation
from kivi_jax.cache import (
    DenseCache,
    KiviCache,
    QuantizedStore,
    check_layer,
    read_by_gemms,
    runtime_layer,
)
from kivi_jax.mixed import MixedCache
from kivi_jax.quant import to_cache_order, unblock_columns, unpack_tokens
from pallas_kernels.merge import mask_logits as _mask_logits
from pallas_kernels.merge import merge_partials as _merge

# The dtypes the 16-bit paths take (cuDNN, the kernel, "xla"'s products on float formats)
_SIXTEEN_BIT = (jnp.bfloat16, jnp.float16)
IMPLEMENTATIONS = (
    "auto",
    "reference",
    "folded",
    "pallas",
    "auto-lowp",
    "pallas-lowp",
    "xla",
    "cudnn",
)


# XLA's default command-buffer op types (jax 0.11.2's XLA), less CUSTOM_CALL: the decode step's
# fusions, GEMMs and cuDNN calls still run as CUDA graphs, while the Mosaic kernel (a custom call)
# is launched on its own. Recorded into the graphs, the kernel left idle time between the step's
# kernels twice dense's, and a Llama-3-8B step at batch 1 ran ~7% slower end to end; dense
# programs (no custom call of this kind) are unchanged by it.
COMMAND_BUFFER_TYPES = (
    "CONDITIONAL",
    "CUBLAS",
    "CUBLASLT",
    "CUDNN",
    "DYNAMIC_SLICE_FUSION",
    "FUSION",
)


def compiler_options() -> dict[str, str]:
    """XLA options for a top-level program that calls the kernel: pass them to
    `jax.jit(step, compiler_options=kivi_jax.compiler_options())` (or to `.compile(...)`).

    They keep the Pallas kernel out of XLA's CUDA graphs (`COMMAND_BUFFER_TYPES`), which makes
    a decode step faster on Hopper; every backend accepts them and only GPUs read them. JAX takes
    compiler options on the outermost jit only: a jitted function given them cannot be called
    inside another jit (wrap the outer one instead)."""
    return {"xla_gpu_enable_command_buffer": ",".join(COMMAND_BUFFER_TYPES)}


def _check_cache(cache) -> None:
    if not isinstance(cache, KiviCache | DenseCache):
        raise ValueError(
            f"cache must be a KiviCache, MixedCache or DenseCache, got {type(cache).__name__}"
        )


def _check_query(q: Array, cache) -> None:
    if getattr(q, "ndim", None) != 3:
        raise ValueError(f"q must have shape [B, Hq, D], got {getattr(q, 'shape', q)}")
    b, hq, d = q.shape
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got dtype {q.dtype}")
    if b != cache.batch or d != cache.head_dim:
        raise ValueError(
            f"q shape {q.shape} does not match the cache (B={cache.batch}, D={cache.head_dim})"
        )
    if hq % cache.kv_heads:
        raise ValueError(f"q heads Hq={hq} must be a multiple of the cache's Hkv={cache.kv_heads}")


def _group_query(q: Array, kv_heads: int, scale: float) -> Array:
    b, hq, d = q.shape
    return q.astype(jnp.float32).reshape(b, kv_heads, hq // kv_heads, d) * scale


def _softmax_attend(qg: Array, k: Array, v: Array, mask: Array) -> tuple[Array, Array]:
    """qg [B, H, r, D], k/v [B, H, N, D], mask [B, N] (or broadcasting to [B, H, r, N]) ->
    (o [B, H, r, D], lse [B, H, r]).

    Products in k/v's dtype (q and P rounded to it) with float32 accumulation.
    """
    dot = lambda spec, a, b: jnp.einsum(
        spec, a.astype(b.dtype), b, precision="highest", preferred_element_type=jnp.float32
    )
    mask = mask[:, None, None, :] if mask.ndim == 2 else mask
    s = _mask_logits(dot("bhrd,bhnd->bhrn", qg, k), mask)
    return _normalize(s, lambda p: dot("bhrn,bhnd->bhrd", p, v))


def _attend_in_place(qg: Array, k: Array, v: Array, mask: Array) -> tuple[Array, Array]:
    """`_softmax_attend` in float32 as multiply-and-reduce: XLA reads k and v [B, H, N, D]
    where they lie, a layer's slice of the stacked windows included, where a dot_general
    takes its operands whole and copied the layer's windows first (2 x B x Hkv x W x D per
    layer and step: at a large batch a few percent of the step's traffic)."""
    f32 = lambda x: x.astype(jnp.float32)
    mask = mask[:, None, None, :] if mask.ndim == 2 else mask
    s = _mask_logits(jnp.sum(f32(qg)[:, :, :, None] * f32(k)[:, :, None], axis=-1), mask)
    return _normalize(s, lambda p: jnp.sum(p[..., None] * f32(v)[:, :, None], axis=3))


def _normalize(s: Array, pv) -> tuple[Array, Array]:
    """Softmax over the last axis of logits s, then pv(p); empty rows give o = 0, lse = -inf.

    A NaN logit (a non-finite key) makes its p, and so o and lse, NaN whatever the max does
    with it; the `total == 0` test (not `total > 0`) keeps a NaN total NaN in lse.
    """
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)
    total = jnp.sum(p, axis=-1)
    o = pv(p) / jnp.where(total > 0, total, 1.0)[..., None]
    empty = total == 0
    lse = jnp.where(empty, -jnp.inf, m_safe[..., 0] + jnp.log(jnp.where(empty, 1.0, total)))
    return o, lse


def merge_partials(parts) -> tuple[Array, Array]:
    """Log-sum-exp merge of normalized partial attentions [(o, lse), ...] over disjoint keys
    (`pallas_kernels.merge.merge_partials` over the stacked parts)."""
    return _merge(jnp.stack([o for o, _ in parts]), jnp.stack([lse for _, lse in parts]))


def merge_across(o: Array, lse: Array, axis: str) -> Array:
    """The log-sum-exp merge of every device's (o, lse) along mesh `axis`: one max and two
    sums. Empty everywhere: o = 0. A NaN part stays NaN."""
    top = jax.lax.pmax(lse, axis)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - top)
    num = jax.lax.psum(w[..., None] * o, axis)
    den = jax.lax.psum(w, axis)
    return jnp.where((den == 0)[..., None], 0.0, num / jnp.where(den == 0, 1.0, den)[..., None])


def _dense_attend(qg, cache: DenseCache, layer, dtype=None) -> tuple[Array, Array]:
    """Dense attention over `layer`, K/V in `dtype` (default: the cache's, read directly).

    "reference" passes float32; "auto" reads the cache dtype: converting the layer's K and V
    to float32 first is a temporary twice the layer's size (and as much traffic again).
    """
    k, v = cache.layer_kv(layer)  # [B, T, Hkv, D]
    if dtype is not None:
        k, v = k.astype(dtype), v.astype(dtype)
    n = jnp.minimum(cache.lengths, cache.max_len)
    mask = (jnp.arange(cache.max_len)[None, :] < n[:, None])[:, None, None, :]
    # Products as multiply-and-reduce, not dot_general: a GPU gemm wants the heads major to T,
    # and XLA met that by carrying the whole cache transposed through the decode loop (a copy
    # of it); a reduction reads the layer in place, its slice of the stacked cache included.
    f32 = lambda x: x.astype(k.dtype).astype(jnp.float32)
    s = jnp.sum(f32(qg)[:, None] * f32(k)[:, :, :, None], axis=-1)  # [B, T, H, r]
    s = _mask_logits(s.transpose(0, 2, 3, 1), mask)
    pv = lambda p: jnp.sum(
        f32(p).transpose(0, 3, 1, 2)[..., None] * f32(v)[:, :, :, None], axis=1
    )  # [B, H, r, D]
    return _normalize(s, pv)


def _dense_cudnn(q: Array, cache: DenseCache, layer, scale: float) -> Array:
    """cuDNN's fused attention over `layer` -> float32 [B, Hq, D]; rows holding no token give 0.

    Raises NotImplementedError where cuDNN declines at trace time (no GPU or cuDNN, a float32
    cache, a head dim or GQA ratio it rejects), so that "auto" can fall back to XLA.
    """
    if cache.dtype not in _SIXTEEN_BIT:
        raise NotImplementedError(f"cuDNN attention needs a 16-bit cache, got {cache.dtype}")
    # [B, T, Hkv, D], the cache's own layout: no transpose of the layer, nor of the cache.
    k, v = cache.layer_kv(layer)
    n = jnp.minimum(cache.lengths, cache.max_len)
    try:
        o = jax.nn.dot_product_attention(
            q[:, None].astype(cache.dtype),
            k,
            v,
            scale=scale,
            key_value_seq_lengths=n,
            implementation="cudnn",
        )
    except Exception as e:  # noqa: BLE001 - cuDNN's own checks raise several kinds
        raise NotImplementedError(f"cuDNN attention does not apply: {e}") from e
    # An empty row has no key to normalize over: the convention is o = 0, whatever cuDNN gives.
    return jnp.where((n > 0)[:, None, None], o[:, 0].astype(jnp.float32), 0.0)


def dense_path(q: Array, cache: DenseCache) -> str:
    """The path "auto" takes on a dense cache: "cudnn" (GPU, 16-bit q and cache) or "xla"; where
    cuDNN declines the shapes at trace time "auto" still falls back to "xla"."""
    return (
        "cudnn" if on_gpu() and cache.dtype in _SIXTEEN_BIT and q.dtype in _SIXTEEN_BIT else "xla"
    )


def _dense(q, qg, cache: DenseCache, layer, impl: str, scale: float) -> Array:
    if impl == "pallas":
        raise NotImplementedError("the Pallas kernel reads quantized caches only")
    if impl == "cudnn":
        return _dense_cudnn(q, cache, layer, scale)
    if impl == "auto" and dense_path(q, cache) == "cudnn":
        try:  # tokamax-style: cuDNN declining at trace time falls back to XLA
            return _dense_cudnn(q, cache, layer, scale)
        except NotImplementedError:
            pass
    return _dense_attend(qg, cache, layer, None if impl in ("auto", "xla") else jnp.float32)[0]


def _kivi_reference(qg, cache: KiviCache, layer) -> tuple[Array, Array]:
    n = jnp.minimum(cache.lengths, cache.max_len)
    t = jnp.broadcast_to(jnp.arange(cache.keys.capacity), (cache.batch, cache.keys.capacity))
    k = cache.read_keys(cache.keys.gather(layer, t, n), t[:, None])
    v = cache.values.gather(layer, t, n)
    return _softmax_attend(qg, k, v, t < n[:, None])


def quantized_region_folded(
    qg: Array, keys: QuantizedStore, values: QuantizedStore, layer, num_tokens: Array
) -> tuple[Array, Array]:
    """Attention over positions [0, num_tokens) where K and V are both quantized, folded form.

    Keys (per channel, groups of G tokens): q.k_t = (q*s_g).c_t + q.z_g, so codes enter the
    product raw. Values (per token, groups of G channels): sum_t p_t (s_t c_t + z_t) =
    sum_t (p_t s_t) c_t + sum_t p_t z_t per channel group.
    """
    if keys.axis != "channel" or values.axis != "token" or not values.transposed:
        raise NotImplementedError("the folded form needs KIVI axes (channel keys, token values)")
    if keys.fmt != "int" or values.fmt != "int" or keys.sinks or values.sinks or keys.outliers:
        raise NotImplementedError(
            "the folded form reads integer codes without sinks or outlier channels"
        )
    nb, nh, r, d = qg.shape
    tq, g = keys.capacity, keys.group_size
    kc = unpack_tokens(keys.codes[layer], keys.bits, axis=-2).astype(jnp.float32)
    ks = keys.scale[layer].astype(jnp.float32)  # [B, H, Tq/G, D]
    kz = keys.minimum[layer].astype(jnp.float32)
    qs = qg[:, :, :, None, :] * ks[:, :, None]  # [B, H, r, Tq/G, D]
    s = jnp.einsum(
        "bhrgd,bhgtd->bhrgt", qs, kc.reshape(nb, nh, tq // g, g, d), precision="highest"
    ).reshape(nb, nh, r, tq)
    bias = jnp.einsum("bhrd,bhgd->bhrg", qg, kz, precision="highest")
    s = s + jnp.repeat(bias, g, axis=-1)
    s = _mask_logits(s, (jnp.arange(tq)[None, :] < num_tokens[:, None])[:, None, None])

    vg = values.group_size
    vcodes = values.codes[layer]
    if values.blocked:
        vcodes = unblock_columns(vcodes)
    vc = unpack_tokens(vcodes, values.bits, axis=-1).astype(jnp.float32)
    # per-token scales are held in the cache order (docs/layout.md): back to token order
    vs = to_cache_order(values.scale[layer].astype(jnp.float32), -1)  # [B, H, D/G, Tq]
    vz = to_cache_order(values.minimum[layer].astype(jnp.float32), -1)

    def pv(p):  # p [B, H, r, Tq]
        ps = p[:, :, :, None, :] * vs[:, :, None]  # [B, H, r, D/G, Tq]
        o = jnp.einsum(
            "bhrct,bhcjt->bhrcj", ps, vc.reshape(nb, nh, d // vg, vg, tq), precision="highest"
        )
        o = o + jnp.einsum("bhrt,bhct->bhrc", p, vz, precision="highest")[..., None]
        return o.reshape(nb, nh, r, d)

    return _normalize(s, pv)


def quantized_region_dense(qg: Array, cache: KiviCache, layer, num_tokens: Array):
    """Attention over positions [0, num_tokens) of this store's slots (`local_lengths`), K and V
    dequantized to float32 (`KiviCache.layer_kv`): any format, sinks included, where the
    folded form does not apply."""
    k, v = (x.swapaxes(1, 2) for x in cache.layer_kv(layer, jnp.float32))  # [B, Hkv, Tq, D]
    held = jnp.arange(k.shape[2])[None, :] < num_tokens[:, None]
    return _softmax_attend(qg, k, v, held)


def tail_attention(qg: Array, cache: KiviCache, layer, start: Array) -> tuple[Array, Array]:
    """Attention over positions [start, lengths) of each row (the residual tail), float32;
    start is `cache.quantized_split()`."""
    n = jnp.minimum(cache.lengths, cache.max_len)
    if cache.windows_aligned and not cache.config.pre_rope:  # the windows, slot for slot
        w = cache.keys.window
        k = cache.keys.layer_window(layer)  # [B, Hkv, W, D]
        v = cache.values.layer_window(layer)
        return _attend_in_place(qg, k, v, jnp.arange(w)[None, :] < n[:, None])
    w = cache.tail_window
    t = n[:, None] - w + jnp.arange(w)  # the last W positions of each row
    k = cache.read_keys(cache.keys.gather(layer, t, n), t[:, None])
    v = cache.values.gather(layer, t, n)
    return _softmax_attend(qg, k, v, (t >= start[:, None]) & (t >= 0) & (t < n[:, None]))


def _product_dtype(q: Array):
    """The operand dtype of "xla"'s products on a quantized cache: a 16-bit query's (the
    dequantized codes written at half float32's bytes, as a 16-bit dense cache reads), else
    float32."""
    return q.dtype if q.dtype in _SIXTEEN_BIT else jnp.float32


def _kivi_xla(qg, cache: KiviCache, layer, dtype) -> tuple[Array, Array]:
    """The quantized region read in the stored token order by XLA's two products in `dtype`
    (the query's, if 16-bit) with float32 accumulation, and the windows in place: caches whose
    keys and values are both per token and unblocked (the float formats), post-RoPE.
    NotImplementedError otherwise. fp8 without sinks: `_fp8_products`; the rest dequantized
    to `dtype` first (`_dequantized_products`). Keys before RoPE: `_layer_products`."""
    if cache.config.pre_rope:
        return _layer_products(qg, cache, layer, dtype)
    product = functools.partial(
        jnp.einsum, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
    )
    products = _fp8_products if read_by_gemms(cache.config) else _dequantized_products
    (k_pos, k_chan, scores), (v_pos, v_chan, pv) = products(cache, layer, dtype, product)
    m = cache.quantized_split()
    # scores in the keys' slot order, against q in their channel order; V^T's slots are stored
    # in another order: the scores follow it (both are permutations of the same slots)
    s = scores(_permuted(qg, k_chan))
    s = _mask_logits(s, (k_pos[None, :] < m[:, None])[:, None, None, :])
    s = _permuted(s, np.argsort(k_pos)[v_pos])
    o, lse = _normalize(s, pv)
    parts = [(_permuted(o, np.argsort(v_chan)), lse)]
    if cache.tail_window:  # no windows: everything held is quantized
        parts.append(tail_attention(qg, cache, layer, m))
    return merge_partials(parts)


def _layer_products(qg, cache: KiviCache, layer, dtype) -> tuple[Array, Array]:
    """Attention over the whole layer dequantized to `dtype` (`KiviCache.layer_kv`: the keys
    turned back into the model's basis and by RoPE at their positions, the windows and sinks in
    place) by XLA's two products with float32 accumulation: caches of keys quantized before
    RoPE, which no product reads as stored (a key's RoPE angle is its position's)."""
    k, v = cache.layer_kv(layer, dtype)  # [B, Tq, Hkv, D]
    held = jnp.arange(k.shape[1])[None, :] < cache.local_lengths()[:, None]
    product = functools.partial(
        jnp.einsum, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
    )
    s = _mask_logits(product("bhgd,bthd->bhgt", qg.astype(dtype), k), held[:, None, None, :])
    return _normalize(s, lambda p: product("bhgt,bthd->bhgd", p.astype(dtype), v))


def _permuted(x: Array, order: np.ndarray) -> Array:
    """x's last axis taken in `order` (a permutation): no gather where it is the identity
    (fp8's 8-bit rows are stored in order)."""
    return x if np.array_equal(order, np.arange(order.size)) else jnp.take(x, order, axis=-1)


def _dequantized_products(cache: KiviCache, layer, dtype, product):
    """`_kivi_xla`'s products over K and V dequantized to `dtype` in the stored order
    (`QuantizedStore.token_slots`): ((key positions, key channels, scores(q)), (value
    positions, value channels, pv(p)))."""
    k, k_pos, k_chan = cache.keys.token_slots(layer)
    v, v_pos, v_chan = cache.values.token_slots(layer)
    vt = v.swapaxes(-1, -2).astype(dtype)  # [B, H, D, Tq]: V^T as stored
    scores = lambda qk: product("bhgd,bhtd->bhgt", qk.astype(dtype), k.astype(dtype))
    pv = lambda p: product("bhgt,bhdt->bhgd", p.astype(dtype), vt)
    return (k_pos, k_chan, scores), (v_pos, v_chan, pv)


def _fp8_products(cache: KiviCache, layer, dtype, product):
    """`_dequantized_products` for fp8 stores without sinks: the products read the elements as
    stored (`QuantizedStore.fp8_slots`) and the block scales are applied to their results.
    Scores: q split into its channel blocks (zero outside block j: J = D / G rows per query,
    no batch dimension added) against the raw keys gives one partial score per block, scaled
    by the key's block scale and summed. Values: P scaled by each slot's block-j scale gives J
    rows per query against the raw V^T; row j keeps block j's channels."""
    k, ks, k_pos, k_chan = cache.keys.fp8_slots(layer)  # k [B, H, Tq, D], ks [B, H, J, Tq]
    vt, vs, v_pos, v_chan = cache.values.fp8_slots(layer)  # vt [B, H, D, Tq], vs [B, H, J, Tq]
    g = cache.keys.group_size
    blocks = jnp.repeat(jnp.eye(k.shape[-1] // g, dtype=jnp.float32), g, axis=-1)  # [J, D]

    def scores(qk):  # [B, H, g, D] -> [B, H, g, Tq]
        qj = (qk[:, :, :, None, :] * blocks).astype(dtype)  # [B, H, g, J, D]
        sj = product("bhgjd,bhtd->bhgjt", qj, k.astype(dtype))
        return jnp.sum(sj * ks[:, :, None], axis=-2)

    def pv(p):  # [B, H, g, Tq] -> [B, H, g, D]
        pj = (p[:, :, :, None] * vs[:, :, None]).astype(dtype)  # [B, H, g, J, Tq]
        return jnp.sum(product("bhgjt,bhdt->bhgjd", pj, vt.astype(dtype)) * blocks, axis=-2)

    return (k_pos, k_chan, scores), (v_pos, v_chan, pv)


def _kivi_folded(qg, cache: KiviCache, layer) -> tuple[Array, Array]:
    if cache.config.pre_rope:  # q.RoPE(k_t) rotates q per position: no folding
        raise NotImplementedError("the folded form reads post-RoPE keys (pre_rope=False)")
    m = cache.quantized_split()
    main = quantized_region_folded(qg, cache.keys, cache.values, layer, m)
    return merge_partials([main, tail_attention(qg, cache, layer, m)])


def kernel_on_cache(
    q,
    cache: KiviCache,
    layer,
    num_tokens,
    *,
    scale: float,
    interpret=False,
    tuning=None,
    low_precision: bool = False,
    windows=None,
    sinks: bool = False,
    skip_sinks: bool = False,
    out_dtype=jnp.float32,
    in_model_basis: bool = False,
) -> tuple[Array, Array]:
    """`pallas_kernels.kivi_decode.kivi_decode` over a KIVI cache's stores: (o [B, Hq, D] in
    `out_dtype`, lse [B, Hq]) of positions [0, num_tokens) of `layer` (with `windows`, the
    cache's windows too, num_tokens being the rows' lengths, capped at the cache's max_len).
    `sinks`: attend the cache's sinks from their buffers too (those below the quantized split;
    the kernel's `sinks`). `skip_sinks`: skip the store's first N slots (N sinks) without
    attending the buffers, as a token shard's kernel does (its first slots are the sinks on
    the first shard only; `parallel.local_attention` attends them beside it). An fp8 cache
    (`KiviConfig.fp8_kernel_layout`) runs `pallas_kernels.fp8_decode`, which takes neither
    windows nor sinks; a cache of keys quantized before RoPE (`prerope_kernel_layout`)
    `pallas_kernels.prerope_decode`, which takes both (in one more unit of its launch) where
    their shapes allow it (`_prerope_kernel`). `in_model_basis`: q as the model made it and o
    returned so, not in the stored keys' and values' bases (`KiviCache.rotate_query`,
    `unrotate_output`): the integer kernel rotates q in its prologue and o where it writes the
    final rows (no launch before it, none after it); the others' q and o are rotated here."""
    config = cache.config
    here = in_model_basis and not config.kernel_layout  # the other kernels' q and o
    q = cache.rotate_query(q) if here else q
    finish = lambda o: (cache.unrotate_output(o) if here else o).astype(out_dtype)
    d = q.shape[-1]
    in_kernel = in_model_basis and config.kernel_layout
    q_signs = rotation.sign_tuple(d) if in_kernel and config.rotates_keys else None
    o_signs = rotation.sign_tuple(d) if in_kernel and config.rotates_values else None
    if config.prerope_kernel_layout:
        o, lse = _prerope_kernel(q, cache, layer, num_tokens, scale, interpret, sinks, windows)
        return finish(o), lse
    if cache.config.fp8_kernel_layout:
        if windows is not None or sinks:
            raise NotImplementedError("the fp8 kernel attends the quantized slots only")
        o, lse = _fp8_kernel(q, cache, layer, num_tokens, scale, interpret)
        return finish(o), lse
    from pallas_kernels import kivi_decode as kernel

    k, v = cache.keys, cache.values
    n_sinks = k.sinks if sinks or skip_sinks else 0
    return kernel.kivi_decode(
        q,
        k.codes,
        k.scale,
        k.minimum,
        v.codes,
        v.scale,
        v.minimum,
        num_tokens,
        layer,
        key_bits=cache.config.key_bits,
        value_bits=cache.config.value_bits,
        group_size=cache.config.group_size,
        sm_scale=scale,
        interpret=interpret,
        tuning=tuning,
        low_precision=low_precision,
        windows=windows,
        max_len=cache.max_len if windows else 0,
        skip=n_sinks,
        sinks=(k.sink, v.sink) if sinks and n_sinks else None,
        q_signs=q_signs,
        o_signs=o_signs,
        out_dtype=out_dtype,
    )


def _fp8_kernel(q, cache: KiviCache, layer, num_tokens, scale, interpret):
    """`pallas_kernels.fp8_decode.fp8_decode` over an fp8 cache's stores: (o [B, Hq, D], lse
    [B, Hq]) float32 of positions [0, num_tokens); NotImplementedError for shapes it does not
    take (head dims, query heads per kv head)."""
    from pallas_kernels import fp8_decode as kernel

    d, group = q.shape[-1], q.shape[1] // cache.kv_heads
    if d not in kernel.SUPPORTED_HEAD_DIMS or group > kernel.MAX_GROUP_HEADS:
        raise NotImplementedError(
            f"the fp8 kernel takes head dims {kernel.SUPPORTED_HEAD_DIMS} and at most "
            f"{kernel.MAX_GROUP_HEADS} query heads per kv head, got D={d}, {group}"
        )
    k, v = cache.keys, cache.values
    return kernel.fp8_decode(
        q,
        k.codes,
        k.scale,
        v.codes,
        v.scale,
        num_tokens,
        layer,
        group_size=cache.config.group_size,
        sm_scale=scale,
        interpret=interpret,
    )


def _prerope_kernel(q, cache: KiviCache, layer, num_tokens, scale, interpret, sinks: bool,
                    windows=None):  # fmt: skip
    """`pallas_kernels.prerope_decode.prerope_decode` over a cache of keys quantized before
    RoPE: (o [B, Hq, D], lse [B, Hq]) float32 of positions [N, num_tokens) (N sinks, whose
    codes are never read) and, with `sinks`, of the quantized sinks from their buffers (in the
    launch where it takes them, `takes_sinks`, else beside it: `_prerope_beside`); with
    `windows` (the cache's, num_tokens the rows' lengths) of the whole rows in one launch.
    NotImplementedError for shapes the kernel does not take."""
    from pallas_kernels import prerope_decode as kernel

    config, d, group = cache.config, q.shape[-1], q.shape[1] // cache.kv_heads
    if (
        d not in kernel.SUPPORTED_HEAD_DIMS
        or group > kernel.MAX_GROUP_HEADS
        or config.group_size not in kernel.SUPPORTED_GROUPS
    ):
        raise NotImplementedError(
            f"the pre-RoPE kernel takes head dims {kernel.SUPPORTED_HEAD_DIMS}, groups "
            f"{kernel.SUPPORTED_GROUPS} and at most {kernel.MAX_GROUP_HEADS} query heads per kv "
            f"head, got D={d}, G={config.group_size}, {group}"
        )
    k, v = cache.keys, cache.values
    buffers = (k.sink, v.sink) if sinks and k.sinks else None
    in_launch = buffers is not None and kernel.takes_sinks(*buffers)
    if windows is not None and (
        cache.seq_axis is not None
        or not kernel.takes_windows(*windows)
        or (buffers is not None and not in_launch)
    ):
        raise NotImplementedError("the pre-RoPE kernel does not take these windows")
    rotated = config.rotates_keys  # the stored keys are x R: x = stored R^T
    o, lse = kernel.prerope_decode(
        q,
        k.codes,
        k.scale,
        k.minimum,
        v.codes,
        v.scale,
        v.minimum,
        num_tokens,
        layer,
        cache.key_rope,
        jnp.asarray(rotation.matrix(d).T) if rotated else None,
        key_bits=config.key_bits,
        value_bits=config.value_bits,
        group_size=config.group_size,
        sm_scale=scale,
        basis_scale=1 / math.sqrt(d) if rotated else 1.0,
        skip=k.sinks,
        origin=cache._origin(),
        windows=windows,
        sinks=buffers if in_launch else None,
        max_len=cache.max_len if windows is not None else 0,
        interpret=interpret,
    )
    if buffers is None or in_launch:
        return o, lse
    o, lse = _settled(o, lse, interpret)  # before the eager ops of the sinks' part
    qg = _group_query(q, cache.kv_heads, scale)
    part = (o.reshape(qg.shape), lse.reshape(qg.shape[:-1]))
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, cache.num_layers - 1)
    o, lse = merge_partials([part, _prerope_beside(qg, cache, layer, num_tokens, tail=False)])
    return o.reshape(q.shape), lse.reshape(q.shape[:2])


def _prerope_beside(qg, cache: KiviCache, layer, m, tail: bool = True) -> tuple[Array, Array]:
    """What the pre-RoPE kernel leaves of a decode step where its launch does not take the
    sinks or windows (`_prerope_kernel`), in one softmax: each row's quantized sinks,
    positions [0, min(N, m)), and with `tail` its tail [m, lengths)
    (`tail_attention`'s), read by one gather (the sinks from their buffers, the tail from the
    windows), keys back to post-RoPE (`read_keys`), float32."""
    n = jnp.minimum(cache.lengths, cache.max_len)
    sinks, w = cache.keys.sinks, cache.tail_window if tail else 0
    j = jnp.broadcast_to(jnp.arange(sinks), (cache.batch, sinks))
    t = jnp.concatenate([j, n[:, None] - w + jnp.arange(w)], axis=1)  # [B, N + W]
    held = jnp.concatenate(
        [j < jnp.minimum(sinks, m)[:, None], (t[:, sinks:] >= m[:, None]) & (t[:, sinks:] >= 0)],
        axis=1,
    )
    k = cache.read_keys(cache.keys.gather(layer, t, n), t[:, None], by_matrix=True)
    v = cache.values.gather(layer, t, n)
    return _softmax_attend(qg, k, v, held & (t < n[:, None]))


def _kivi_pallas(
    qg,
    q,
    cache: KiviCache,
    layer,
    scale,
    interpret,
    tuning=None,
    low_precision: bool = False,
    out_dtype=jnp.float32,
    q_model=None,
) -> tuple[Array, Array]:
    """(o, lse) of the kernel over the whole cache: one launch where it takes the windows
    (o then in `out_dtype`, or float32 where the values are rotated and the caller rotates o
    back), else the kernel's float32 partial merged with the tail's. q_model: q before
    `KiviCache.rotate_query` (q and qg are after it); then o is returned in the model's basis
    (`unrotate_output`), by the one launch itself where it runs (XLA then drops the rotation
    of q before it, unused)."""
    try:  # the kernel's module, imported here so that its absence is a NotImplementedError
        from pallas_kernels import kivi_decode  # noqa: F401
    except ImportError as e:  # pragma: no cover - the kernel module ships with the package
        raise NotImplementedError(f"the Pallas KIVI kernel is not available: {e}") from e
    config = cache.config
    if not (config.kernel_layout or config.fp8_kernel_layout or config.prerope_kernel_layout):
        raise NotImplementedError(
            "the Pallas kernels need KIVI axes (channel keys, token values), integer codes and "
            "no outlier channels (keys before RoPE: 2 or 4 bits), or fp8 keys and values "
            f"without sinks, post-RoPE; got {config}"
        )
    if not interpret and not pallas_available():
        raise NotImplementedError(
            "the Pallas KIVI kernel runs on Hopper (sm_90) GPUs; on this backend "
            f"({jax.default_backend()}) pass interpret=True to run it under the GPU interpreter"
        )
    m = cache.quantized_split()
    call = lambda num_tokens, windows=None, out_dtype=jnp.float32, sinks=True, model=False: (
        kernel_on_cache(
            q_model if model else q,
            cache,
            layer,
            num_tokens,
            scale=scale,
            interpret=interpret,
            tuning=tuning,
            low_precision=low_precision,
            windows=windows,
            sinks=sinks and bool(cache.keys.sinks),
            out_dtype=out_dtype,
            in_model_basis=model,
        )
    )
    grouped = lambda o, lse: (o.reshape(qg.shape), lse.reshape(qg.shape[:-1]))
    if kernel_window(cache):
        # One launch: the kernel attends the windows too (where they fit its shared memory);
        # where it also merges its splits it writes o in out_dtype itself, nothing after it
        model = q_model is not None  # then rotated back by the launch itself
        out = jnp.float32 if cache.config.rotates_values and not model else out_dtype
        try:
            windows = (cache.keys.residual, cache.values.residual)
            o, lse = call(cache.lengths, windows, out, model=model)
            return grouped(*_settled(o, lse, interpret))
        except NotImplementedError:
            pass
    if config.prerope_kernel_layout:  # the sinks and the tail in one pass beside the launch
        main = grouped(*_settled(*call(m, sinks=False), interpret))
        o, lse = merge_partials([main, _prerope_beside(qg, cache, layer, m)])
    else:
        main = grouped(*_settled(*call(m), interpret))
        o, lse = merge_partials([main, tail_attention(qg, cache, layer, m)])
    return (o if q_model is None else cache.unrotate_output(o)), lse


def kernel_window(cache: KiviCache) -> int:
    """The residual-window slots the kernel can take into its launch: the windows' W where
    they are rings slot for slot with the tail (`windows_aligned`) in whole chunks of 64
    slots, else 0 (the tail is then attended beside the kernel)."""
    w = cache.keys.window
    return w if cache.windows_aligned and w % 64 == 0 else 0


def _settled(o, lse, interpret):
    if interpret and not isinstance(o, jax.core.Tracer):
        # Called eagerly, the interpreted kernel runs asynchronously and its callbacks dispatch
        # eager ops of their own; eager ops issued here meanwhile can deadlock the CPU client
        # (seen on 2 cores), so the kernel finishes first. Under jit there is one executable.
        jax.block_until_ready((o, lse))
    return o, lse


def on_gpu() -> bool:
    """True when jax's default backend is a GPU: where "auto" takes cuDNN for dense caches and
    XLA's GEMMs for the float formats (a deviceless compile for a GPU target sets it)."""
    return jax.default_backend() == "gpu"


def pallas_available() -> bool:
    """True when running on a Hopper (sm_90) GPU, where the Mosaic GPU kernel compiles."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:  # pragma: no cover
        return False
    return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


# The most quantized slots (rows x capacity) for which "auto" takes the pre-RoPE kernel over
# XLA's products on the layer dequantized to 16 bits: its per-plane steps are serial and slow,
# so it wins on small launches only (docs/performance.md, "Keys before RoPE").
PRE_ROPE_KERNEL_TOKENS = 16384


def _kernel_applies(q: Array, cache: KiviCache) -> bool:
    """Whether "auto" should try a Pallas kernel: a Hopper GPU, a 16-bit q, and KIVI axes with
    fp16 scales (what the integer kernel reads), an fp8 cache (`fp8_kernel_layout`) or a small
    one of keys before RoPE (`prerope_kernel_layout`, PRE_ROPE_KERNEL_TOKENS: a token
    shard's slots on a sequence-sharded cache); finer limits raise NotImplementedError there."""
    config = cache.config
    integer = config.kernel_layout and config.scale_dtype == "float16"
    prerope = (
        config.prerope_kernel_layout and cache.batch * cache.keys.capacity <= PRE_ROPE_KERNEL_TOKENS
    )
    kernels = integer or config.fp8_kernel_layout or prerope
    return pallas_available() and q.dtype in _SIXTEEN_BIT and kernels


def _check_scale(scale, head_dim: int) -> float:
    """The softmax scale as a Python float: 1/sqrt(D) for None, else a finite positive real."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, jax.core.Tracer):  # the kernel takes it as a compile-time constant
        raise ValueError("scale must be a concrete number (static under jit), got a traced value")
    try:
        value = None if isinstance(scale, bool) else float(scale)
    except (TypeError, ValueError):  # a string, an array of several values
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a finite positive number (or None), got {scale!r}")
    return value


def decode_attention(
    q: Array,
    cache: KiviCache | MixedCache | DenseCache,
    layer,
    *,
    implementation: str = "auto",
    scale: float | None = None,
    interpret: bool = False,
    tuning=None,
) -> Array:
    """Softmax attention of one query per row over `layer` of a cache.

    q: [B, Hq, D] with Hq a multiple of the cache's Hkv (GQA); attends to positions
    [0, lengths[b]) of each row (ragged rows masked); float32 math; returns [B, Hq, D] in
    q.dtype. scale defaults to 1/sqrt(D). tuning: a `pallas_kernels.kivi_decode.TuningConfig`
    for the Pallas kernel (launch parameters and opt-in flags such as fp8_values; default: its
    heuristic; the "-lowp" implementations turn its fp8_values on). Raises
    ValueError for bad shapes, an unknown implementation, a scale that is not a finite positive
    number, or a concrete layer outside [0, L); NotImplementedError where "pallas" or "cudnn"
    does not apply ("xla" and "cudnn" on a KIVI cache included). A traced layer outside
    [0, L) gives NaN (and a checkify check, `kivi_jax.cache.check_layer`); a non-finite key or
    value gives NaN in the rows and heads that attend to it (docs/what_happens_when.md).
    On a KIVI cache that holds one shard of the token axes (`cache.seq_axis` set, inside
    `jax.shard_map` over that axis, as `kivi_jax.parallel` runs it) the attention is
    sequence-parallel: this device's tokens, merged across the axis ("folded" for
    "reference").
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if isinstance(cache, MixedCache):  # the layer's part, an ordinary KiviCache
        kw = dict(implementation=implementation, scale=scale, interpret=interpret, tuning=tuning)
        return cache.route(layer, lambda i, h: decode_attention(q, cache.parts[i], h, **kw))
    _check_cache(cache)
    _check_query(q, cache)
    scale = _check_scale(scale, q.shape[-1])
    given = layer
    layer, in_range = check_layer(layer, cache.num_layers)
    kernel_layer = layer
    q_model = q
    if isinstance(cache, KiviCache):  # q in the stored keys' basis (`KiviConfig.rotation`)
        q, layer = cache.rotate_query(q), runtime_layer(layer)
        # The kernel applies the range policy itself (reads clamped, o NaN): given the index
        # as it came, no launch clamps it before the kernel or masks the output after it.
        kernel_layer = layer if in_range is None else runtime_layer(given)
    qg = _group_query(q, cache.kv_heads, scale)
    impl, lowp = implementation.removesuffix("-lowp"), implementation.endswith("-lowp")
    ran_kernel = False

    def kernel():
        nonlocal ran_kernel
        out = _kivi_pallas(
            qg, q, cache, kernel_layer, scale, interpret, tuning, lowp, q.dtype, q_model
        )
        ran_kernel = True
        return out

    if isinstance(cache, KiviCache) and cache.seq_axis is not None:
        # inside shard_map over the token axes: this device's tokens, merged across the axis
        from kivi_jax.parallel import shard_attention

        o = shard_attention(qg, q, cache, layer, impl, scale, interpret)
    elif isinstance(cache, DenseCache):
        o = _dense(q, qg, cache, layer, impl, scale)
    elif impl == "cudnn":
        raise NotImplementedError("'cudnn' attention reads dense caches only")
    elif impl == "xla":
        o, _ = _kivi_xla(qg, cache, layer, _product_dtype(q))
    elif impl == "reference":
        o, _ = _kivi_reference(qg, cache, layer)
    elif impl == "folded":
        o, _ = _kivi_folded(qg, cache, layer)
    elif impl == "pallas":
        o, _ = kernel()
    elif impl == "auto":
        o = None
        if _kernel_applies(q, cache):
            # tokamax-style dispatch: a kernel that declines a case at trace time falls back.
            try:
                o, _ = kernel()
            except NotImplementedError:
                pass
        if o is None and on_gpu():
            try:  # where no kernel applies: the float formats through XLA's GEMMs
                o, _ = _kivi_xla(qg, cache, layer, _product_dtype(q))
            except NotImplementedError:
                pass
        if o is None:
            o, _ = _kivi_reference(qg, cache, layer)
    else:
        o, _ = _kivi_reference(qg, cache, layer)
    if isinstance(cache, KiviCache) and not ran_kernel:  # (the kernel's o is the model's)
        o = cache.unrotate_output(o)
    if in_range is not None and not ran_kernel:  # a traced layer out of range was clamped:
        o = jnp.where(in_range, o, jnp.nan)  # never another's answer
    return o.reshape(q.shape).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# A chunk of new queries per row (chunked prefill).

CHUNK_IMPLEMENTATIONS = ("auto", "reference", "pallas", "cudnn")
PAST_BLOCK = 4096  # positions per step of the reference's scan over the cache (bounds memory)
# Query rows per kv head in one kernel launch with folded chunk queries: the decode's own
# largest (Hq / Hkv = 8); at 32 rows Mosaic's layout inference fails for 4-bit caches.
KERNEL_QUERY_ROWS = 8


def _fold_chunk(q: Array, kv_heads: int) -> Array:
    """q [B, C, Hq, D] -> [B, Hkv, C * r, D]: the chunk's queries as extra rows of each kv
    head's query group (row c * r + j is query c's head h * r + j)."""
    b, c, hq, d = q.shape
    r = hq // kv_heads
    return q.reshape(b, c, kv_heads, r, d).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, c * r, d)


def _unfold_chunk(o: Array, c: int) -> Array:
    b, h, cr, d = o.shape
    return o.reshape(b, h, c, cr // c, d).transpose(0, 2, 1, 3, 4).reshape(b, c, -1, d)


def _past_blocked(qg: Array, cache, layer) -> tuple[Array, Array]:
    """Reference attention of qg [B, Hkv, N, D] over positions [0, lengths) of `layer`, float32,
    PAST_BLOCK positions at a time (a scan merging partials: memory O(N * PAST_BLOCK))."""
    n = jnp.minimum(cache.lengths, cache.max_len)
    cap = cache.keys.capacity if isinstance(cache, KiviCache) else cache.max_len
    block = min(PAST_BLOCK, cap)
    nb = -(-cap // block)

    def kv(t):  # positions t [B, block] -> K, V [B, Hkv, block, D] float32
        if isinstance(cache, KiviCache):
            k = cache.read_keys(cache.keys.gather(layer, t, n), t[:, None])
            return k, cache.values.gather(layer, t, n)
        k, v = cache.layer_kv(layer)  # [B, T, Hkv, D]
        tc = jnp.clip(t, 0, cache.max_len - 1)[..., None, None]
        take = lambda x: jnp.take_along_axis(x, tc, axis=1).swapaxes(1, 2).astype(jnp.float32)
        return take(k), take(v)

    def step(acc, i):
        t = jnp.broadcast_to(i * block + jnp.arange(block), (cache.batch, block))
        part = _softmax_attend(qg, *kv(t), t < n[:, None])
        return merge_partials([acc, part]), None

    empty = (jnp.zeros(qg.shape, jnp.float32), jnp.full(qg.shape[:-1], -jnp.inf, jnp.float32))
    return jax.lax.scan(step, empty, jnp.arange(nb))[0]


def _cudnn_with_lse(q, k, v, scale, **kw) -> tuple[Array, Array]:
    """cuDNN's fused attention of q [B, C, Hq, D] over k, v [B, T, Hkv, D] (16-bit) with its
    log-sum-exp -> (o float32 [B, C, Hq, D], lse [B, C, Hq]). Raises NotImplementedError
    where cuDNN declines at trace time (no GPU or cuDNN, a head dim or dtype it rejects)."""
    if not on_gpu() or q.dtype not in _SIXTEEN_BIT:
        raise NotImplementedError("cuDNN attention needs a GPU and 16-bit inputs")
    try:
        o, lse = jax.nn.dot_product_attention(
            q, k, v, scale=scale, implementation="cudnn", return_residual=True, **kw
        )
    except Exception as e:  # noqa: BLE001 - cuDNN's own checks raise several kinds
        raise NotImplementedError(f"cuDNN attention does not apply: {e}") from e
    return o.astype(jnp.float32), lse.astype(jnp.float32)


def dense_with_lse_reference(
    q, k, v, scale, *, key_value_seq_lengths, query_seq_lengths=None, is_causal=False
) -> tuple[Array, Array]:
    """The float32 twin of `_cudnn_with_lse` (the same arguments and results): softmax
    attention of q [B, C, Hq, D] over the first key_value_seq_lengths[b] keys of k, v
    [B, T, Hkv, D], causal from the first key if asked; rows without keys give o = 0,
    lse = -inf."""
    del query_seq_lengths  # query rows past it are unspecified either way
    b, c, hq, d = q.shape
    h = k.shape[2]
    qg = _fold_chunk(q, h).astype(jnp.float32) * scale  # [B, Hkv, C r, D]
    kt, vt = (x.swapaxes(1, 2).astype(jnp.float32) for x in (k, v))
    t = jnp.arange(k.shape[1])
    mask = (t[None, :] < key_value_seq_lengths[:, None])[:, None, None, :]
    if is_causal:
        query = jnp.arange(c * (hq // h)) // (hq // h)
        mask = mask & (t[None, :] <= query[:, None])[None, None]
    o, lse = _softmax_attend(qg, kt, vt, mask)
    return _unfold_chunk(o, c), _unfold_chunk(lse[..., None], c)[..., 0]


def _chunk_dense_past(q, k, v, counts, cache, layer, scale, attend) -> tuple[Array, Array]:
    """Both parts of `chunk_attention` through `attend` (`_cudnn_with_lse`, or its twin),
    folded (o [B, Hkv, C r, D], lse [B, Hkv, C r]): the past dequantized to q's dtype in one
    fused pass (`KiviCache.layer_kv`; a dense cache's layer read in place), attended without a
    mask but the rows' lengths (on a token shard its own positions); the chunk causally over
    its first counts[b] keys (counted once: on the first shard)."""
    h = cache.kv_heads
    if isinstance(cache, KiviCache):
        kp, vp = cache.layer_kv(layer, q.dtype)
        n = cache.local_lengths()
    else:
        kp, vp = (x.astype(q.dtype) for x in cache.layer_kv(layer))
        n = jnp.minimum(cache.lengths, cache.max_len)
    fold = lambda o, lse, held: (
        jnp.where(held[:, None, None, None], _fold_chunk(o, h), 0.0),
        jnp.where(held[:, None, None], _fold_chunk(lse[..., None], h)[..., 0], -jnp.inf),
    )
    past = fold(*attend(q, kp, vp, scale, key_value_seq_lengths=n), n > 0)
    lens = dict(query_seq_lengths=counts, key_value_seq_lengths=counts)
    own = attend(q, k.astype(q.dtype), v.astype(q.dtype), scale, is_causal=True, **lens)
    held = counts > 0
    if isinstance(cache, KiviCache) and cache.seq_axis is not None:
        held = held & (jax.lax.axis_index(cache.seq_axis) == 0)
    return past, fold(*own, held)


def _past(qg, qf, cache, layer, impl: str, scale, interpret) -> tuple[Array, Array]:
    """(o, lse) of the chunk's folded queries qg (scaled float32) / qf (q's dtype)
    [B, Hkv, N, D] over what the cache holds: this device's part on a token shard
    (`seq_axis`). The kernel takes the queries KERNEL_QUERY_ROWS per kv head per launch
    (each launch reads the whole cache)."""
    b, _, n, d = qg.shape
    flat = lambda x: x.reshape(b, -1, d)
    if isinstance(cache, KiviCache) and cache.seq_axis is not None:
        from kivi_jax.parallel import local_attention

        local = "pallas" if impl == "pallas" else "folded"
        part = lambda g, f: local_attention(
            g, flat(f), cache, layer, cache.seq_axis, local, scale, interpret
        )
    elif impl == "pallas":
        part = lambda g, f: _kivi_pallas(g, flat(f), cache, layer, scale, interpret)
    else:
        return _past_blocked(qg, cache, layer)
    rows = KERNEL_QUERY_ROWS if impl == "pallas" else n
    parts = [part(qg[:, :, i : i + rows], qf[:, :, i : i + rows]) for i in range(0, n, rows)]
    return tuple(jnp.concatenate(x, axis=2) for x in zip(*parts, strict=True))


def chunk_attention(
    q: Array,
    k: Array,
    v: Array,
    counts: Array,
    cache: KiviCache | MixedCache | DenseCache,
    layer,
    *,
    implementation: str = "auto",
    scale: float | None = None,
    interpret: bool = False,
) -> Array:
    """Attention of a chunk of new queries per row, at positions lengths[b] + i: over all that
    `cache` holds of `layer` (positions [0, lengths)), and causally over the chunk itself.

    q [B, C, Hq, D]; k, v [B, C, Hkv, D] the chunk's own keys and values (post-RoPE, in full
    precision: the chunk is appended to the cache after its attention, `extend`), row b's
    first counts[b] valid. The two parts are merged by log-sum-exp. Returns [B, C, Hq, D] in
    q.dtype; query rows at or past counts[b] are unspecified (finite).

    implementation:
      "cudnn"      GPUs, 16-bit q: the layer's past dequantized to q's dtype in one fused pass
                   (`KiviCache.layer_kv`), then cuDNN's flash attention (tensor cores) for the
                   past and, causally, for the chunk, with their log-sum-exps.
      "pallas"     KIVI caches: the decode kernel with the chunk's queries folded into its
                   query rows, KERNEL_QUERY_ROWS per kv head per launch (each launch reads the
                   whole past: right, and memory-bound).
      "reference"  float32, the past PAST_BLOCK positions at a time.
      "auto"       "cudnn" where it applies, else "reference" (on token shards its folded
                   form).
    Inside `jax.shard_map` over a KIVI cache's token axes (`cache.seq_axis`) each device
    attends its own positions (the windows where their positions fall, the chunk itself on
    the first shard) and the parts are merged across the axis.
    """
    if implementation not in CHUNK_IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {CHUNK_IMPLEMENTATIONS}, got {implementation!r}"
        )
    if isinstance(cache, MixedCache):  # the layer's part, an ordinary KiviCache
        kw = dict(implementation=implementation, scale=scale, interpret=interpret)
        route = lambda i, h: chunk_attention(q, k, v, counts, cache.parts[i], h, **kw)
        return cache.route(layer, route)
    _check_cache(cache)
    if getattr(q, "ndim", None) != 4:
        raise ValueError(f"q must have shape [B, C, Hq, D], got {getattr(q, 'shape', q)}")
    bsz, c, hq, d = q.shape
    _check_query(q[:, 0], cache)
    want = (bsz, c, cache.kv_heads, d)
    if k.shape != want or v.shape != want:
        raise ValueError(f"k and v must be [B, C, Hkv, D] = {want}, got {k.shape}, {v.shape}")
    if getattr(counts, "shape", None) != (bsz,):
        raise ValueError(f"counts must be [B]={bsz} int32, got {getattr(counts, 'shape', counts)}")
    scale = _check_scale(scale, d)
    layer, _ = check_layer(layer, cache.num_layers)
    if isinstance(cache, KiviCache):
        layer = runtime_layer(layer)
    sharded = isinstance(cache, KiviCache) and cache.seq_axis is not None
    finish = lambda o: _unfold_chunk(o, c).astype(q.dtype)
    if isinstance(cache, KiviCache) and cache.config.rotation != "none":
        # all of it in the stored basis (`KiviConfig.rotation`): the chunk's own keys in q's,
        # its values in the stored values'; the output rotated back
        q, k, v = cache.rotate_query(q), cache.rotate_keys(k), cache.rotate_values(v)
        finish = lambda o: cache.unrotate_output(_unfold_chunk(o, c)).astype(q.dtype)
    impl = implementation
    if impl == "pallas" and not isinstance(cache, KiviCache):
        raise NotImplementedError("the Pallas kernel reads quantized caches only")
    if impl == "auto":
        impl = "cudnn"
    if impl == "cudnn":
        try:
            parts = _chunk_dense_past(q, k, v, counts, cache, layer, scale, _cudnn_with_lse)
            o, lse = merge_partials(list(parts))
            if sharded:
                o = merge_across(o, lse, cache.seq_axis)
            return finish(o)
        except NotImplementedError:  # no GPU, or cuDNN declined: "auto" falls back
            if implementation == "cudnn":
                raise
            impl = "reference"
    h = cache.kv_heads
    qf = _fold_chunk(q, h)  # [B, Hkv, C r, D]
    qg = qf.astype(jnp.float32) * scale
    kvt = lambda x: x.swapaxes(1, 2).astype(jnp.float32)  # [B, Hkv, C, D]
    r = hq // h
    query = jnp.arange(c * r) // r
    key = jnp.arange(c)
    causal = (key[None, :] <= query[:, None])[None, None] & (key < counts[:, None])[:, None, None]
    own = _softmax_attend(qg, kvt(k), kvt(v), causal)
    try:
        past = _past(qg, qf, cache, layer, impl, scale, interpret)
    except NotImplementedError:  # the kernel declined: "auto" falls back
        if implementation == "pallas":
            raise
        past = _past(qg, qf, cache, layer, "reference", scale, interpret)
    if sharded:
        axis = cache.seq_axis  # the chunk's own part counts once, on the first shard
        own = (own[0], jnp.where(jax.lax.axis_index(axis) == 0, own[1], -jnp.inf))
        o = merge_across(*merge_partials([past, own]), axis)
    else:
        o, _ = merge_partials([past, own])
    return finish(o)
