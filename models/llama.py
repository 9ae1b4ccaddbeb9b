"""The Llama family as pure functions of a params pytree, plus a Flax NNX module holding it.

Shape letters: B batch, S prompt length, T cache length, V vocab, d hidden, F MLP width,
Hq query heads, Hkv key/value heads, D head dim, L layers.

Params are a plain dict (the layout loaders, orbax and sharding see); per-layer weights are
stacked on a leading L axis so the layer loop is one `lax.scan` and compiles once:

    embed        [V, d]
    layers/      attn_norm [L, d], wq [L, d, Hq*D], wk/wv [L, d, Hkv*D], wo [L, Hq*D, d],
                 bq [L, Hq*D], bk/bv [L, Hkv*D] (qkv_bias only), mlp_norm [L, d],
                 w_gate/w_up [L, d, F], w_down [L, F, d]
    final_norm   [d]
    lm_head      [d, V] (absent when tie_embeddings)

`unstack_layers` turns `layers` into a tuple of L per-layer dicts (the same arrays without the
L axis); `forward` and `decode_step` then run the layers as an unrolled Python loop.
`fuse_projections` also joins the matrices that read the same input: wq|wk|wv as
wqkv [d, (Hq + 2 Hkv) D] (biases bqkv) and w_gate|w_up as w_gate_up [d, 2F]; `fold_norms`
then folds the RMSNorm weights attn_norm / mlp_norm into the rows of those two matrices and
drops them. Every function here takes any of these forms. Per-layer fused weights with the
norms folded (`decode_params`) are the layout to decode with on GPUs
(`models.generate.decode_layout`): inside a scan each layer's weights are a dynamic slice of
the stacked arrays, and XLA copies every slice before its GEMM, so a decode step moves the
weights through memory three times (docs/generation.md: a Llama-3-8B step at batch 1 takes
14.5 ms with the scan, 7.7-8.0 ms with per-layer weights).

The KV cache is passed in and returned (never module state). Prefill attends in full precision
(`jax.nn.dot_product_attention`, cuDNN where it applies) and then hands the post-RoPE K/V to
`cache.prefill`, so keys are quantized after RoPE as in KIVI. A decode step advances the cache,
writes the new token's K/V layer by layer and attends through `kivi_jax.decode_attention`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array

from kivi_jax import decode_attention, rotation
from kivi_jax.attention import chunk_attention
from models.presets import ModelConfig

Params = dict
KVTransform = Callable[[Array, Array], tuple[Array, Array]]


# ---------------------------------------------------------------------------------------------
# Parameter layout and initialization.


def param_shapes(config: ModelConfig, dtype=jnp.float32) -> Params:
    """The params pytree as `jax.ShapeDtypeStruct`s (norm weights included, in `dtype`)."""
    c = config
    L, d, F = c.num_layers, c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    layers = dict(
        attn_norm=s(L, d),
        wq=s(L, d, q),
        wk=s(L, d, kv),
        wv=s(L, d, kv),
        wo=s(L, q, d),
        mlp_norm=s(L, d),
        w_gate=s(L, d, F),
        w_up=s(L, d, F),
        w_down=s(L, F, d),
    )
    if c.qkv_bias:
        layers.update(bq=s(L, q), bk=s(L, kv), bv=s(L, kv))
    params = dict(embed=s(c.vocab_size, d), layers=layers, final_norm=s(d))
    if not c.tie_embeddings:
        params["lm_head"] = s(d, c.vocab_size)
    return params


def init_params(config: ModelConfig, key: Array, dtype=jnp.float32) -> Params:
    """Random params (normal, std 1/sqrt(fan_in); norms at 1) for benchmarks and tests.

    Jitted, so a large preset is generated on the device without a host copy.
    """
    shapes = param_shapes(config, dtype)

    @jax.jit
    def make(key):
        leaves, treedef = jax.tree.flatten_with_path(shapes)
        keys = jax.random.split(key, len(leaves))
        out = []
        for (path, sd), k in zip(leaves, keys, strict=True):
            name = jax.tree_util.keystr(path)
            if "norm" in name:
                out.append(jnp.ones(sd.shape, sd.dtype))
            elif name.endswith("['bq']") or name.endswith("['bk']") or name.endswith("['bv']"):
                out.append((0.02 * jax.random.normal(k, sd.shape, jnp.float32)).astype(sd.dtype))
            else:
                fan_in = sd.shape[-1] if "embed" in name else sd.shape[-2]
                std = 1.0 if "embed" in name else 1.0 / math.sqrt(fan_in)
                out.append((std * jax.random.normal(k, sd.shape, jnp.float32)).astype(sd.dtype))
        return jax.tree.unflatten(jax.tree.structure(shapes), out)

    return make(key)


def check_params(params: Params, config: ModelConfig) -> None:
    """Raise ValueError naming the first parameter whose shape differs from `config`'s."""
    want = param_shapes(config)
    if is_unstacked(params):
        if len(params["layers"]) != config.num_layers:
            raise ValueError(
                f"params hold {len(params['layers'])} layers, {config.name} has {config.num_layers}"
            )
        params = {
            **params,
            "layers": jax.tree.map(
                lambda *a: jax.ShapeDtypeStruct((len(a), *a[0].shape), a[0].dtype),
                *params["layers"],
            ),
        }
    got_flat = dict(jax.tree.flatten_with_path(params)[0])
    want_flat = dict(jax.tree.flatten_with_path(want)[0])
    if set(got_flat) != set(want_flat):
        missing = sorted(jax.tree_util.keystr(p) for p in set(want_flat) - set(got_flat))
        extra = sorted(jax.tree_util.keystr(p) for p in set(got_flat) - set(want_flat))
        raise ValueError(f"params do not match {config.name}: missing {missing}, extra {extra}")
    for p, sd in want_flat.items():
        if tuple(got_flat[p].shape) != sd.shape:
            raise ValueError(
                f"param {jax.tree_util.keystr(p)} has shape {tuple(got_flat[p].shape)}, "
                f"expected {sd.shape} for {config.name}"
            )


