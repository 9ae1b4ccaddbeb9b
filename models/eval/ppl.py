"""Perplexity of a model through a KV cache, two ways.

Streaming (the protocol that matters): non-overlapping windows of P + T tokens from the start of
the token stream. Prefill the first P tokens (exact attention; the prompt then enters the cache
by the cache's rules), score token P from the prefill's last logits, then teacher-force tokens
P .. P+T-2 one decode step at a time through the cache, each step scoring the next token. So
every scored logit comes from decode attention over the cache exactly as generation sees it.
Decode steps are batched over windows (rows of one cache). With a prefill chunk the P tokens
go through the cache that many at a time instead (`models.llama.prefill_chunked`: each chunk
attends to the quantized past, as `generate --prefill-chunk` does).

Simulated: one forward pass over the whole window in which every layer's post-RoPE K and V are
replaced by their quantize-dequantize image (all of them, no residual window), scoring the same
T tokens. It isolates the quantizer from the residual window (KIVI paper, Table 1).

Perplexity = exp(mean NLL over all scored tokens of all windows).

Gemma 3 (a `models.gemma3.Gemma3Config`) runs both protocols through `models.gemma3`: streaming
prefills into a `Gemma3Cache` (the named cache on the global layers, exact rings of the sliding
window on the local ones) and decodes through it; simulated quantizes the global layers' K/V
only, the layers whose cache is quantized. Meshes and prefill chunks are Llama-only
(NotImplementedError, `models.generate`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PROTOCOLS = ("streaming", "simulated")


# ---------------------------------------------------------------- corpus and windows


def pydoc_corpus() -> str:
    """The `pydoc` corpus: pydoc_data.topics.topics values in sorted key order, 2 newlines apart."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def load_corpus(text_file: str | None = None) -> str:
    """The text to score: the pydoc corpus, or the contents of `text_file` (UTF-8).

    Raises ValueError if the text is empty or only whitespace.
    """
    if text_file is None:
        text, where = pydoc_corpus(), "the pydoc corpus"
    else:
        with open(text_file, encoding="utf-8") as f:
            text = f.read()
        where = f"--text-file {text_file}"
    if not text.strip():
        raise ValueError(f"{where} is empty: nothing to score")
    return text


def load_token_ids(path: str) -> list[int]:
    """The token ids to score from a JSON file holding one list of non-negative integers (the
    exact tokens another tool scored). Raises ValueError naming the file for an absent or
    unreadable file, text that is not JSON, anything but a non-empty list, and the first entry
    that is not a non-negative integer; ids past the vocabulary are checked with the model
    (`check_vocab`)."""
    where = f"--token-ids {path}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: cannot read it ({e})") from None
    try:
        ids = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg}, line {e.lineno} column {e.colno})") from None
    if not isinstance(ids, list) or not ids:
        got = "an empty list" if ids == [] else f"a JSON {type(ids).__name__}"
        raise ValueError(f"{where}: expected a non-empty JSON list of token ids, got {got}")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"{where}: entry {i} is {t!r}, not a non-negative integer")
    return ids


def check_vocab(tokens: Sequence[int], vocab_size: int, where: str) -> None:
    """Raise ValueError if a token id lies outside [0, vocab_size)."""
    top = max(tokens)
    if top >= vocab_size:
        raise ValueError(f"{where}: token id {top} outside the model's vocabulary of {vocab_size}")


def make_windows(tokens: Sequence[int], prefill: int, decode: int, windows: int) -> np.ndarray:
    """Non-overlapping windows of P + T tokens from the start: int32 [N, P + T].

    Raises ValueError for P < 1, T < 1, N < 1 or a stream shorter than N (P + T) tokens (it
    never silently scores fewer windows than asked).
    """
    if prefill < 1:
        raise ValueError(f"prefill (P) must be >= 1 token, got {prefill}")
    if decode < 1:
        raise ValueError(f"decode (T) must be >= 1 token, got {decode}")
    if windows < 1:
        raise ValueError(f"windows must be >= 1, got {windows}")
    w = prefill + decode
    n = len(tokens)
    if n < windows * w:
        raise ValueError(
            f"the text has {n} tokens, fewer than windows x (P + T) = {windows} x {w} = "
            f"{windows * w}: lower --windows (at most {n // w}), --prefill or --decode, "
            "or use a longer --text-file"
        )
    return np.asarray(tokens[: windows * w], dtype=np.int32).reshape(windows, w)


