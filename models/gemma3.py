"""Gemma 3 (text) as pure functions of a params pytree, with its KV cache: a ring of the sliding
window for the local layers and a kivi_jax cache (KIVI or dense) for the global ones.

Shape letters as in models/llama.py: B batch, S prompt length, T cache length, V vocab, d hidden,
F MLP width, Hq/Hkv heads, D head dim, L layers; W the sliding window, Lg / Ll the numbers of
global / local layers.

The architecture (Gemma 3 technical report; Hugging Face `Gemma3ForCausalLM`, which the parity
test checks against): token embeddings scaled by sqrt(d); in every layer RMSNorm before and after
attention and before and after the MLP (RMSNorm multiplies by 1 + weight, in float32); RMSNorm of
every query and key head (over D) before RoPE; a GeGLU MLP (gelu, tanh approximation); softmax
scale query_pre_attn_scalar ** -0.5. Layers alternate `sliding_window_pattern - 1` local layers
(attending to the newest W positions, themselves included; RoPE base rope_local_theta) and one
global layer (every position; RoPE base rope_theta, linearly scaled by rope_scaling_factor).
Logit soft-capping (cap * tanh(x / cap)) applies to attention logits and final logits when the
config sets it (Gemma 2 does; Gemma 3 does not). Output embeddings are tied.

Params are a plain dict; layers are a tuple of L per-layer dicts (the layout `models.llama`
decodes with on GPUs; the local and global layers differ in their caches, so the loop over them
is unrolled):

    embed        [V, d]
    layers[i]    attn_norm [d], wq [d, Hq*D], wk/wv [d, Hkv*D], wo [Hq*D, d], q_norm/k_norm [D],
                 post_attn_norm [d], mlp_norm [d], w_gate/w_up [d, F], w_down [F, d],
                 post_mlp_norm [d]
    final_norm   [d]

Norm weights are stored as Gemma stores them (the layer multiplies by 1 + weight).

What the cache does with the two kinds of layer (`Gemma3Cache`): a local layer never looks
further back than W tokens, so it keeps exactly its newest W keys and values, in full precision,
in a ring of W slots (position p in slot p mod W): 512 tokens for Gemma 3 270M, whatever the
context. Quantizing it would save little (it is a fixed, small buffer) and would touch the
tokens every local layer attends to most. The global layers hold the whole context: they take
the KIVI cache (or the dense one, the baseline), through `kivi_jax.make_cache` and
`kivi_jax.decode_attention` exactly as `models.llama` uses them. `cache_memory` gives the bytes
of both parts.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

import kivi_jax
from kivi_jax import decode_attention, rotation
from models.llama import fuse_projections, projections

Params = dict
static = dict(static=True)


# ---------------------------------------------------------------------------------------------
# Configuration.


def _positive_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool) and x > 0


def _positive_float(x) -> bool:
    return (
        isinstance(x, int | float | np.number)
        and not isinstance(x, bool)
        and math.isfinite(x)
        and x > 0
    )


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
    """Static architecture of a Gemma 3 text decoder. Frozen and hashable (a jit static arg).

    Layer i is global when (i + 1) % sliding_window_pattern == 0, local otherwise (Gemma 3:
    pattern 6, five local layers then one global). sliding_window W: a local layer's query at
    position p attends to positions (p - W, p]. query_pre_attn_scalar: the softmax scale is its
    inverse square root. rope_scaling_factor: linear RoPE scaling of the global layers (1.0:
    none; Gemma 3 4B and larger use 8). attn_logit_softcapping / final_logit_softcapping: None
    or the cap. Raises ValueError naming the field for any invalid value.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    rope_theta: float = 1_000_000.0
    rope_local_theta: float = 10_000.0
    rope_scaling_factor: float = 1.0
    query_pre_attn_scalar: float = 256.0
    rms_norm_eps: float = 1e-6
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 32768

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise ValueError(f"Gemma3Config.name must be a str, got {self.name!r}")
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "sliding_window",
            "sliding_window_pattern",
            "max_position_embeddings",
        ):
            v = getattr(self, f)
            if not _positive_int(v):
                raise ValueError(f"Gemma3Config.{f} must be a positive int, got {v!r}")
        for f in ("rope_theta", "rope_local_theta", "rope_scaling_factor", "query_pre_attn_scalar"):
            v = getattr(self, f)
            if not _positive_float(v):
                raise ValueError(f"Gemma3Config.{f} must be a finite number > 0, got {v!r}")
        eps = self.rms_norm_eps
        if not (_positive_float(eps) or (isinstance(eps, int | float) and eps == 0)):
            raise ValueError(f"Gemma3Config.rms_norm_eps must be a finite number >= 0, got {eps!r}")
        for f in ("attn_logit_softcapping", "final_logit_softcapping"):
            v = getattr(self, f)
            if v is not None and not _positive_float(v):
                raise ValueError(f"Gemma3Config.{f} must be None or a finite number > 0, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Gemma3Config.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"Gemma3Config.head_dim must be even (rotary pairs), got {self.head_dim}"
            )

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_window_pattern == 0

    @property
    def global_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_global(i))

    @property
    def local_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if not self.is_global(i))

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    def num_params(self) -> int:
        """Parameter count (embeddings tied, counted once)."""
        d, f, dh = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * dh, self.num_kv_heads * dh
        layer = 2 * d * q + 2 * d * kv + 3 * d * f + 4 * d + 2 * dh
        return self.num_layers * layer + self.vocab_size * d + d

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """Bytes of one token's K and V over all layers in a dense cache (no window)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


# Gemma 3 270M, as `google/gemma-3-270m` (and its GGUF) declare it.
GEMMA3_270M = Gemma3Config(
    name="gemma3-270m",
    vocab_size=262144,
    hidden_size=640,
    intermediate_size=2048,
    num_layers=18,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    sliding_window=512,
    sliding_window_pattern=6,
    rope_theta=1_000_000.0,
    rope_local_theta=10_000.0,
    query_pre_attn_scalar=256.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
)


# ---------------------------------------------------------------------------------------------
# Parameters.


def param_shapes(config: Gemma3Config, dtype=jnp.float32) -> Params:
    """The params pytree as `jax.ShapeDtypeStruct`s."""
    c = config
    d, F, D = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_heads * D, c.num_kv_heads * D
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    layer = lambda: dict(
        attn_norm=s(d),
        wq=s(d, q),
        wk=s(d, kv),
        wv=s(d, kv),
        wo=s(q, d),
        q_norm=s(D),
        k_norm=s(D),
        post_attn_norm=s(d),
        mlp_norm=s(d),
        w_gate=s(d, F),
        w_up=s(d, F),
        w_down=s(F, d),
        post_mlp_norm=s(d),
    )
    return dict(
        embed=s(c.vocab_size, d),
        layers=tuple(layer() for _ in range(c.num_layers)),
        final_norm=s(d),
    )


def init_params(
    config: Gemma3Config, key: Array, dtype=jnp.float32, norm_std: float = 0.0
) -> Params:
    """Random params (normal, std 1/sqrt(fan_in); embeddings std 1/sqrt(d), as the sqrt(d)
    scaling of the input expects; norm weights normal with std norm_std, 0 = identity)."""
    shapes = param_shapes(config, dtype)
    leaves, treedef = jax.tree.flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, sd), k in zip(leaves, keys, strict=True):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            w = norm_std * jax.random.normal(k, sd.shape, jnp.float32)
        else:
            fan_in = sd.shape[-1] if "embed" in name else sd.shape[-2]
            w = jax.random.normal(k, sd.shape, jnp.float32) / math.sqrt(fan_in)
        out.append(w.astype(sd.dtype))
    return jax.tree.unflatten(treedef, out)


def check_params(params: Params, config: Gemma3Config) -> None:
    """Raise ValueError naming the first parameter whose path or shape differs from config's."""
    want = param_shapes(config)
    if not isinstance(params, dict) or not isinstance(params.get("layers"), tuple | list):
        raise ValueError("params must be a dict whose 'layers' is a tuple of per-layer dicts")
    if len(params["layers"]) != config.num_layers:
        raise ValueError(
            f"params hold {len(params['layers'])} layers, {config.name} has {config.num_layers}"
        )
    params = {**params, "layers": tuple(params["layers"])}
    got_flat = dict(jax.tree.flatten_with_path(params)[0])
    want_flat = dict(jax.tree.flatten_with_path(want)[0])
    if set(got_flat) != set(want_flat):
        missing = sorted(jax.tree_util.keystr(p) for p in set(want_flat) - set(got_flat))
        extra = sorted(jax.tree_util.keystr(p) for p in set(got_flat) - set(want_flat))
        raise ValueError(
            f"params do not match {config.name}: missing {missing[:5]}, extra {extra[:5]}"
        )
    for p, sd in want_flat.items():
        if tuple(got_flat[p].shape) != sd.shape:
            raise ValueError(
                f"param {jax.tree_util.keystr(p)} has shape {tuple(got_flat[p].shape)}, "
                f"expected {sd.shape} for {config.name}"
            )


