"""Generation over an explicit KV cache: jitted prefill, then the whole decode loop in one jit.

The loop is a `lax.while_loop` over `LoopState` (step, done, tokens, cache, rng, ...) with the
cache donated. Prompts are right-padded to a bucket length (powers of two from 16) and the
number of new tokens is bucketed the same way, so serving many prompts compiles a handful of
programs, not one per prompt. Padding never reaches attention: prefill masks keys past each
row's length and the cache attends to [0, lengths[b]) per row.

`stream` is the Python-level generator for interactive use: one jitted decode step per token.

Both take a Llama-family model (`models.llama`, a ModelConfig) or Gemma 3 (`models.gemma3`, a
Gemma3Config: its prefill, decode step and `Gemma3Cache`, the rings of the local layers exact
and the named cache on the global ones); `model_module` picks by the config's type.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

import kivi_jax
from models import gemma3, llama
from models.presets import ModelConfig

MIN_BUCKET = 16
MAX_STOP_IDS = 8  # stop ids are padded to this many so their count never changes a program

# CPU backends cannot donate; the warning says so on every call.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

_COMPILE = {"seconds": 0.0, "count": 0}


def _on_event(name: str, seconds: float, **_):
    if name.startswith("/jax/core/compile/"):
        _COMPILE["seconds"] += seconds
        if name == "/jax/core/compile/backend_compile_duration":
            _COMPILE["count"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def model_module(config):
    """The module whose `prefill` / `decode_step` run `config`: `models.gemma3` for a
    Gemma3Config, `models.llama` otherwise (same signatures)."""
    return gemma3 if isinstance(config, gemma3.Gemma3Config) else llama


def key_rope_frequencies(config) -> np.ndarray:
    """The RoPE inverse frequencies [D/2] of the keys a cache holds (Gemma 3: its global
    layers'), what a cache of pre-RoPE keys needs (`kivi_jax.KiviConfig.pre_rope`)."""
    if isinstance(config, gemma3.Gemma3Config):
        return gemma3.rope_frequencies(config, is_global=True)
    return llama.rope_frequencies(config)


def _not_for_gemma3(config, what: str, why: str) -> None:
    if isinstance(config, gemma3.Gemma3Config):
        raise NotImplementedError(f"{what} is not implemented for Gemma 3 ({config.name}): {why}")


def compile_stats() -> tuple[int, float]:
    """(backend compilations, seconds spent tracing, lowering and compiling) in this process."""
    return _COMPILE["count"], _COMPILE["seconds"]


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The smallest power of two >= max(n, minimum)."""
    if n < 0:
        raise ValueError(f"length must be >= 0, got {n}")
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. greedy=True takes the argmax (the rest ignored).

    Otherwise logits / temperature, then top_k (0: off), then top_p (1.0: off) nucleus.
    """

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        # inf would pass "> 0" and sample uniformly, whatever the model says.
        if not 0 < self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


GREEDY = Sampling(greedy=True)


def sample(logits: Array, rng: Array, sampling: Sampling) -> Array:
    """Next tokens [B] int32 from float32 logits [B, V] with an explicit PRNG key."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = logits.astype(jnp.float32) / sampling.temperature
    neg = jnp.finfo(jnp.float32).min
    if sampling.top_k:
        kth = jax.lax.top_k(x, min(sampling.top_k, x.shape[-1]))[0][:, -1:]
        x = jnp.where(x < kth, neg, x)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-x, axis=-1)
        sx = jnp.take_along_axis(x, order, axis=-1)
        p = jax.nn.softmax(sx, axis=-1)
        before = jnp.cumsum(p, axis=-1) - p  # mass of strictly more likely tokens
        keep_sorted = before < sampling.top_p  # the most likely token is always kept
        keep = (
            jnp.zeros_like(keep_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(keep_sorted)
        )
        x = jnp.where(keep, x, neg)
    return jax.random.categorical(rng, x, axis=-1).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
    step: Array  # [] int32: tokens generated so far (columns of `tokens` filled)
    done: Array  # [B] bool: row has produced a stop token
    tokens: Array  # [B, N] int32: generated tokens, pad_id after a row is done
    last: Array  # [B] int32: the token fed at the next step
    cache: Any  # KiviCache | DenseCache
    rng: Array  # PRNG key


def _pad_stops(stop_ids: Sequence[int]) -> Array:
    stop_ids = list(dict.fromkeys(int(s) for s in stop_ids))
    if len(stop_ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop ids, got {len(stop_ids)}")
    return jnp.asarray(stop_ids + [-1] * (MAX_STOP_IDS - len(stop_ids)), jnp.int32)


def _decode_loop(
    params,
    logits: Array,
    cache,
    rng: Array,
    max_new: Array,
    stops: Array,
    *,
    config: ModelConfig,
    num_slots: int,
    sampling: Sampling,
    implementation: str,
    rows_axis: str | None = None,
) -> LoopState:
    """rows_axis: inside shard_map with the rows split over that mesh axis, every shard loops
    until all rows of all shards are done (the same trip count everywhere)."""
    B = logits.shape[0]

    def pick(logits, rng, step, done):
        tok = sample(logits, jax.random.fold_in(rng, step), sampling)
        return jnp.where(done, stops[0], tok)

    done0 = jnp.zeros((B,), bool)
    first = pick(logits, rng, 0, done0)
    state = LoopState(
        step=jnp.int32(1),
        done=jnp.isin(first, stops),
        tokens=jnp.zeros((B, num_slots), jnp.int32).at[:, 0].set(first),
        last=first,
        cache=cache,
        rng=rng,
    )

    def cond(s: LoopState):
        all_done = jnp.all(s.done)
        if rows_axis is not None:
            all_done = jax.lax.pmin(all_done.astype(jnp.int32), rows_axis) > 0
        return (s.step < max_new) & ~all_done

    def body(s: LoopState):
        logits, cache = model_module(config).decode_step(
            params, config, s.last, s.cache, implementation=implementation
        )
        tok = pick(logits, s.rng, s.step, s.done)
        return LoopState(
            step=s.step + 1,
            done=s.done | jnp.isin(tok, stops),
            tokens=s.tokens.at[:, s.step].set(tok),
            last=tok,
            cache=cache,
            rng=s.rng,
        )

    return jax.lax.while_loop(cond, body, state)


def _prefill(params, config, tokens, lengths, cache, *, all_logits=False, kv_transform=None):
    return model_module(config).prefill(
        params, config, tokens, lengths, cache, all_logits=all_logits, kv_transform=kv_transform
    )


def _decode_step(params, config, tokens, cache, *, implementation="reference"):
    return model_module(config).decode_step(
        params, config, tokens, cache, implementation=implementation
    )


# Every program that may call the kernel compiles with `kivi_jax.compiler_options()`.
_OPTIONS = kivi_jax.compiler_options()
prefill_jit = jax.jit(
    _prefill,
    static_argnames=("config", "all_logits", "kv_transform"),
    donate_argnames=("cache",),
    compiler_options=_OPTIONS,
)
prefill_chunked_jit = jax.jit(
    llama.prefill_chunked,
    static_argnames=("config", "chunk", "implementation"),
    donate_argnames=("cache",),
    compiler_options=_OPTIONS,
)
decode_step_jit = jax.jit(
    _decode_step,
    static_argnames=("config", "implementation"),
    donate_argnames=("cache",),
    compiler_options=_OPTIONS,
)
decode_loop_jit = jax.jit(
    _decode_loop,
    static_argnames=("config", "num_slots", "sampling", "implementation"),
    donate_argnames=("cache",),
    compiler_options=_OPTIONS,
)


@jax.jit
def _sample_jit_greedy(logits):
    return jnp.argmax(logits, -1).astype(jnp.int32)


sample_jit = jax.jit(sample, static_argnames=("sampling",))


def compiled_programs() -> int:
    """Programs compiled so far by the jitted prefill / decode loop / step (for tests)."""
    return sum(
        f._cache_size()
        for f in (prefill_jit, prefill_chunked_jit, decode_loop_jit, decode_step_jit)
    )


@dataclasses.dataclass
class Generation:
    """Result of `generate`: per-row generated ids (stop token included when one was hit)."""

    tokens: list[list[int]]
    prompt_lengths: list[int]
    stopped: list[bool]
    cache_bytes: int  # bytes of the cache as allocated
    dense16_cache_bytes: int  # a 16-bit dense cache of the same capacity
    max_len: int
    prefill_seconds: float  # wall time of the prefill call, compilation excluded
    decode_seconds: float  # wall time of the decode loop, compilation excluded
    compile_seconds: float  # tracing + compiling during this call (0 when all were cached)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens produced by decode steps (all rows, first token excluded) per second."""
        steps = max(len(t) for t in self.tokens) - 1
        n = steps * len(self.tokens)
        return n / self.decode_seconds if self.decode_seconds > 0 and steps > 0 else float("nan")


def make_prompt_batch(prompts: Sequence[Sequence[int]], pad_id: int = 0):
    """(tokens [B, S_bucket] int32 right-padded, lengths [B] int32) for token-id prompts."""
    if not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    lens = [len(p) for p in prompts]
    if min(lens) < 1:
        raise ValueError(f"every prompt needs at least one token, got lengths {lens}")
    S = bucket(max(lens))
    arr = np.full((len(prompts), S), pad_id, np.int32)
    for i, p in enumerate(prompts):
        arr[i, : len(p)] = p
    return jnp.asarray(arr), jnp.asarray(lens, jnp.int32)


def check_token_ids(prompts: Sequence[Sequence[int]], config: ModelConfig) -> None:
    """Raise ValueError for a token id outside [0, vocab_size): the embedding gather would clamp
    it to a valid row and the model would answer a different prompt (a tokenizer with more
    tokens than the checkpoint's embedding)."""
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= int(t) < config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i}: token id {bad[0]} is outside the model's vocabulary "
                f"[0, {config.vocab_size}); does the tokenizer belong to this checkpoint?"
            )