def is_unstacked(params: Params) -> bool:
    """True when params["layers"] is a sequence of per-layer dicts (`unstack_layers`)."""
    return isinstance(params["layers"], tuple | list)


def unstack_layers(params: Params) -> Params:
    """The same params with `layers` as a tuple of L per-layer dicts (arrays without the L axis).

    A no-op on params that are already unstacked. The per-layer arrays are new buffers: the
    caller that wants the memory back drops its reference to the stacked params.
    """
    if is_unstacked(params):
        return params
    layers = params["layers"]
    n = next(iter(layers.values())).shape[0]
    split = {k: [v[i] for i in range(n)] for k, v in layers.items()}
    return {**params, "layers": tuple({k: split[k][i] for k in layers} for i in range(n))}


# The fused matrices (`fuse_projections`): name -> the matrices joined along their output axis.
FUSED = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}


def fuse_projections(params: Params) -> Params:
    """Per-layer params (`unstack_layers`) whose projections of one input are one matrix each:
    wqkv = [wq | wk | wv] [d, (Hq + 2 Hkv) D], bqkv likewise, w_gate_up = [w_gate | w_up]
    [d, 2F] (`FUSED`). At decode batch sizes a GEMM reads its weights once per step whatever its
    width, and narrow ones (k and v: Hkv D columns) read them slower than a wide one; fused, a
    layer runs three GEMMs and launches instead of six. The outputs are the same sums.

    Takes stacked or per-layer params (a no-op where the layers are already fused). Each fused
    matrix is built from the stacked slices directly: one new copy of the weights, as
    `unstack_layers` makes; the caller that wants the memory back drops the old params."""
    layers = params["layers"]
    per_layer = is_unstacked(params)
    first = layers[0] if per_layer else layers
    if any(name in first for name in FUSED):
        return params
    n = len(layers) if per_layer else next(iter(layers.values())).shape[0]
    layer = (lambda i: layers[i]) if per_layer else (lambda i: {k: v[i] for k, v in layers.items()})
    join = jax.jit(lambda *ws: jnp.concatenate(ws, axis=-1))
    out = []
    for i in range(n):
        lp = layer(i)
        fused = {
            name: join(*(lp[p] for p in parts))
            for name, parts in FUSED.items()
            if all(p in lp for p in parts)
        }
        joined = {p for name in fused for p in FUSED[name]}
        out.append({**{k: v for k, v in lp.items() if k not in joined}, **fused})
    return {**params, "layers": tuple(out)}