def decode_params(params: Params) -> Params:
    """The layout to decode with on GPUs: the projections of one input fused
    (`models.llama.fuse_projections`). Its norms are not folded (`models.llama.fold_norms`
    knows Llama's plain weights; Gemma's multiply by 1 + w, and q/k norms follow the GEMM)."""
    return fuse_projections(params)


# ---------------------------------------------------------------------------------------------
# Building blocks.


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in float32, cast back to x.dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def rope_frequencies(config: Gemma3Config, is_global: bool) -> np.ndarray:
    """Inverse frequencies [D/2] of a global or local layer (float64 numpy)."""
    D = config.head_dim
    theta = config.rope_theta if is_global else config.rope_local_theta
    inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    return inv / config.rope_scaling_factor if is_global else inv


def apply_rope(x: Array, positions: Array, inv_freq: np.ndarray) -> Array:
    """Rotate x [..., H, D] at `positions` (shape x.shape[:-2]); half-split (HF) layout
    (`kivi_jax.rotation.rope`)."""
    return rotation.rope(x, positions[..., None], inv_freq)


def _dense(x: Array, w: Array) -> Array:
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def _softcap(x: Array, cap: float | None) -> Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


def _qkv(lp: Params, h: Array, config: Gemma3Config, positions: Array, is_global: bool):
    """q [..., Hq, D], k/v [..., Hkv, D] for normed hidden states h [..., d]: projections,
    per-head RMSNorm of q and k, then RoPE with the layer's base."""
    c = config
    dt = h.dtype
    widths = (c.num_heads * c.head_dim,) + (c.num_kv_heads * c.head_dim,) * 2
    q, k, v = projections(lp, h, "wqkv", widths)
    q = q.astype(dt).reshape(*h.shape[:-1], c.num_heads, c.head_dim)
    k = k.astype(dt).reshape(*h.shape[:-1], c.num_kv_heads, c.head_dim)
    v = v.astype(dt).reshape(*h.shape[:-1], c.num_kv_heads, c.head_dim)
    q = rms_norm(q, lp["q_norm"], c.rms_norm_eps)
    k = rms_norm(k, lp["k_norm"], c.rms_norm_eps)
    inv = rope_frequencies(c, is_global)
    return apply_rope(q, positions, inv), apply_rope(k, positions, inv), v