# A quantized cache that XLA reads through GEMMs (fp8, `kivi_jax.cache.read_by_gemms`) holds a
# part per layer only where a layer's K and V are this many elements or more: a stacked store's
# layer is copied out before its GEMMs read it, a cost that grows with the layer's bytes, while
# the parts add launches of their own (each part's writes of the token leaving its window, ~6
# per layer) that do not, and compile longer. docs/formats.md has the measured crossover. On
# Hopper the fp8 kernel reads a stacked store's layer in place: no parts there.
PER_LAYER_MIN_ELEMENTS = 100_000_000


def new_cache(cache: str, config: ModelConfig, batch: int, max_len: int, dtype, **kw):
    """An empty cache for `config`; kw: group_size, residual_length, per_layer (for per-layer
    weights, `decode_layout`: a dense cache with one buffer per layer, an fp8 one with a part
    per layer where its layers are large, `PER_LAYER_MIN_ELEMENTS`), sinks, rotation,
    outlier_channels, pre_rope (the model's RoPE frequencies go with it), layer_overrides
    ((layers, KiviConfig fields) pairs: a `kivi_jax.MixedCache`). For a
    Gemma3Config a `models.gemma3.Gemma3Cache` (the named cache on its global layers)."""
    if kw.get("per_layer") and cache not in kivi_jax.DENSE_NAMES:
        elements = 2 * batch * max_len * config.num_kv_heads * config.head_dim
        kernel = kivi_jax.attention.pallas_available()
        kw["per_layer"] = elements >= PER_LAYER_MIN_ELEMENTS and not kernel
    if isinstance(config, gemma3.Gemma3Config):
        if kw.get("layer_overrides"):
            raise NotImplementedError(
                "layer overrides apply to Llama-family models: Gemma 3's cache holds its "
                "global layers only"
            )
        return gemma3.Gemma3Cache.init(
            cache, config, batch=batch, max_len=max_len, dtype=dtype, **kw
        )
    return kivi_jax.make_cache(
        cache,
        num_layers=config.num_layers,
        batch=batch,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_len=max_len,
        dtype=dtype,
        rope_frequencies=key_rope_frequencies(config),
        **kw,
    )