# The RMSNorm weight whose output each fused matrix reads (`fold_norms`).
NORM_OF = {"wqkv": "attn_norm", "w_gate_up": "mlp_norm"}


def fold_norms(params: Params) -> Params:
    """Fused per-layer params (`fuse_projections`, applied first) with each RMSNorm weight
    folded into the rows of the matrix that reads its output: wqkv <- diag(attn_norm) wqkv,
    w_gate_up <- diag(mlp_norm) w_gate_up (`NORM_OF`), in float32 and rounded once to the
    matrix's dtype; the norm weights are dropped. `normed_projections` then multiplies the
    residual stream itself and scales the float32 outputs by 1 / rms(x).

    Why: rms_norm(x) is a fusion of its own before each GEMM (a reduction, then h written
    out for the GEMM to read); folded, the GEMM reads x and the 1 / rms scale fuses into the
    ops that read the GEMM's output (RoPE, SiLU), two launches per layer fewer in a decode
    step. The sums differ from `rms_norm`'s by roundings of the model dtype: rms_norm rounds
    x / rms and then g x / rms to it, the fold rounds g W once.

    A no-op where the norms are already folded. The final norm stays (the lm_head may be the
    tied embedding table). Returns new per-layer buffers for the folded matrices."""
    params = fuse_projections(params)
    layers = params["layers"]
    if not any(norm in layers[0] for norm in NORM_OF.values()):
        return params
    fold = jax.jit(lambda w, g: (g.astype(jnp.float32)[:, None] * w).astype(w.dtype))
    out = []
    for lp in layers:
        folded = {name: fold(lp[name], lp[norm]) for name, norm in NORM_OF.items()}
        kept = {k: v for k, v in lp.items() if k not in NORM_OF.values()}
        out.append({**kept, **folded})
    return {**params, "layers": tuple(out)}


def decode_params(params: Params) -> Params:
    """The Llama layout to decode with on GPUs: per-layer weights, the projections of one input
    fused (`fuse_projections`), the norms folded into them (`fold_norms`)."""
    return fold_norms(params)


def _split(x: Array, widths: tuple[int, ...]) -> list[Array]:
    """x [..., sum(widths)] -> the pieces of those widths along the last axis."""
    return jnp.split(x, np.cumsum(widths)[:-1].tolist(), axis=-1)


def projections(lp: Params, h: Array, fused: str, widths: tuple[int, ...]) -> list[Array]:
    """h [..., d] times each matrix of FUSED[fused] (float32 [..., width] each): one GEMM of
    lp[fused] split along its columns where the layers are fused, else one GEMM each."""
    if fused in lp:
        return _split(_dense(h, lp[fused]), widths)
    return [_dense(h, lp[p]) for p in FUSED[fused]]


def normed_projections(
    lp: Params, x: Array, fused: str, widths: tuple[int, ...], eps: float
) -> list[Array]:
    """rms_norm(x) times each matrix of FUSED[fused] (float32 [..., width] each), x [..., d]
    the residual stream: through the norm weight NORM_OF[fused] where lp has it, else (norms
    folded, `fold_norms`) the GEMM of x itself with its outputs scaled by 1 / rms(x)."""
    norm = NORM_OF[fused]
    if norm in lp:
        return projections(lp, rms_norm(x, lp[norm], eps), fused, widths)
    inv = _inv_rms(x, eps)
    return [y * inv for y in projections(lp, x, fused, widths)]