def _attn_out(lp: Params, x: Array, o: Array, config: Gemma3Config) -> Array:
    """x + post_attn_norm(o @ wo), o [..., Hq, D]."""
    y = _dense(o.reshape(*o.shape[:-2], -1), lp["wo"]).astype(x.dtype)
    return x + rms_norm(y, lp["post_attn_norm"], config.rms_norm_eps)


def _mlp(lp: Params, x: Array, config: Gemma3Config) -> Array:
    h = rms_norm(x, lp["mlp_norm"], config.rms_norm_eps)
    gate, up = projections(lp, h, "w_gate_up", (config.intermediate_size,) * 2)
    act = (jax.nn.gelu(gate, approximate=True) * up).astype(x.dtype)
    y = _dense(act, lp["w_down"]).astype(x.dtype)
    return x + rms_norm(y, lp["post_mlp_norm"], config.rms_norm_eps)


def _embed(params: Params, tokens: Array, config: Gemma3Config) -> Array:
    dtype = params["embed"].dtype
    # HF casts the normalizer to the embedding dtype before the product; so do we.
    normalizer = jnp.asarray(math.sqrt(config.hidden_size), dtype)
    return jnp.take(params["embed"], tokens, axis=0) * normalizer


def _logits(params: Params, x: Array, config: Gemma3Config) -> Array:
    """float32 logits [..., V] of final hidden states x [..., d] (tied embeddings)."""
    h = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    logits = jnp.einsum(
        "...d,vd->...v", h, params["embed"].astype(h.dtype), preferred_element_type=jnp.float32
    )
    return _softcap(logits, config.final_logit_softcapping)