def cache_nbytes(cache) -> int:
    """Bytes a cache holds (a kivi_jax cache's `nbytes().total`; a Gemma3Cache's rings and
    global cache together)."""
    nb = cache.nbytes()
    return int(nb["total"] if isinstance(nb, dict) else nb.total)


def _cache_kw(group_size, residual_length, params, **knobs):
    """new_cache's keyword arguments: G and R where set, the knobs (sinks, rotation,
    outlier_channels, pre_rope, layer_overrides) where not their defaults."""
    # per-layer weights decode in an unrolled loop: a dense cache there holds a buffer per layer
    kw = {"per_layer": llama.is_unstacked(params)}
    kw.update({k: v for k, v in knobs.items() if v not in (0, "none", False, ())})
    if group_size is not None:
        kw["group_size"] = group_size
    if residual_length is not None:
        kw["residual_length"] = residual_length
    return kw


def _mesh_rules(mesh, rules):
    """The rules of a generation over `mesh`: the cache's token axes over "seq", rows over
    "data" where the mesh has it; kv heads stay whole (the weights are replicated)."""
    if rules is None:
        rules = {
            "batch": "data" if "data" in mesh.axis_names else None,
            "cache_seq": "seq",
            "cache_seq_packed": "seq",
            "cache_seq_groups": "seq",
        }
    if rules.get("kv_heads") is not None and mesh.shape[rules["kv_heads"]] > 1:
        raise NotImplementedError("kv heads over a mesh axis need tensor-parallel weights")
    if rules.get("cache_seq") not in mesh.axis_names:
        raise ValueError(f"generation over a mesh needs its tokens' axis in {mesh.axis_names}")
    return rules