def _biases(lp: Params, widths: tuple[int, ...]) -> list[Array]:
    """The q/k/v biases (float32), from bqkv where the layers are fused."""
    if "bqkv" in lp:
        return _split(lp["bqkv"].astype(jnp.float32), widths)
    return [lp[p].astype(jnp.float32) for p in FUSED["bqkv"]]


def stack_layers(params: Params) -> Params:
    """Inverse of `unstack_layers`: `layers` as one dict of [L, ...] arrays."""
    if not is_unstacked(params):
        return params
    layers = params["layers"]
    return {**params, "layers": {k: jnp.stack([lp[k] for lp in layers]) for k in layers[0]}}


def _run_layers(layer, carry, layers):
    """lax.scan of `layer` over stacked layers, or an unrolled loop over per-layer dicts.

    Returns (carry, stacked per-layer outputs or None), as scan does.
    """
    if not isinstance(layers, tuple | list):
        return jax.lax.scan(layer, carry, layers)
    outs = []
    for lp in layers:
        carry, y = layer(carry, lp)
        outs.append(y)
    if outs and outs[0] is not None:
        return carry, jax.tree.map(lambda *a: jnp.stack(a), *outs)
    return carry, None


# ---------------------------------------------------------------------------------------------
# Building blocks.


def _inv_rms(x: Array, eps: float) -> Array:
    """1 / rms(x) over the last axis, float32 [..., 1]."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """RMSNorm in float32, cast back to x.dtype before the weight (as HF Llama does)."""
    xf = x.astype(jnp.float32) * _inv_rms(x, eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def rope_frequencies(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [D/2] (float64 numpy, folded into the program as a constant)."""
    D = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    sc = config.rope_scaling
    if sc is None:
        return inv
    if sc.kind == "linear":
        return inv / sc.factor
    # llama3: long wavelengths slowed by `factor`, short kept, a smooth ramp between.
    low_wl = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wl = sc.original_max_position_embeddings / sc.high_freq_factor
    wl = 2 * np.pi / inv
    smooth = (sc.original_max_position_embeddings / wl - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    mid = (1 - smooth) * inv / sc.factor + smooth * inv
    return np.where(wl > low_wl, inv / sc.factor, np.where(wl < high_wl, inv, mid))


def apply_rope(x: Array, positions: Array, config: ModelConfig) -> Array:
    """Rotate x [..., H, D] at integer `positions` (shape x.shape[:-2]); half-split layout.

    Angles in float32; the rotated halves are (x1 cos - x2 sin, x2 cos + x1 sin), the HF
    `rotate_half` convention (GGUF's interleaved Q/K rows are un-permuted by the loader).
    """
    return rotation.rope(x, positions[..., None], rope_frequencies(config))


def _dense(x: Array, w: Array) -> Array:
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def _qkv(lp: Params, x: Array, config: ModelConfig, positions: Array):
    """q [..., Hq, D], k/v [..., Hkv, D] of the residual stream x [..., d] (attention-normed
    here), RoPE applied."""
    c = config
    widths = (c.num_heads * c.head_dim,) + (c.num_kv_heads * c.head_dim,) * 2
    q, k, v = normed_projections(lp, x, "wqkv", widths, c.rms_norm_eps)
    if c.qkv_bias:
        bq, bk, bv = _biases(lp, widths)
        q, k, v = q + bq, k + bk, v + bv
    dt = x.dtype
    q = q.astype(dt).reshape(*x.shape[:-1], c.num_heads, c.head_dim)
    k = k.astype(dt).reshape(*x.shape[:-1], c.num_kv_heads, c.head_dim)
    v = v.astype(dt).reshape(*x.shape[:-1], c.num_kv_heads, c.head_dim)
    return apply_rope(q, positions, c), apply_rope(k, positions, c), v


def _mlp(lp: Params, x: Array, config: ModelConfig) -> Array:
    widths = (config.intermediate_size,) * 2
    gate, up = normed_projections(lp, x, "w_gate_up", widths, config.rms_norm_eps)
    act = (jax.nn.silu(gate) * up).astype(x.dtype)
    return x + _dense(act, lp["w_down"]).astype(x.dtype)


def _logits(params: Params, x: Array, config: ModelConfig) -> Array:
    """float32 logits [..., V] of final hidden states x [..., d]."""
    h = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    if config.tie_embeddings:
        return jnp.einsum(
            "...d,vd->...v", h, params["embed"].astype(h.dtype), preferred_element_type=jnp.float32
        )
    return _dense(h, params["lm_head"])


def _embed(params: Params, tokens: Array, dtype) -> Array:
    return jnp.take(params["embed"], tokens, axis=0).astype(dtype)


def _model_dtype(params: Params):
    return params["embed"].dtype


def prompt_attention(q: Array, k: Array, v: Array, lengths: Array) -> Array:
    """Causal attention over right-padded prompts: q [B, S, Hq, D], k/v [B, S, Hkv, D].

    cuDNN's fused kernel on GPUs for 16-bit inputs (padding + causal mask), XLA otherwise or when
    cuDNN rejects the configuration at trace time.
    """
    kw = dict(is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
        except Exception:  # noqa: BLE001 - unsupported head dim, cuDNN version, GPU: use XLA
            pass
    return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)


# ---------------------------------------------------------------------------------------------
# Prefill and decode.


def forward(
    params: Params,
    config: ModelConfig,
    tokens: Array,
    lengths: Array,
    *,
    kv_transform: KVTransform | None = None,
) -> tuple[Array, Array, Array]:
    """Causal forward pass over right-padded prompts, no cache.

    tokens [B, S] int32, lengths [B] int32 (positions >= lengths[b] are padding and never
    attended to). Returns (hidden [B, S, d] after the last layer, k, v [L, B, Hkv, S, D]
    post-RoPE and untransformed). kv_transform, if given, maps each layer's (k, v)
    [B, Hkv, S, D] to what the prompt attention sees.
    """
    c = config
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, S] int32, got shape {tokens.shape}")
    B, S = tokens.shape
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B]={B}, got shape {lengths.shape}")
    dtype = _model_dtype(params)
    x = _embed(params, tokens, dtype)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    lengths = lengths.astype(jnp.int32)

    def layer(x, lp):
        q, k, v = _qkv(lp, x, c, positions)  # [B, S, H, D]
        ka, va = k, v
        if kv_transform is not None:
            kt, vt = kv_transform(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
            ka, va = kt.transpose(0, 2, 1, 3).astype(dtype), vt.transpose(0, 2, 1, 3).astype(dtype)
        o = prompt_attention(q, ka, va, lengths)
        # Padding query rows have no valid key only when lengths[b] == 0; keep them finite.
        o = jnp.where(jnp.isfinite(o), o, 0).astype(dtype)
        x = x + _dense(o.reshape(B, S, -1), lp["wo"]).astype(dtype)
        x = _mlp(lp, x, c)
        return x, (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))

    x, (ks, vs) = _run_layers(layer, x, params["layers"])
    return x, ks, vs