def prompt_attention(
    q: Array, k: Array, v: Array, lengths: Array, config: Gemma3Config, is_global: bool
) -> Array:
    """Causal attention over right-padded prompts, q [B, S, Hq, D], k/v [B, S, Hkv, D]; a local
    layer sees the newest W positions (itself included). Float32 math; returns q.dtype."""
    c = config
    window = None if is_global else (c.sliding_window - 1, 0)
    if c.attn_logit_softcapping is None:
        kw = dict(
            scale=c.scale,
            is_causal=True,
            query_seq_lengths=lengths,
            key_value_seq_lengths=lengths,
            local_window_size=window,
        )
        if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
            try:
                return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
            except Exception:  # noqa: BLE001 - unsupported configuration: use XLA
                pass
        return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
    B, S, Hq, D = q.shape
    i = jnp.arange(S)
    mask = (i[None, :] <= i[:, None])[None] & (i[None, None, :] < lengths[:, None, None])
    if not is_global:
        mask = mask & (i[:, None] - i[None, :] < c.sliding_window)[None]
    qg = q.astype(jnp.float32).reshape(B, S, c.num_kv_heads, c.q_per_kv, D) * c.scale
    s = jnp.einsum("bsgqd,btgd->bgqst", qg, k.astype(jnp.float32))
    s = _softcap(s, c.attn_logit_softcapping)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(jnp.isnan(p), 0.0, p)  # rows with no key at all (lengths 0)
    o = jnp.einsum("bgqst,btgd->bsgqd", p, v.astype(jnp.float32))
    return o.reshape(B, S, Hq, D).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# The cache: a ring per local layer, a kivi_jax cache for the global layers.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Gemma3Cache:
    """KV cache of a Gemma 3 model (module docstring: why the two parts).

    Decode protocol as kivi_jax's caches: `advance()` once per step, then per layer
    `write_local(j, k, v)` or `global_cache.write(g, k, v)` (g, j: the layer's index among
    the global / local layers), then attention over [0, lengths) (local: the newest W of those).
    """

    global_cache: kivi_jax.KiviCache | kivi_jax.DenseCache | None  # Lg layers, max_len tokens
    local_k: Array  # [Ll, B, W, Hkv, D]: position p in slot p % W
    local_v: Array  # [Ll, B, W, Hkv, D]
    lengths: Array  # [B] int32: tokens seen per row
    max_len: int = dataclasses.field(metadata=static)

    window = property(lambda self: self.local_k.shape[2])
    batch = property(lambda self: self.lengths.shape[0])
    dtype = property(lambda self: self.local_k.dtype)

    @staticmethod
    def init(
        name: str,
        config: Gemma3Config,
        *,
        batch: int,
        max_len: int,
        dtype=jnp.bfloat16,
        **cache_kw,
    ) -> Gemma3Cache:
        """An empty cache: `name` one of kivi_jax.CACHE_NAMES for the global layers ("fp16":
        dense), rings of min(W, max_len) slots in `dtype` for the local layers. `cache_kw`
        (group_size, residual_length, per_layer, sinks, rotation, outlier_channels) go to
        `kivi_jax.make_cache` (the global layers' cache; the rings stay exact)."""
        c = config
        if not _positive_int(batch) or not _positive_int(max_len):
            raise ValueError(f"batch and max_len must be positive ints, got {batch!r}, {max_len!r}")
        glob = None
        if c.global_layers:
            glob = kivi_jax.make_cache(
                name,
                num_layers=len(c.global_layers),
                batch=batch,
                kv_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                max_len=max_len,
                dtype=dtype,
                rope_frequencies=rope_frequencies(c, is_global=True),
                **cache_kw,
            )
        else:  # validates the name and knobs
            kivi_jax.cache_config(name, **{k: v for k, v in cache_kw.items() if k != "per_layer"})
        w = min(c.sliding_window, max_len)
        ring = (len(c.local_layers), batch, w, c.num_kv_heads, c.head_dim)
        return Gemma3Cache(
            glob,
            jnp.zeros(ring, dtype),
            jnp.zeros(ring, dtype),
            jnp.zeros((batch,), jnp.int32),
            int(max_len),
        )

    @property
    def overflowed(self) -> Array:
        return self.lengths > self.max_len

    def advance(self) -> Gemma3Cache:
        """Start a decode step: lengths += 1 (the global cache's too; capacity policy its own,
        `kivi_jax.cache`: outside jit a row past max_len raises ValueError)."""
        new = self.lengths + 1
        if self.global_cache is None and not isinstance(new, jax.core.Tracer):
            if bool(jnp.any(new > self.max_len)):
                raise ValueError(f"cache is full: max_len={self.max_len}")
        glob = None if self.global_cache is None else self.global_cache.advance()
        return dataclasses.replace(self, global_cache=glob, lengths=new)

    def write_local(self, j: int, k: Array, v: Array) -> Gemma3Cache:
        """Store the new token k, v [B, Hkv, D] of local layer j at position lengths - 1."""
        pos = self.lengths - 1
        valid = (pos >= 0) & (pos < self.max_len)
        slot = jnp.where(valid, pos % self.window, self.window)  # out of range: dropped
        b = jnp.arange(self.batch)
        return dataclasses.replace(
            self,
            local_k=self.local_k.at[j, b, slot].set(k.astype(self.dtype), mode="drop"),
            local_v=self.local_v.at[j, b, slot].set(v.astype(self.dtype), mode="drop"),
        )

    def prefill(self, k_local, v_local, k_global, v_global, lengths: Array) -> Gemma3Cache:
        """Replace the contents with prompts of `lengths` [B] tokens: k/v_local [Ll, B, Hkv, S, D]
        (each row's newest W positions go to the rings), k/v_global [Lg, B, Hkv, S, D] (or None
        without global layers) to the global cache's prefill."""
        S = k_local.shape[3]
        if S > self.max_len:
            raise ValueError(f"prompt length S={S} exceeds the cache's max_len={self.max_len}")
        lengths = lengths.astype(jnp.int32)
        glob = self.global_cache
        if glob is not None:
            glob = glob.prefill(k_global.astype(glob.dtype), v_global.astype(glob.dtype), lengths)
        t = jnp.arange(S)[None, :]
        keep = (t < lengths[:, None]) & (t >= lengths[:, None] - self.window)  # [B, S]
        slot = jnp.where(keep, t % self.window, self.window)
        b = jnp.arange(self.batch)[:, None]

        def ring(x):  # [Ll, B, Hkv, S, D] -> [Ll, B, W, Hkv, D]
            x = x.swapaxes(2, 3).astype(self.dtype)
            return jnp.zeros_like(self.local_k).at[:, b, slot].set(x, mode="drop")

        return dataclasses.replace(
            self,
            global_cache=glob,
            local_k=ring(k_local),
            local_v=ring(v_local),
            lengths=glob.lengths if glob is not None else lengths,
        )

    def nbytes(self) -> dict[str, int]:
        """Bytes held: {"local": the rings, "global": the global cache, "total"}."""
        local = self.local_k.nbytes + self.local_v.nbytes + self.lengths.nbytes
        glob = 0 if self.global_cache is None else self.global_cache.nbytes().total
        return {"local": local, "global": glob, "total": local + glob}