def chunk_implementation(implementation: str) -> str:
    """The `chunk_attention` implementation a chunked prefill uses beside a decode
    `implementation`: the reference with the reference (or its folded form), else "auto"
    (cuDNN's flash attention over the dequantized past on GPUs)."""
    return "reference" if implementation in ("reference", "folded") else "auto"


def prefill_program(config, prefill_chunk, implementation):
    """The prefill of a generation: (params, tokens, lengths, cache) -> (logits, cache), in one
    piece (`llama.prefill`) or `prefill_chunk` tokens at a time (`llama.prefill_chunked`)."""
    if prefill_chunk is None:
        module = model_module(config)
        return lambda params, tokens, lengths, c: module.prefill(params, config, tokens, lengths, c)
    _not_for_gemma3(
        config,
        "a chunked prefill",
        "it needs chunk attention over the global cache plus each chunk's sliding window over "
        "the local rings (a models.gemma3.prefill_chunked); prefill in one piece",
    )
    impl = chunk_implementation(implementation)
    return lambda params, tokens, lengths, c: llama.prefill_chunked(
        params, config, tokens, lengths, c, chunk=prefill_chunk, implementation=impl
    )


def _sharded_programs(
    mesh, rules, cache, config, num_slots, sampling, implementation, prefill_chunk=None
):
    """(prefill, decode loop) over `mesh`: the model replicated on every device, each device's
    cache one shard of the token axes (`kivi_jax.parallel`: attended and written where the
    tokens are), rows over the rows' axis."""
    from kivi_jax.parallel import on_token_shards
    from kivi_jax.sharding import cache_specs

    P = jax.P
    seq, rows_axis = rules["cache_seq"], rules.get("batch")
    specs = cache_specs(cache, rules)
    row = P(rows_axis)

    prefill = prefill_program(config, prefill_chunk, implementation)

    def loop(params, logits, c, rng, max_new, stops):
        return _decode_loop(
            params,
            logits,
            c,
            rng,
            max_new,
            stops,
            config=config,
            num_slots=num_slots,
            sampling=sampling,
            implementation=implementation,
            rows_axis=rows_axis,
        )

    state_specs = LoopState(step=P(), done=row, tokens=row, last=row, cache=specs, rng=P())
    smap = lambda f, i, o: jax.shard_map(
        on_token_shards(f, seq), mesh=mesh, in_specs=i, out_specs=o, check_vma=False
    )
    prefill = smap(prefill, (P(), row, row, specs), (row, specs))
    loop = smap(loop, (P(), row, specs, P(), P(), P()), state_specs)
    return (
        jax.jit(prefill, donate_argnums=3, compiler_options=_OPTIONS),
        jax.jit(loop, donate_argnums=2, compiler_options=_OPTIONS),
    )


def decode_layout(params, config):
    """The params layout to decode `config`'s model with on this backend.

    GPUs: the model module's `decode_params`: per-layer weights, read in place by each GEMM (a
    scan over stacked weights copies every layer's slices first: Llama-3-8B, 14.5 -> 7.7 ms
    per step at batch 1), with the projections of one input joined (`llama.fuse_projections`:
    three GEMMs per layer instead of six) and, for the Llama family, the RMSNorm weights folded
    into them (`llama.fold_norms`: two launches per layer fewer). CPUs: the stacked scan, which
    compiles 8x faster (SmolLM2: 2.7 s against 21.7 s) for a decode step 30% slower. Returns
    params unchanged when nothing changes; new per-layer buffers otherwise (drop the old
    params to get their memory back, as the CLI does).
    """
    if jax.default_backend() == "gpu":
        return model_module(config).decode_params(params)
    return params


