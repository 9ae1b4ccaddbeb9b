"""Shared pieces of the bench tools: random caches of a shape, the dependent-call chains that
time one decode-attention call as a model makes it, the result file's environment block.

Not a tool itself (no command line); the tools import it as `bench.common`.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import kivi_jax

L2_BYTES = 50 << 20  # the H200's L2 (h200_target_config.txtpb); see `layers_for`
CHAIN_STEP = 1e-3  # weight of a call's output in the next call's query (`kivi_chain`)

# ---------------------------------------------------------------------------------------------
# Shapes and bytes


def parse_kbg(spec: str) -> list[tuple[int, int, int]]:
    """ "2:128,4:2:32" -> [(2, 2, 128), (4, 2, 32)]: bits:G (keys and values alike) or
    key_bits:value_bits:G per comma-separated item."""
    out = []
    for item in filter(None, spec.split(",")):
        parts = [int(x) for x in item.split(":")]
        if len(parts) == 2:
            out.append((parts[0], parts[0], parts[1]))
        elif len(parts) == 3:
            out.append(tuple(parts))
        else:
            raise ValueError(f"expected bits:G or key_bits:value_bits:G, got {item!r}")
    return out


def parse_ints(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x]


def kivi_bytes(
    batch,
    kv_heads,
    head_dim,
    tokens,
    residual,
    key_bits,
    value_bits,
    group_size,
    dtype_bytes=2,
    scale_bytes=2,
    sinks=0,
) -> int:
    """Bytes one call reads from one layer: T quantized tokens' codes, scales and minimums of
    keys and values, and R full-precision tokens of each (and the N sinks, with `sinks`)."""
    codes = tokens * head_dim * (key_bits + value_bits) // 8
    scales = 2 * scale_bytes * (tokens // group_size * head_dim + head_dim // group_size * tokens)
    exact = 2 * (residual + sinks) * head_dim * dtype_bytes
    return batch * kv_heads * (codes + scales + exact)


def dense_bytes(batch, kv_heads, head_dim, length, dtype_bytes=2) -> int:
    """Bytes one call reads from one layer of a dense K/V cache of `length` tokens per row."""
    return 2 * batch * length * kv_heads * head_dim * dtype_bytes


def layers_for(bytes_per_layer: int, calls: int) -> int:
    """Distinct layers a chain of `calls` calls cycles through: enough that the bytes it reads
    between two visits of a layer exceed the L2 four times (a model's step reads every layer
    once, so a layer's cache is never L2-resident when it is read again), at most `calls`."""
    return int(min(calls, max(1, math.ceil(4 * L2_BYTES / bytes_per_layer))))


# ---------------------------------------------------------------------------------------------
# Inputs


def random_kivi_cache(
    key,
    *,
    layers: int,
    batch: int,
    kv_heads: int,
    head_dim: int,
    tokens: int,
    key_bits: int,
    value_bits: int,
    group_size: int,
    residual: int = 128,
    dtype=jnp.bfloat16,
    lengths: Sequence[int] | None = None,
    sinks: int = 0,
    rotation: str = "none",
) -> kivi_jax.KiviCache:
    """A `kivi_jax.KiviCache` (KIVI axes, fp16 scales; `sinks` and `rotation` as
    `kivi_jax.KiviConfig` takes them) whose rows hold `lengths` tokens (default tokens +
    residual each: T quantized, the newest R in the residual windows).

    The store arrays are random: any byte is a valid packed code in the cache's layout, scales
    lie in [0.02, 0.2], minimums in [-0.5, 0], residual tokens are N(0, 1). Decode cost does
    not depend on the values; the check modes compare implementations on the same cache.
    Raises ValueError unless the quantized part of a full row holds exactly `tokens` tokens.
    """
    config = kivi_jax.KiviConfig(
        key_bits=key_bits,
        value_bits=value_bits,
        group_size=group_size,
        residual_length=residual,
        sinks=sinks,
        rotation=rotation,
    )
    if lengths is None:
        lengths = [tokens + residual] * batch
    dims = dict(
        num_layers=layers,
        batch=batch,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_len=tokens + residual,
        dtype=dtype,
    )
    abstract = jax.eval_shape(lambda: kivi_jax.KiviCache.init(config, **dims))
    full = jnp.full((1,), tokens + residual, jnp.int32)
    split = min(
        int(abstract.keys.full_precision_from(full)[0]),
        int(abstract.values.full_precision_from(full)[0]),
    )
    if split != tokens:
        raise ValueError(
            f"a row of tokens={tokens} + R={residual} quantizes {split} tokens, not {tokens}: "
            f"the newest max(R, G={group_size}) tokens are read from the windows"
        )
    return _fill(key, config, tuple(dims.items()), jnp.asarray(lengths, jnp.int32))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _fill(key, config, dims, lengths):
    # Inside one jit the zeros of `init` are replaced before use, so they are never allocated.
    cache = kivi_jax.KiviCache.init(config, **dict(dims))
    keys = jax.random.split(key, 10)
    normal = lambda k, a: jax.random.normal(k, a.shape).astype(a.dtype)

    def fill(store, ks):
        u = lambda k, lo, hi: jax.random.uniform(k, store.scale.shape, jnp.float32, lo, hi)
        return dataclasses.replace(
            store,
            codes=jax.random.bits(ks[0], store.codes.shape, jnp.uint8),
            scale=u(ks[1], 0.02, 0.2).astype(store.scale.dtype),
            minimum=u(ks[2], -0.5, 0.0).astype(store.minimum.dtype),
            residual=normal(ks[3], store.residual),
            sink=None if store.sink is None else normal(ks[4], store.sink),
        )

    return dataclasses.replace(
        cache, keys=fill(cache.keys, keys[:5]), values=fill(cache.values, keys[5:]), lengths=lengths
    )


def random_dense_kv(
    key, *, layers: int, batch: int, kv_heads: int, head_dim: int, length: int, dtype=jnp.float16
) -> list[tuple[jax.Array, jax.Array]]:
    """`layers` distinct (K, V) pairs [B, S, Hkv, D] for `jax.nn.dot_product_attention`: one
    buffer per layer, so that no call reads a slice of a stacked array (a copy for a custom
    call's operand)."""
    shape = (batch, length, kv_heads, head_dim)
    make = jax.jit(lambda k: jax.random.normal(k, shape, dtype))
    return [
        (make(jax.random.fold_in(key, 2 * i)), make(jax.random.fold_in(key, 2 * i + 1)))
        for i in range(layers)
    ]


def random_query(key, batch: int, q_heads: int, head_dim: int, dtype=jnp.bfloat16):
    return jax.random.normal(key, (batch, q_heads, head_dim), jnp.float32).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Chains of dependent calls


def kivi_chain(
    calls: int, layers: int, implementation: str = "pallas", tuning=None, static_layer=False
):
    """jit(q [B, Hq, D], cache) -> q after `calls` dependent `kivi_jax.decode_attention` calls,
    straight-line: call i reads layer i % layers with the query q + CHAIN_STEP * (previous
    call's output), so no call can start before the previous one ends or be hoisted, merged
    or skipped, and one launch spreads the host's dispatch over `calls` calls. The calls share
    one jitted step with the layer index as an argument (as in a model's layer scan; the
    kernel reads the index itself): the kernel is traced and lowered once, not once per call.
    `tuning`: the kernel's TuningConfig (None: its own choice). static_layer: the index a
    Python int instead, as a model's unrolled layer loop passes it (what a cache made with
    `per_layer` reads without a switch over its layers); traced once per distinct layer."""
    step = jax.jit(
        functools.partial(kivi_jax.decode_attention, implementation=implementation, tuning=tuning),
        static_argnums=(2,) if static_layer else (),
    )
    index = (lambda i: i % layers) if static_layer else (lambda i: jnp.int32(i % layers))

    def run(q, cache):
        for i in range(calls):
            q = q + CHAIN_STEP * step(q, cache, index(i))
        return q

    return jax.jit(run)


def dense_chain(calls: int, implementation: str = "cudnn", masked: bool = True):
    """jit(q [B, 1, Hq, D], kvs, lengths [B]) -> q after `calls` dependent
    `jax.nn.dot_product_attention` calls over kvs[i % len(kvs)], chained as `kivi_chain`.
    masked: rows of `lengths` tokens through key_value_seq_lengths; False attends every
    position of the buffers."""

    def run(q, kvs, lengths):
        for i in range(calls):
            k, v = kvs[i % len(kvs)]
            o = jax.nn.dot_product_attention(
                q,
                k,
                v,
                implementation=implementation,
                key_value_seq_lengths=lengths if masked else None,
            )
            q = q + CHAIN_STEP * o
        return q

    return jax.jit(run)


# ---------------------------------------------------------------------------------------------
# Timing


def launch_seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one launch of fn(), synchronized on its result."""
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def alternate(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 2):
    """Times every fn of `fns` once per round, in alternating order (ABBA: drift of the clock
    or of the machine falls on both alike), after `warmup` untimed launches each (the first
    compiles). Returns ({name: [seconds per round]}, {name: first launch seconds})."""
    first = {}
    for name, fn in fns.items():
        first[name] = launch_seconds(fn)
        for _ in range(warmup - 1):
            launch_seconds(fn)
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(launch_seconds(fns[name]))
    return times, first


def median_ms(seconds: Sequence[float], calls: int) -> float:
    """Median milliseconds per call over launches of `calls` calls each."""
    return 1e3 * statistics.median(seconds) / calls


# ---------------------------------------------------------------------------------------------
# Tuning overrides


def override(tuning, flags: str):
    """`tuning` (a frozen dataclass, the kernel's TuningConfig) with "name=value,..." replaced:
    each value converted to the field's current type (bools from 0/1/true/false); an unknown
    name raises TypeError (dataclasses.replace)."""
    changes = {}
    for item in filter(None, flags.split(",")):
        name, _, value = item.partition("=")
        current = getattr(tuning, name, None)
        if isinstance(current, bool):
            value = value.strip().lower() in ("1", "true", "yes")
        elif isinstance(current, int):
            value = int(value)
        elif isinstance(current, float):
            value = float(value)
        changes[name] = value
    return dataclasses.replace(tuning, **changes)


# ---------------------------------------------------------------------------------------------
# Results


def gpu_line() -> dict:
    """The GPU's name, driver and UUID from nvidia-smi ({} where there is none)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    name, driver, uuid = (x.strip() for x in out.splitlines()[0].split(","))
    return dict(gpu=name, driver=driver, gpu_uuid=uuid)


def env_info(argv: Sequence[str] | None = None, tool: str | None = None) -> dict:
    """The environment block of a results file: date (UTC), device, GPU and driver, versions,
    and the command line (`python -m bench.<tool> ARGS` when `tool` is given)."""
    import jaxlib

    dev = jax.devices()[0]
    args = list(sys.argv[1:] if argv is None else argv)
    command = ["python", "-m", f"bench.{tool}"] if tool else [sys.argv[0]]
    info = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        platform=dev.platform,
        device=getattr(dev, "device_kind", str(dev)),
        **gpu_line(),
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        numpy=np.__version__,
        python=platform.python_version(),
        command=" ".join(command + args),
    )
    try:
        import flax

        info["flax"] = flax.__version__
    except ImportError:  # flax is the models' dependency, not the kernel tools'
        pass
    return info


def write_json(path: str | Path, **content) -> Path:
    """Writes `content` as indented JSON (creating the directory); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=1, default=str) + "\n")
    return path


def cache_tuning(cache, q_heads: int):
    """The launch the kernel runs for this cache and q_heads query heads (what
    decode_attention's tuning=None gives: the windows in the kernel where they fit)."""
    from kivi_jax.attention import kernel_window
    from pallas_kernels.kivi_decode import call_tuning

    cfg = cache.config
    tuning, _ = call_tuning(
        cache.batch,
        cache.kv_heads,
        cache.keys.capacity,
        key_bits=cfg.key_bits,
        value_bits=cfg.value_bits,
        group_size=cfg.group_size,
        head_dim=cache.head_dim,
        q_heads=q_heads // cache.kv_heads,
        window=kernel_window(cache),
    )
    return tuning