def _tree_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def cache_memory(
    name: str,
    config: Gemma3Config,
    *,
    batch: int,
    max_len: int,
    dtype=jnp.bfloat16,
    **cache_kw,
) -> dict[str, int]:
    """Bytes of a `Gemma3Cache` of these dimensions (`cache_kw` as `Gemma3Cache.init` takes
    them), without allocating it:

    local: the rings of the local layers (full precision, W slots each); global: the global
    layers' cache (`name`: KIVI or "fp16"); total: their sum; dense_no_window: every layer
    holding all max_len tokens densely in `dtype` (what a cache that ignored the window would
    take, the reference for the ratio).
    """
    shapes = jax.eval_shape(
        lambda: Gemma3Cache.init(
            name, config, batch=batch, max_len=max_len, dtype=dtype, **cache_kw
        )
    )
    local = _tree_bytes((shapes.local_k, shapes.local_v, shapes.lengths))
    glob = 0 if shapes.global_cache is None else _tree_bytes(shapes.global_cache)
    itemsize = jnp.dtype(dtype).itemsize
    return {
        "local": local,
        "global": glob,
        "total": local + glob,
        "dense_no_window": batch * max_len * config.kv_bytes_per_token(itemsize),
    }


def _local_attention(q: Array, k: Array, v: Array, n: Array, config: Gemma3Config) -> Array:
    """One query per row over a ring: q [B, Hq, D], k/v [B, W, Hkv, D], n [B] valid slots
    (slots [0, n) hold the row's newest min(lengths, W) tokens, order irrelevant after RoPE)."""
    c = config
    B, Hq, D = q.shape
    qg = q.astype(jnp.float32).reshape(B, c.num_kv_heads, c.q_per_kv, D) * c.scale
    s = jnp.einsum("bgqd,btgd->bgqt", qg, k.astype(jnp.float32))
    s = _softcap(s, c.attn_logit_softcapping)
    valid = jnp.arange(k.shape[1])[None, :] < n[:, None]  # [B, W]
    s = jnp.where(valid[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bgqt,btgd->bgqd", p, v.astype(jnp.float32))
    return o.reshape(B, Hq, D).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# Prefill and decode.


def forward(
    params: Params, config: Gemma3Config, tokens: Array, lengths: Array, *, kv_transform=None
):
    """Causal forward pass over right-padded prompts, no cache.

    tokens [B, S] int32, lengths [B] (positions >= lengths[b] are padding, never attended to).
    Returns (hidden [B, S, d] after the last layer, per-layer k, v: tuples of L arrays
    [B, Hkv, S, D], post-RoPE and untransformed). kv_transform, if given, maps each global
    layer's (k, v) [B, Hkv, S, D] to what its prompt attention sees (`models.llama.forward`'s
    hook, for the simulated perplexity protocol; the local layers keep exact K/V, as their
    rings do).
    """
    c = config
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, S] int32, got shape {tokens.shape}")
    B, S = tokens.shape
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B]={B}, got shape {lengths.shape}")
    if len(params["layers"]) != c.num_layers:
        raise ValueError(f"params hold {len(params['layers'])} layers, config {c.num_layers}")
    lengths = lengths.astype(jnp.int32)
    dtype = params["embed"].dtype
    x = _embed(params, tokens, c)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    ks, vs = [], []
    for i, lp in enumerate(params["layers"]):
        g = c.is_global(i)
        h = rms_norm(x, lp["attn_norm"], c.rms_norm_eps)
        q, k, v = _qkv(lp, h, c, positions, g)  # [B, S, H, D]
        ka, va = k, v
        if g and kv_transform is not None:
            kt, vt = kv_transform(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
            ka, va = kt.transpose(0, 2, 1, 3).astype(dtype), vt.transpose(0, 2, 1, 3).astype(dtype)
        o = prompt_attention(q, ka, va, lengths, c, g)
        o = jnp.where(jnp.isfinite(o), o, 0).astype(dtype)  # rows of length 0
        x = _attn_out(lp, x, o, c)
        x = _mlp(lp, x, c)
        ks.append(k.transpose(0, 2, 1, 3))
        vs.append(v.transpose(0, 2, 1, 3))
    return x, tuple(ks), tuple(vs)


def prefill(
    params: Params,
    config: Gemma3Config,
    tokens: Array,
    lengths: Array,
    cache: Gemma3Cache | None,
    *,
    all_logits: bool = False,
    kv_transform=None,
):
    """Run the prompts and fill `cache` (None: logits only). tokens [B, S] right-padded,
    lengths [B] (1 <= lengths <= S). Returns (logits float32 [B, V] at position lengths - 1,
    or [B, S, V] with all_logits; cache). kv_transform: as `forward`'s (the cache receives the
    untransformed K/V)."""
    c = config
    x, ks, vs = forward(params, c, tokens, lengths, kv_transform=kv_transform)
    if cache is not None:

        def stack(xs, idx):  # [n, B, Hkv, S, D] of the layers in idx
            return jnp.stack([xs[i] for i in idx]) if idx else jnp.zeros((0, *xs[0].shape))

        cache = cache.prefill(
            stack(ks, c.local_layers),
            stack(vs, c.local_layers),
            stack(ks, c.global_layers),
            stack(vs, c.global_layers),
            lengths,
        )
    if all_logits:
        return _logits(params, x, c), cache
    last = jnp.clip(lengths.astype(jnp.int32) - 1, 0, tokens.shape[1] - 1)
    xl = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    return _logits(params, xl, c), cache


def decode_step(
    params: Params,
    config: Gemma3Config,
    tokens: Array,
    cache: Gemma3Cache,
    *,
    implementation: str = "reference",
):
    """Feed one token per row at position cache.lengths: advance, write K/V, attend.

    tokens [B] int32. Returns (logits float32 [B, V], cache). Global layers attend through
    `kivi_jax.decode_attention(..., implementation=implementation)`, local layers over their
    rings. Raises NotImplementedError for attention soft-capping with global layers (the
    kivi_jax attention has no cap).
    """
    c = config
    if tokens.shape != (cache.batch,):
        raise ValueError(f"tokens must be [B]={cache.batch} int32, got shape {tokens.shape}")
    if c.attn_logit_softcapping is not None and c.global_layers:
        raise NotImplementedError(
            "attention logit soft-capping in global layers: kivi_jax.decode_attention has no cap"
        )
    cache = cache.advance()
    positions = cache.lengths - 1
    x = _embed(params, tokens, c)
    dtype = x.dtype
    n_local = jnp.minimum(cache.lengths, cache.window)
    gi = {layer: j for j, layer in enumerate(c.global_layers)}
    li = {layer: j for j, layer in enumerate(c.local_layers)}
    for i, lp in enumerate(params["layers"]):
        g = c.is_global(i)
        h = rms_norm(x, lp["attn_norm"], c.rms_norm_eps)
        q, k, v = _qkv(lp, h, c, positions, g)  # [B, H, D]
        if g:
            glob = cache.global_cache.write(gi[i], k.astype(cache.dtype), v.astype(cache.dtype))
            cache = dataclasses.replace(cache, global_cache=glob)
            o = decode_attention(q, glob, gi[i], implementation=implementation, scale=c.scale)
        else:
            j = li[i]
            cache = cache.write_local(j, k, v)
            o = _local_attention(q, cache.local_k[j], cache.local_v[j], n_local, c)
        x = _attn_out(lp, x, o.astype(dtype), c)
        x = _mlp(lp, x, c)
    return _logits(params, x, c), cache


def greedy_generate(
    params: Params,
    config: Gemma3Config,
    prompt: Array,
    steps: int,
    cache: Gemma3Cache,
    *,
    implementation: str = "reference",
) -> tuple[Array, Gemma3Cache]:
    """Greedy tokens [B, steps] after prompts [B, S] (all rows of length S), the first from
    prefill, the rest one decode step each, in one jitted `lax.scan` (compiled once per
    config, shapes, steps and implementation)."""
    if not _positive_int(steps):
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    B, S = prompt.shape
    lengths = jnp.full((B,), S, jnp.int32)
    return _greedy(params, config, prompt, lengths, cache, int(steps), implementation)


@functools.partial(
    jax.jit,
    static_argnames=("config", "steps", "implementation"),
    compiler_options=kivi_jax.compiler_options(),
)
def _greedy(params, config, prompt, lengths, cache, steps, implementation):
    logits, cache = prefill(params, config, prompt, lengths, cache)
    first = jnp.argmax(logits, -1).astype(jnp.int32)

    def step(carry, _):
        tok, cache = carry
        logits, cache = decode_step(params, config, tok, cache, implementation=implementation)
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        return (nxt, cache), nxt

    (_, cache), rest = jax.lax.scan(step, (first, cache), None, length=steps - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1), cache