def check_context(prefill: int, decode: int, max_positions: int | None) -> None:
    """Raise ValueError if a window of P + T tokens is longer than the model's context."""
    if max_positions is not None and prefill + decode > max_positions:
        raise ValueError(
            f"P + T = {prefill} + {decode} = {prefill + decode} is longer than the model's "
            f"context of {max_positions} tokens"
        )


def check_prefill_chunk(prefill_chunk) -> None:
    """Raise ValueError unless `prefill_chunk` is None (one piece) or a positive int."""
    if prefill_chunk is not None and (
        not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1
    ):
        raise ValueError(f"prefill_chunk must be a positive int or None, got {prefill_chunk!r}")


def perplexity(nll: np.ndarray) -> float:
    """exp(mean NLL)."""
    nll = np.asarray(nll, dtype=np.float64)
    if nll.size == 0:
        raise ValueError("no scored tokens")
    return float(math.exp(nll.mean()))


def _target_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] in float32; logits [..., V], targets [...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


# ---------------------------------------------------------------- caches


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """A cache by name plus the knobs that apply to quantized ones; `layer_overrides`, texts
    such as "17-18 key_bits=4" (`kivi_jax.mixed.parse_override`), change the config in those
    layers (a `kivi_jax.MixedCache`)."""

    name: str
    group_size: int = 32
    residual_length: int = 128
    sinks: int = 0
    rotation: str = "none"
    outlier_channels: int = 0
    pre_rope: bool = False
    layer_overrides: tuple[str, ...] = ()

    @classmethod
    def named(
        cls,
        name,
        group_size=None,
        residual_length=128,
        sinks=0,
        rotation="none",
        outlier_channels=0,
        pre_rope=False,
        layer_overrides=(),
    ):
        """A spec whose knobs apply where the cache is quantized (the dense one, compared beside
        them, takes none); group_size None: the name's own (`kivi_jax.cache_config`). Layer
        overrides are parsed here (ValueError on a bad one) and checked against the model's
        layers when the cache is made; a dense spec made directly with them raises there."""
        import kivi_jax
        from kivi_jax.mixed import parse_override

        overrides = tuple(layer_overrides)
        for text in overrides:
            parse_override(text)
        if name in kivi_jax.DENSE_NAMES:
            return cls(name, residual_length=residual_length)
        cfg = kivi_jax.cache_config(name, group_size, residual_length)
        knobs = (sinks, rotation, outlier_channels, pre_rope)
        return cls(name, cfg.group_size, residual_length, *knobs, overrides)

    def overrides(self) -> list:
        """The parsed layer overrides: (layers, fields) pairs as `kivi_jax.make_cache` takes."""
        from kivi_jax.mixed import parse_override

        return [parse_override(text) for text in self.layer_overrides]

    def layer_configs(self, num_layers: int):
        """The KiviConfig of each of `num_layers` layers (None for the dense cache)."""
        from kivi_jax.mixed import layer_configs

        cfg = self.config()
        return None if cfg is None else layer_configs(cfg, num_layers, self.overrides())

    def knobs(self) -> dict:
        """The keyword arguments `kivi_jax.make_cache` and `kivi_jax.cache_config` take."""
        return dict(
            group_size=self.group_size,
            residual_length=self.residual_length,
            sinks=self.sinks,
            rotation=self.rotation,
            outlier_channels=self.outlier_channels,
            pre_rope=self.pre_rope,
        )

    def config(self):
        """The KiviConfig (None for the dense cache); raises ValueError on an unknown name."""
        import kivi_jax

        if self.name not in kivi_jax.CACHE_NAMES:
            raise ValueError(
                f"unknown cache name {self.name!r}; "
                f"expected one of {', '.join(kivi_jax.CACHE_NAMES)}"
            )
        return kivi_jax.cache_config(self.name, **self.knobs())

    def describe(self) -> dict:
        cfg = self.config()
        out = {"cache": self.name}
        if cfg is not None:
            out.update(dataclasses.asdict(cfg))
        if self.layer_overrides:
            out["layer_overrides"] = list(self.layer_overrides)
        return out

    def make(self, model_config, *, batch: int, max_len: int, dtype):
        """An empty cache for `model_config` (a `models.gemma3.Gemma3Cache` for Gemma 3)."""
        import kivi_jax
        from models import gemma3
        from models.generate import key_rope_frequencies

        if isinstance(model_config, gemma3.Gemma3Config):
            if self.layer_overrides:
                raise ValueError("layer overrides apply to Llama-family models, not Gemma 3")
            return gemma3.Gemma3Cache.init(
                self.name, model_config, batch=batch, max_len=max_len, dtype=dtype, **self.knobs()
            )
        return kivi_jax.make_cache(
            self.name,
            num_layers=model_config.num_layers,
            batch=batch,
            kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            max_len=max_len,
            dtype=dtype,
            rope_frequencies=key_rope_frequencies(model_config),
            layer_overrides=self.overrides(),
            **self.knobs(),
        )


def bits_per_element(
    spec: CacheSpec, head_dim: int, dense_bits: int = 16, num_layers: int | None = None
) -> float:
    """Stored bits per cached element of `spec`'s cache (the mean over layers with layer
    overrides, which then need `num_layers`)."""
    from kivi_jax.mixed import mean_bits

    cfg = spec.config()
    if cfg is None:
        return float(dense_bits)
    if not spec.layer_overrides:
        return cfg.bits_per_element(head_dim)
    if num_layers is None:
        raise ValueError("bits_per_element of a cache with layer overrides needs num_layers")
    return mean_bits(spec.layer_configs(num_layers), head_dim)


def qdq_transform(kivi_config, rope_frequencies=None) -> Callable | None:
    """kv_transform(k, v) replacing K, V [B, Hkv, S, D] by their quantize-dequantize image.

    Keys and values are quantized on the config's axes (groups of G tokens for "channel", of G
    channels for "token"). A token axis that is not a multiple of G is edge-padded (the last
    token repeated, which leaves the last group's min and max unchanged) and cut back after.
    Pre-RoPE keys (`KiviConfig.pre_rope`) are rotated back by `rope_frequencies` at positions
    0 .. S-1 before and forward after, as the cache does. None for the dense cache.
    """
    if kivi_config is None:
        return None
    from kivi_jax import formats, rotation
    from kivi_jax.quant import dequantize, outlier_channels, overlay_outliers, quantize

    cfg = kivi_config
    g, n_sinks = cfg.group_size, cfg.sinks

    def qdq_int(x, bits, axis, outliers=0):
        s = x.shape[-2]
        pad = (-s) % g if axis == "channel" else 0
        xp = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad), (0, 0)], mode="edge") if pad else x
        *lead, t, d = xp.shape
        groups = lambda a: a.reshape(*lead, t // g, g, d)  # channel groups of G tokens
        if n_sinks and axis == "channel":  # sinks out of their group's range, as the cache
            pos = jnp.arange(t).reshape(t // g, g, 1)
            xp = jnp.where(pos < n_sinks, groups(xp)[..., -1:, :], groups(xp)).reshape(xp.shape)
        y = dequantize(quantize(xp, bits, g, axis, cfg.scale_dtype), jnp.float32)
        if outliers:  # the widest channels of each group kept, as the cache keeps them
            idx, vals = outlier_channels(groups(xp), outliers, cfg.scale_dtype)
            y = overlay_outliers(groups(y), idx[..., None, :], vals).reshape(y.shape)
        return y[..., :s, :]

    def qdq_float(x, fmt, bits):  # per token, groups of G channels
        *lead, d = x.shape
        codes, scale, aux = formats.encode(fmt, x.reshape(*lead, d // g, g), bits, cfg.scale_dtype)
        return formats.decode(fmt, codes, scale, aux, g).reshape(x.shape)

    if cfg.pre_rope and rope_frequencies is None:
        raise ValueError("pre_rope=True needs the model's rope_frequencies")

    def qdq(x, fmt, bits, axis, rotate, outliers=0, pre_rope=False):
        pos = jnp.arange(x.shape[-2])
        xp = rotation.rope(x, -pos, rope_frequencies) if pre_rope else x
        xr = rotation.rotate(xp) if rotate else xp.astype(jnp.float32)
        y = qdq_int(xr, bits, axis, outliers) if fmt == "int" else qdq_float(xr, fmt, bits)
        if n_sinks:  # the first positions stay exact
            y = jnp.where(pos[:, None] < n_sinks, xr, y)
        y = rotation.unrotate(y) if rotate else y
        y = rotation.rope(y, pos, rope_frequencies) if pre_rope else y
        return y.astype(x.dtype)

    def transform(k, v):
        return (
            qdq(
                k,
                cfg.key_format,
                cfg.key_bits,
                cfg.key_axis,
                cfg.rotates_keys,
                cfg.outlier_channels,
                cfg.pre_rope,
            ),
            qdq(v, cfg.value_format, cfg.value_bits, cfg.value_axis, cfg.rotates_values),
        )

    return transform


# ---------------------------------------------------------------- the two protocols


def _model_dtype(params):
    leaves = [x for x in jax.tree_util.tree_leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return leaves[0].dtype if leaves else jnp.float32


def _batches(n: int, batch_size: int | None):
    b = n if not batch_size else max(1, min(batch_size, n))
    for i in range(0, n, b):
        yield slice(i, min(i + b, n))


def _streaming_run(
    model_config, prefill_len: int, decode_len: int, implementation: str, prefill_chunk=None
):
    from models.generate import model_module, prefill_program

    decode_step = model_module(model_config).decode_step
    run_prefill = prefill_program(model_config, prefill_chunk, implementation)

    def run(params, windows, cache):
        b = windows.shape[0]
        lengths = jnp.full((b,), prefill_len, jnp.int32)
        logits, cache = run_prefill(params, windows[:, :prefill_len], lengths, cache)
        first = _target_nll(logits, windows[:, prefill_len])

        def step(cache, xs):
            tok, target = xs
            logits, cache = decode_step(
                params, model_config, tok, cache, implementation=implementation
            )
            return cache, _target_nll(logits, target)

        inputs = windows[:, prefill_len : prefill_len + decode_len - 1].T  # [T-1, B]
        targets = windows[:, prefill_len + 1 : prefill_len + decode_len].T
        _, rest = jax.lax.scan(step, cache, (inputs, targets))
        return jnp.concatenate([first[:, None], rest.T], axis=1)  # [B, T]

    return run


@functools.lru_cache(maxsize=8)
def _streaming_fn(
    model_config, prefill_len: int, decode_len: int, implementation: str, prefill_chunk=None
):
    return jax.jit(
        _streaming_run(model_config, prefill_len, decode_len, implementation, prefill_chunk)
    )


def _sharded_streaming_fn(
    mesh, rules, cache, model_config, prefill_len, decode_len, impl, prefill_chunk=None
):
    """`_streaming_fn` over `mesh`: the model replicated, each device's cache one shard of the
    token axes (attended and written where the tokens are, `kivi_jax.parallel`; a chunked
    prefill too), windows over the rows' axis."""
    from kivi_jax.parallel import on_token_shards
    from kivi_jax.sharding import cache_specs

    run = _streaming_run(model_config, prefill_len, decode_len, impl, prefill_chunk)
    seq, row = rules["cache_seq"], jax.P(rules.get("batch"))
    specs = cache_specs(cache, rules)
    local = on_token_shards(run, seq)
    return jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(jax.P(), row, specs), out_specs=row, check_vma=False
        )
    )


def streaming_nll(
    params,
    model_config,
    windows: np.ndarray,
    spec: CacheSpec,
    *,
    prefill_len: int,
    batch_size: int | None = None,
    implementation: str = "reference",
    mesh=None,
    rules=None,
    prefill_chunk: int | None = None,
) -> np.ndarray:
    """Per-token NLL [N, T] of the streaming protocol (module doc) through cache `spec`.

    mesh: a KIVI cache's token axes over its "seq" axis, windows over "data" where it has one
    (`models.generate.generate`'s mesh: the model replicated; equal to one device's NLL up to
    float32 rounding). prefill_chunk: prefill the P tokens that many at a time through the
    cache (`models.llama.prefill_chunked`, its attention `models.generate.chunk_implementation`
    of `implementation`) instead of in one exact piece; ValueError unless a positive int."""
    windows = np.asarray(windows, np.int32)
    n, w = windows.shape
    decode_len = w - prefill_len
    if not 1 <= prefill_len < w:
        raise ValueError(f"prefill_len must be in [1, {w}), got {prefill_len}")
    check_prefill_chunk(prefill_chunk)
    spec.config()
    fn = _streaming_fn(model_config, prefill_len, decode_len, implementation, prefill_chunk)
    dtype = _model_dtype(params)
    max_len, split = w, 1
    if mesh is not None:
        from models.generate import _mesh_rules, _not_for_gemma3

        _not_for_gemma3(
            model_config,
            "the streaming perplexity over a mesh",
            "the token shards of kivi_jax.parallel cover a global cache, not the local rings",
        )
        if spec.config() is None:
            raise ValueError(f"a mesh splits a KIVI cache's tokens, got cache {spec.name!r}")
        rules = _mesh_rules(mesh, rules)
        per = 256 * mesh.shape[rules["cache_seq"]]
        max_len = -(-w // per) * per
        split = mesh.shape[rules["batch"]] if rules.get("batch") else 1
        params = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
    out, sharded_fns = [], {}
    for sl in _batches(n, batch_size):
        rows = windows[sl]
        rows = np.concatenate([rows, np.repeat(rows[-1:], -len(rows) % split, axis=0)])
        cache = spec.make(model_config, batch=len(rows), max_len=max_len, dtype=dtype)
        if mesh is not None:
            from kivi_jax.sharding import shard_cache

            cache = shard_cache(cache, mesh, rules)
            if len(rows) not in sharded_fns:  # one program per batch shape
                sharded_fns[len(rows)] = _sharded_streaming_fn(
                    mesh,
                    rules,
                    cache,
                    model_config,
                    prefill_len,
                    decode_len,
                    implementation,
                    prefill_chunk,
                )
            fn = sharded_fns[len(rows)]
        out.append(np.asarray(fn(params, jnp.asarray(rows), cache))[: sl.stop - sl.start])
    return np.concatenate(out, axis=0)


@functools.lru_cache(maxsize=8)
def _full_fn(model_config, prefill_len: int, kivi_config):
    from models.generate import key_rope_frequencies, model_module

    prefill = model_module(model_config).prefill  # Gemma 3: the global layers transformed
    transform = qdq_transform(kivi_config, key_rope_frequencies(model_config))

    def run(params, windows):
        b, w = windows.shape
        lengths = jnp.full((b,), w, jnp.int32)
        logits, _ = prefill(
            params, model_config, windows, lengths, None, all_logits=True, kv_transform=transform
        )
        # logits[:, i] predicts token i + 1: score tokens P .. W-1.
        return _target_nll(logits[:, prefill_len - 1 : w - 1], windows[:, prefill_len:])

    return jax.jit(run)


def full_window_nll(
    params,
    model_config,
    windows: np.ndarray,
    *,
    prefill_len: int,
    kivi_config=None,
    batch_size: int | None = None,
) -> np.ndarray:
    """Per-token NLL [N, T] of tokens P .. P+T-1 from one forward pass over each whole window.

    kivi_config=None: the ordinary full-window perplexity (dense attention). Otherwise the
    simulated protocol: every K/V replaced by its quantize-dequantize image.
    """
    windows = np.asarray(windows, np.int32)
    n, w = windows.shape
    if not 1 <= prefill_len < w:
        raise ValueError(f"prefill_len must be in [1, {w}), got {prefill_len}")
    if kivi_config is not None:
        kivi_config.check_head_dim(model_config.head_dim)
    fn = _full_fn(model_config, prefill_len, kivi_config)
    out = []
    for sl in _batches(n, batch_size):
        out.append(np.asarray(fn(params, jnp.asarray(windows[sl]))))
    return np.concatenate(out, axis=0)


# ---------------------------------------------------------------- one evaluation, as JSON


def evaluate_ppl(
    params,
    model_config,
    tokens: Sequence[int],
    spec: CacheSpec,
    *,
    protocol: str = "streaming",
    prefill_len: int = 1536,
    decode_len: int = 512,
    windows: int = 16,
    batch_size: int | None = None,
    max_positions: int | None = None,
    implementation: str = "reference",
    mesh=None,
    prefill_chunk: int | None = None,
) -> dict:
    """Run one protocol and return a JSON-able dict (ppl, n_tokens, parameters, cache config).
    mesh, prefill_chunk: the streaming protocol over a mesh, prefilled in chunks
    (`streaming_nll`)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if mesh is not None and protocol != "streaming":
        raise ValueError("a mesh splits the cache of the streaming protocol; simulated has none")
    if prefill_chunk is not None and protocol != "streaming":
        raise ValueError("a prefill chunk applies to the streaming protocol; simulated has none")
    check_context(prefill_len, decode_len, max_positions)
    cfg = spec.config()
    if cfg is not None:
        cfg.check_head_dim(model_config.head_dim)
    if spec.layer_overrides:
        if protocol != "streaming":
            raise ValueError("layer overrides run the streaming protocol")
        for layer_config in set(spec.layer_configs(model_config.num_layers)):
            layer_config.check_head_dim(model_config.head_dim)
    win = make_windows(tokens, prefill_len, decode_len, windows)
    t0 = time.perf_counter()
    if protocol == "streaming":
        nll = streaming_nll(
            params,
            model_config,
            win,
            spec,
            prefill_len=prefill_len,
            batch_size=batch_size,
            implementation=implementation,
            mesh=mesh,
            prefill_chunk=prefill_chunk,
        )
    else:
        nll = full_window_nll(
            params,
            model_config,
            win,
            prefill_len=prefill_len,
            kivi_config=cfg,
            batch_size=batch_size,
        )
    seconds = time.perf_counter() - t0
    return {
        "ppl": perplexity(nll),
        "mean_nll": float(np.mean(nll, dtype=np.float64)),
        "n_tokens": int(nll.size),
        "protocol": protocol,
        "prefill": prefill_len,
        "decode": decode_len,
        "windows": windows,
        "prefill_chunk": prefill_chunk,
        "bits_per_element": bits_per_element(
            spec, model_config.head_dim, num_layers=model_config.num_layers
        ),
        **spec.describe(),
        "group_size": spec.group_size if cfg is not None else None,
        "residual_length": spec.residual_length if cfg is not None else None,
        "seconds": round(seconds, 2),
    }


# ---------------------------------------------------------------- per-layer screen


def layer_sets(layers: Sequence[int], group: int) -> list[tuple[int, ...]]:
    """`layers` in consecutive sets of `group` (the last may be shorter): what `screen_layers`
    changes one set at a time."""
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    layers = tuple(layers)
    return [layers[i : i + group] for i in range(0, len(layers), group)]


def screen_layers(
    params,
    model_config,
    tokens: Sequence[int],
    spec: CacheSpec,
    change: str,
    sets: Sequence[Sequence[int]],
    **protocol,
) -> dict:
    """Which layers repay a change of format: the streaming perplexity of `spec` with `change`
    ("FIELD=VALUE ...", e.g. "key_bits=4") in one set of layers at a time, against `spec`
    itself, on the same windows (`evaluate_ppl`'s `protocol` keywords). Returns {"base":
    spec's result, "change": change, "rows": one per set (layers, ppl, delta against the base,
    bits_per_element, delta per added bit), the largest gain first}. Every override is checked
    against the model's layers (and the spec's own overrides) before anything runs: a bad
    change, a layer out of range or in two overrides raises ValueError. A change of every
    layer at once is the uniform format, which `eval ppl` measures."""
    if spec.config() is None:
        raise ValueError(f"a layer screen changes a quantized cache's format, not {spec.name!r}")
    if not sets:
        raise ValueError("no layers to screen")
    specs = []
    for layers in sets:
        text = f"{','.join(str(layer) for layer in layers)} {change}"
        changed = dataclasses.replace(spec, layer_overrides=(*spec.layer_overrides, text))
        changed.layer_configs(model_config.num_layers)  # the text, range, overlap, fields
        specs.append((tuple(layers), changed))
    base = evaluate_ppl(params, model_config, tokens, spec, **protocol)
    rows = []
    for layers, changed in specs:
        out = evaluate_ppl(params, model_config, tokens, changed, **protocol)
        delta = out["ppl"] - base["ppl"]
        added = out["bits_per_element"] - base["bits_per_element"]
        rows.append(
            dict(
                layers=list(layers),
                ppl=out["ppl"],
                delta=delta,
                bits_per_element=out["bits_per_element"],
                delta_per_bit=delta / added if added else None,
                seconds=out["seconds"],
            )
        )
    rows.sort(key=lambda r: r["delta"])
    return {"base": base, "change": change, "rows": rows}