def generate(
    params,
    config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    cache: str = "fp16",
    max_new_tokens: int = 64,
    sampling: Sampling = GREEDY,
    stop_ids: Sequence[int] = (),
    seed: int = 0,
    implementation: str = "reference",
    group_size: int | None = None,
    residual_length: int | None = None,
    sinks: int = 0,
    rotation: str = "none",
    outlier_channels: int = 0,
    pre_rope: bool = False,
    layer_overrides: Sequence[tuple[Sequence[int], dict]] = (),
    mesh=None,
    rules=None,
    prefill_chunk: int | None = None,
) -> Generation:
    """Generate up to `max_new_tokens` for each prompt (lists of token ids, any lengths).

    cache: a name from kivi_jax.CACHE_NAMES ("fp16" is dense in the model dtype); group_size,
    residual_length, sinks, rotation, outlier_channels and pre_rope as
    `kivi_jax.cache_config` takes them; layer_overrides, (layers, KiviConfig fields) pairs
    (`kivi_jax.mixed.parse_override`), change the config in those layers (a
    `kivi_jax.MixedCache`; Llama family). Rows stop
    at any of `stop_ids`. Raises ValueError if prompt plus output exceeds the model's
    max_position_embeddings. Stacked params are unstacked for the call on GPUs (`decode_layout`);
    pass `decode_layout(params, config)` to skip that copy on repeated calls.

    mesh (a `jax.sharding.Mesh` with a "seq" axis, optionally "data"): a KIVI cache's token
    axes split over "seq" and attended and written where the tokens are
    (`kivi_jax.parallel`), rows over "data", the weights replicated; `rules` as
    `kivi_jax.sharding`'s (default: that). The capacity is rounded up to whole blocks of 256
    tokens per shard. Greedy output equals the unsharded one up to float32 rounding.

    prefill_chunk: prefill the prompts that many tokens at a time through the cache
    (`llama.prefill_chunked`: each chunk attends to the cache's quantized past and exactly to
    itself), so that a prompt's dense K/V never exist at once; None prefills in one piece.

    Gemma 3 (a Gemma3Config): the same loop over a `models.gemma3.Gemma3Cache`; mesh and
    prefill_chunk raise NotImplementedError for it (`_not_for_gemma3` says why).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prefill_chunk is not None and (
        not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1
    ):
        raise ValueError(f"prefill_chunk must be a positive int or None, got {prefill_chunk!r}")
    if mesh is not None:
        _not_for_gemma3(
            config,
            "generation over a mesh",
            "the token shards of kivi_jax.parallel cover the global layers' cache, not the "
            "local layers' rings, and no shard_map wraps models.gemma3's decode step",
        )
    if prefill_chunk is not None:
        prefill_program(config, prefill_chunk, implementation)  # NotImplementedError for Gemma
    params = decode_layout(params, config)
    check_token_ids(prompts, config)
    n_prompts = len(prompts)
    if mesh is not None:
        rules = _mesh_rules(mesh, rules)
        # rows split over the rows' axis: pad the batch with copies of the last prompt
        split = mesh.shape[rules["batch"]] if rules.get("batch") else 1
        prompts = list(prompts) + [prompts[-1]] * (-len(prompts) % split)
    tokens, lengths = make_prompt_batch(prompts)
    B, S = tokens.shape
    N = bucket(max_new_tokens)
    max_len = S + N
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > config.max_position_embeddings:
        raise ValueError(
            f"prompt plus max_new_tokens = {longest} exceeds the model's "
            f"max_position_embeddings={config.max_position_embeddings}"
        )
    dtype = params["embed"].dtype
    knobs = dict(
        sinks=sinks,
        rotation=rotation,
        outlier_channels=outlier_channels,
        pre_rope=pre_rope,
        layer_overrides=tuple(layer_overrides),
    )
    kw = _cache_kw(group_size, residual_length, params, **knobs)
    if mesh is not None:
        if kivi_jax.cache_config(cache) is None:
            raise ValueError(f"generation over a mesh needs a KIVI cache, got {cache!r}")
        per = 256 * mesh.shape[rules["cache_seq"]]
        max_len = -(-max_len // per) * per
    c = new_cache(cache, config, B, max_len, dtype, **kw)
    dense16 = jax.eval_shape(lambda: new_cache("fp16", config, B, max_len, jnp.bfloat16))
    dense16_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(dense16))
    cache_bytes = cache_nbytes(c)

    run_prefill = lambda params, tokens, lengths, c: prefill_jit(params, config, tokens, lengths, c)
    if prefill_chunk is not None:
        run_prefill = lambda params, tokens, lengths, c: prefill_chunked_jit(
            params,
            config,
            tokens,
            lengths,
            c,
            chunk=prefill_chunk,
            implementation=chunk_implementation(implementation),
        )
    run_loop = functools.partial(
        decode_loop_jit,
        config=config,
        num_slots=N,
        sampling=sampling,
        implementation=implementation,
    )
    if mesh is not None:  # the weights replicated on every device of the mesh
        params = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
        c = kivi_jax.sharding.shard_cache(c, mesh, rules)
        run_prefill, run_loop = _sharded_programs(
            mesh, rules, c, config, N, sampling, implementation, prefill_chunk
        )

    _, comp0 = compile_stats()
    t0 = time.perf_counter()
    logits, c = run_prefill(params, tokens, lengths, c)
    logits.block_until_ready()
    t1 = time.perf_counter()
    _, comp1 = compile_stats()
    state = run_loop(
        params,
        logits,
        c,
        jax.random.key(seed),
        jnp.int32(max_new_tokens),
        _pad_stops(stop_ids),
    )
    out = np.asarray(state.tokens)
    steps = int(state.step)
    t2 = time.perf_counter()
    _, comp2 = compile_stats()
    kivi_jax.check_capacity(state.cache)
    stops = set(int(s) for s in stop_ids)
    rows, stopped = [], []
    for r in out[:n_prompts, :steps].tolist():
        cut = next((i + 1 for i, t in enumerate(r) if t in stops), None)
        rows.append(r[:cut] if cut else r)
        stopped.append(cut is not None)
    return Generation(
        tokens=rows,
        prompt_lengths=[len(p) for p in prompts[:n_prompts]],
        stopped=stopped,
        cache_bytes=int(cache_bytes),
        dense16_cache_bytes=int(dense16_bytes),
        max_len=max_len,
        prefill_seconds=t1 - t0 - (comp1 - comp0),
        decode_seconds=t2 - t1 - (comp2 - comp1),
        compile_seconds=comp2 - comp0,
    )


def stream(
    params,
    config: ModelConfig,
    prompt: Sequence[int],
    *,
    cache: str = "fp16",
    max_new_tokens: int = 64,
    sampling: Sampling = GREEDY,
    stop_ids: Sequence[int] = (),
    seed: int = 0,
    implementation: str = "reference",
    group_size: int | None = None,
    residual_length: int | None = None,
    sinks: int = 0,
    rotation: str = "none",
    outlier_channels: int = 0,
    pre_rope: bool = False,
    layer_overrides: Sequence[tuple[Sequence[int], dict]] = (),
) -> Iterator[int]:
    """Yield generated token ids one by one (the stop token, if hit, is yielded last).

    Same programs per bucket as `generate`, but one jitted step per token, driven from Python.
    """
    params = decode_layout(params, config)
    tokens, lengths = make_prompt_batch([prompt])
    check_token_ids([prompt], config)
    max_len = tokens.shape[1] + bucket(max_new_tokens)
    c = new_cache(
        cache,
        config,
        1,
        max_len,
        params["embed"].dtype,
        **_cache_kw(
            group_size,
            residual_length,
            params,
            sinks=sinks,
            rotation=rotation,
            outlier_channels=outlier_channels,
            pre_rope=pre_rope,
            layer_overrides=tuple(layer_overrides),
        ),
    )
    logits, c = prefill_jit(params, config, tokens, lengths, c)
    rng = jax.random.key(seed)
    stops = set(int(s) for s in stop_ids)
    for step in range(max_new_tokens):
        tok = sample_jit(logits, jax.random.fold_in(rng, step), sampling)
        t = int(tok[0])
        yield t
        if t in stops or step == max_new_tokens - 1:
            return
        logits, c = decode_step_jit(params, config, tok, c, implementation=implementation)