def prefill(
    params: Params,
    config: ModelConfig,
    tokens: Array,
    lengths: Array,
    cache,
    *,
    all_logits: bool = False,
    kv_transform: KVTransform | None = None,
):
    """Run the prompts and fill `cache` with their post-RoPE K/V.

    tokens [B, S] int32 right-padded, lengths [B] int32 (1 <= lengths <= S). Returns
    (logits, cache): logits float32 [B, V] at position lengths-1, or [B, S, V] when all_logits.
    `cache` may be None (logits only; the cache returned is None). The cache receives the
    untransformed K/V even when kv_transform is given.
    """
    x, ks, vs = forward(params, config, tokens, lengths, kv_transform=kv_transform)
    if cache is not None:
        cache = cache.prefill(ks.astype(cache.dtype), vs.astype(cache.dtype), lengths)
    if all_logits:
        return _logits(params, x, config), cache
    last = jnp.clip(lengths.astype(jnp.int32) - 1, 0, tokens.shape[1] - 1)
    xl = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    return _logits(params, xl, config), cache


def _chunk_hidden(params, config, tokens, counts, cache, implementation):
    """One chunk through every layer: tokens [B, C] at positions cache.lengths + i, attending
    to the cache and causally to the chunk (`chunk_attention`); then the chunk is appended
    (`extend`). Returns (hidden [B, C, d] after the last layer, cache)."""
    c = config
    dtype = _model_dtype(params)
    x = _embed(params, tokens, dtype)
    B, C = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(C, dtype=jnp.int32)

    def layer(x, xs):
        lp, l = xs
        q, k, v = _qkv(lp, x, c, positions)  # [B, C, H, D]
        k, v = k.astype(cache.dtype), v.astype(cache.dtype)
        o = chunk_attention(q, k, v, counts, cache, l, implementation=implementation)
        x = x + _dense(o.reshape(B, C, -1), lp["wo"]).astype(dtype)
        x = _mlp(lp, x, c)
        return x, (k.swapaxes(1, 2), v.swapaxes(1, 2))

    layers = params["layers"]
    if isinstance(layers, tuple | list):
        outs = []
        for i, lp in enumerate(layers):
            x, kv = layer(x, (lp, i))
            outs.append(kv)
        ks, vs = (jnp.stack(a) for a in zip(*outs, strict=True))
    else:
        n = jax.tree.leaves(layers)[0].shape[0]
        x, (ks, vs) = jax.lax.scan(layer, x, (layers, jnp.arange(n, dtype=jnp.int32)))
    return x, cache.extend(ks, vs, counts)


def _check_chunked(tokens: Array, chunk) -> None:
    """The arguments `prefill_chunked` and `append_chunked` share."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, S] int32, got shape {tokens.shape}")


def prefill_chunked(
    params: Params,
    config: ModelConfig,
    tokens: Array,
    lengths: Array,
    cache,
    *,
    chunk: int,
    implementation: str = "auto",
):
    """`prefill` through the cache, `chunk` tokens at a time: each chunk attends to what the
    cache holds (quantized tokens and the residual window, as decode does) and exactly,
    causally, to itself, then is appended as streaming would append it. Peak memory is the
    cache plus one chunk's activations, whatever the prompt length.

    tokens [B, S] right-padded, lengths [B] (1 <= lengths <= S), `cache` empty (rows holding
    no token). Returns (logits float32 [B, V] at position lengths - 1, cache). The chunks run
    in a `lax.fori_loop`: one compiled chunk step for any S. implementation: that of
    `kivi_jax.attention.chunk_attention`. A chunk of S or more is `prefill` itself.
    """
    _check_chunked(tokens, chunk)
    if chunk >= tokens.shape[1]:  # one chunk is the whole prompt: the one-piece prefill
        return prefill(params, config, tokens, lengths, cache)
    return append_chunked(
        params, config, tokens, lengths, cache, chunk=chunk, implementation=implementation
    )


def append_chunked(
    params: Params,
    config: ModelConfig,
    tokens: Array,
    counts: Array,
    cache,
    *,
    chunk: int,
    implementation: str = "auto",
):
    """Feed tokens [B, S] (right-padded, counts [B] of them per row, 0 <= counts <= S) after
    what each row of `cache` holds, `chunk` at a time, as `prefill_chunked` does (a chunk of 1
    is decode, teacher-forced). Returns (logits float32 [B, V] at each row's last new token,
    zeros for rows given none, cache)."""
    _check_chunked(tokens, chunk)
    B, S = tokens.shape
    if counts.shape != (B,):
        raise ValueError(f"counts must be [B]={B}, got shape {counts.shape}")
    n_chunks = -(-S // chunk)
    tokens = jnp.pad(tokens, ((0, 0), (0, n_chunks * chunk - S)))
    counts = counts.astype(jnp.int32)

    def body(j, carry):
        logits, cache = carry
        start = j * chunk
        toks = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        here_counts = jnp.clip(counts - start, 0, chunk)
        x, cache = _chunk_hidden(params, config, toks, here_counts, cache, implementation)
        last = counts - 1 - start  # the row's last new token, if in this chunk
        xl = jnp.take_along_axis(x, jnp.clip(last, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
        here = (last >= 0) & (last < chunk)
        return jnp.where(here[:, None], _logits(params, xl, config), logits), cache

    logits = jnp.zeros((B, config.vocab_size), jnp.float32)
    return jax.lax.fori_loop(0, n_chunks, body, (logits, cache))


def decode_step(
    params: Params,
    config: ModelConfig,
    tokens: Array,
    cache,
    *,
    implementation: str = "reference",
):
    """Feed one token per row at position cache.lengths: advance, write K/V, attend.

    tokens [B] int32. Returns (logits float32 [B, V], cache). Every row advances (finished
    rows are ignored by the caller).
    """
    c = config
    if tokens.shape != (cache.batch,):
        raise ValueError(f"tokens must be [B]={cache.batch} int32, got shape {tokens.shape}")
    dtype = _model_dtype(params)
    cache = cache.advance()
    positions = cache.lengths - 1  # [B]
    x = _embed(params, tokens, dtype)  # [B, d]
    B = x.shape[0]

    def layer(carry, xs):
        x, cache = carry
        lp, l = xs
        q, k, v = _qkv(lp, x, c, positions)  # [B, H, D]
        cache = cache.write(l, k.astype(cache.dtype), v.astype(cache.dtype))
        o = decode_attention(q, cache, l, implementation=implementation)
        x = x + _dense(o.reshape(B, -1), lp["wo"]).astype(dtype)
        x = _mlp(lp, x, c)
        return (x, cache), None

    layers = params["layers"]
    if isinstance(layers, tuple | list):  # unrolled: each layer's index a Python int, which a
        # per-layer cache needs to pick its buffer
        carry = (x, cache)
        for i, lp in enumerate(layers):
            carry, _ = layer(carry, (lp, i))
        x, cache = carry
    else:
        n = jax.tree.leaves(layers)[0].shape[0]
        (x, cache), _ = jax.lax.scan(layer, (x, cache), (layers, jnp.arange(n, dtype=jnp.int32)))
    return _logits(params, x, config), cache


# ---------------------------------------------------------------------------------------------
# Flax NNX module: the same model as an object, for interactive use. Its state is the params
# pytree above; jitted code always takes the pure dict (split once, never re-traced per call).


class Llama(nnx.Module):
    """A Llama-family decoder holding its params as `nnx.Param`s (stacked per layer).

    `Llama(config, rngs=nnx.Rngs(0))` initializes randomly; `Llama.from_params(config, p)` wraps
    loaded weights. `model.params()` gives the pure dict that `prefill`/`decode_step` take.
    Its own `decode_step` scans the stacked weights; a decode loop on a GPU should take
    `models.generate.decode_layout(model.params(), model.config)` once and call `decode_step`
    with that (per-layer weights: module docstring), as `generate` does.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs | None = None,
        dtype=jnp.float32,
        params: Params | None = None,
    ):
        self.config = config
        if params is None:
            rngs = rngs if rngs is not None else nnx.Rngs(0)
            params = init_params(config, rngs.params(), dtype)
        check_params(params, config)
        self.embed = nnx.Param(params["embed"])
        self.final_norm = nnx.Param(params["final_norm"])
        self.layers = nnx.Dict({k: nnx.Param(v) for k, v in params["layers"].items()})
        self.lm_head = nnx.Param(params["lm_head"]) if "lm_head" in params else None

    @classmethod
    def from_params(cls, config: ModelConfig, params: Params) -> Llama:
        return cls(config, params=params)

    def params(self) -> Params:
        out = dict(
            embed=self.embed.value,
            final_norm=self.final_norm.value,
            layers={k: v.value for k, v in self.layers.items()},
        )
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head.value
        return out

    def __call__(self, tokens: Array, lengths: Array, cache=None, **kw):
        return prefill(self.params(), self.config, tokens, lengths, cache, **kw)

    def decode_step(self, tokens: Array, cache, **kw):
        return decode_step(self.params(), self.config, tokens, cache, **kw)
