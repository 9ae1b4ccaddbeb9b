"""The kernel's PTX on a machine without a GPU: a deviceless XLA compile for an H200.

    bash bench/aot_setup.sh        # once: .venv-aot with jax[cuda13] (plugin + PJRT)
    .venv-aot/bin/python bench/aot_ptx.py --kbg 2:128,2:32 --out /tmp/ptx
    .venv-aot/bin/python bench/aot_ptx.py --kbg 2:32 --flags "num_splits=12;stages=3" --out DIR
    .venv-aot/bin/python bench/aot_ptx.py --kbg 2:128 --window 128 --out DIR  # windows in
    .venv-aot/bin/python bench/aot_ptx.py --fp8 64 --out DIR  # the fp8 kernel (fp8_64.ptx)
    .venv-aot/bin/python bench/aot_ptx.py --prerope 2:32 --window 0,128 --out DIR  # keys
                                   # before RoPE: the codes alone, and with windows and sinks
    python -m bench.sass_static /tmp/ptx/*.ptx --nvdisasm ...

The CUDA PJRT plugin compiles for a `GpuTargetConfigProto` (bench/h200_target_config.txtpb)
without a device (a compile-only topology, `jax.experimental.topologies`), and Mosaic GPU
lowers its kernels to PTX during that compile, so MOSAIC_GPU_DUMP_PTX leaves the PTX an H200
compiles (the same but for source line numbers), and ptxas's register count with it. Mosaic's
whole pipeline runs, LLVM and ptxas included, which the tests' cross-lowering stops short of:
CI compiles the default launches this way (.ci/run). Kernels never run here: timing and
numerics still need the device; the instruction mix (bench/sass_static.py) does not.

Shapes: B=2, Hkv=8, D=128, T=8k, one layer, the cache's own layout (`kivi_jax.KiviCache`);
the launch `choose_tuning`'s at B=8, T=128k (the anchor's), with --flags overrides on top
(`name=value` pairs of TuningConfig fields, `bench.common.override`). Writes one
`{kbits}_{vbits}_{G}_{flags or default}.ptx` per configuration and prints its path. Feeds
docs/performance.md's static step-loop counts (with bench/sass_static.py); no GPU needed.
"""

from __future__ import annotations

import argparse
import functools
import glob
import math
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import topologies

import kivi_jax
from bench.common import override, parse_kbg
from pallas_kernels.fp8_decode import fp8_decode
from pallas_kernels.kivi_decode import choose_tuning, kivi_decode
from pallas_kernels.prerope_decode import prerope_decode

TARGET = Path(__file__).with_name("h200_target_config.txtpb")
BATCH, KV_HEADS, TOKENS = 2, 8, 8192
ANCHOR_BATCH, ANCHOR_TOKENS = 8, 131072  # the launch is chosen for the anchor's shape


def cache_shapes(key_bits: int, value_bits: int, group_size: int, head_dim: int, window: int = 0):
    """ShapeDtypeStructs of a one-layer KiviCache's stores (windows of `window` slots, R =
    window; default R = 128): the kernel's cache operands."""
    config = kivi_jax.KiviConfig(
        key_bits=key_bits,
        value_bits=value_bits,
        group_size=group_size,
        residual_length=window or 128,
    )
    return jax.eval_shape(
        lambda: kivi_jax.KiviCache.init(
            config, num_layers=1, batch=BATCH, kv_heads=KV_HEADS, head_dim=head_dim, max_len=TOKENS
        )
    )


def compile_ptx(
    key_bits: int,
    value_bits: int,
    group_size: int,
    flags: str = "",
    *,
    hq: int = 32,
    head_dim: int = 128,
    target: Path = TARGET,
    window: int = 0,
) -> str:
    """The PTX text of the kernel for these bits, group size and TuningConfig overrides;
    window: with residual windows of that many slots attended in the kernel (the launch then
    `choose_tuning`'s at the compile shape, where the windows fit beside the pipelines)."""

    spec = _topology_spec(target)
    tuning = override(
        choose_tuning(
            BATCH if window else ANCHOR_BATCH,
            KV_HEADS,
            TOKENS if window else ANCHOR_TOKENS,
            key_bits=key_bits,
            value_bits=value_bits,
            group_size=group_size,
            head_dim=head_dim,
            q_heads=hq // KV_HEADS,
        ),
        flags,
    )
    c = cache_shapes(key_bits, value_bits, group_size, head_dim, window)
    stores = [spec(x) for s in (c.keys, c.values) for x in (s.codes, s.scale, s.minimum)]
    windows = (spec(c.keys.residual), spec(c.values.residual)) if window else ()
    kw = dict(
        key_bits=key_bits,
        value_bits=value_bits,
        group_size=group_size,
        sm_scale=1 / math.sqrt(head_dim),
        tuning=tuning,
    )

    @jax.jit
    def f(q, nt, layer, *arrays):
        stores, win = arrays[:6], arrays[6:]
        return kivi_decode(q, *stores, nt, layer, windows=win or None, **kw)

    return _dumped_ptx(
        f,
        spec(jax.ShapeDtypeStruct((BATCH, hq, head_dim), jnp.bfloat16)),
        spec(jax.ShapeDtypeStruct((BATCH,), jnp.int32)),
        spec(jax.ShapeDtypeStruct((), jnp.int32)),
        *stores,
        *windows,
    )


def _topology_spec(target: Path):
    """A ShapeDtypeStruct maker on the compile-only H200 device of `target`."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check
    topo = topologies.get_topology_desc(
        "", platform="cuda", target_config=target.read_text(), topology="1x1x1"
    )
    sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
    return lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _dumped_ptx(f, *specs) -> str:
    """The PTX of the one Mosaic GPU kernel in jitted `f`, compiled for `specs`."""
    with tempfile.TemporaryDirectory() as d:
        names = ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTX")
        old = {k: os.environ.get(k) for k in names}
        os.environ.update(MOSAIC_GPU_DUMP_TO=d, MOSAIC_GPU_DUMP_PTX="1")
        try:
            f.trace(*specs).lower().compile()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        ptx = glob.glob(f"{d}/*.ptx")
        if len(ptx) != 1:
            raise RuntimeError(
                f"expected one PTX dump, found {ptx}: is the CUDA plugin "
                "installed (bench/aot_setup.sh)?"
            )
        return Path(ptx[0]).read_text()


def compile_fp8_ptx(group_size: int, *, hq: int = 32, head_dim: int = 128, target=TARGET) -> str:
    """The PTX of the fp8 kernel (`pallas_kernels.fp8_decode`) at the anchor's shape (B=8,
    T=128k, Hkv=8, two layers), its chosen splits."""
    spec = _topology_spec(target)
    L, B, T, J = 2, ANCHOR_BATCH, ANCHOR_TOKENS, head_dim // group_size
    s = lambda shape, dtype: spec(jax.ShapeDtypeStruct(shape, dtype))
    f = jax.jit(
        functools.partial(fp8_decode, group_size=group_size, sm_scale=1 / math.sqrt(head_dim))
    )
    return _dumped_ptx(
        f,
        s((B, hq, head_dim), jnp.bfloat16),
        s((L, B, KV_HEADS, T, head_dim), jnp.uint8),
        s((L, B, KV_HEADS, J, T), jnp.float16),
        s((L, B, KV_HEADS, head_dim, T), jnp.uint8),
        s((L, B, KV_HEADS, J, T), jnp.float16),
        s((B,), jnp.int32),
        s((), jnp.int32),
    )


def compile_prerope_ptx(
    key_bits: int, value_bits: int, group_size: int, *, hq: int = 32, head_dim: int = 128,
    window: int = 0, target=TARGET,
) -> str:  # fmt: skip
    """The PTX of the pre-RoPE kernel (`pallas_kernels.prerope_decode`) at the anchor's shape
    (B=8, T=128k, Hkv=8, two layers), its chosen splits, keys rotated and 8 sinks (`best3`'s
    and `best25`'s form); with a `window`, the residual windows of that many slots and the
    sink buffers in the launch (bf16), as `decode_attention` runs it, else both left out."""
    spec = _topology_spec(target)
    L, B, T, J = 2, ANCHOR_BATCH, ANCHOR_TOKENS, head_dim // group_size
    s = lambda shape, dtype: spec(jax.ShapeDtypeStruct(shape, dtype))
    pk, pv = 8 // key_bits, 8 // value_bits
    v_codes = (T // (64 * pv), head_dim, 64) if value_bits == 2 else (head_dim, T // pv)
    per_row = lambda shape: (L, B, KV_HEADS, *shape)
    full = ()
    if window:  # windows, then sinks: passed after the cache's arrays
        bf16 = lambda shape: s(per_row(shape), jnp.bfloat16)
        full = (bf16((window, head_dim)), bf16((head_dim, window)))
        full += (bf16((8, head_dim)), bf16((8, head_dim)))

    def call(*a):
        cache = a[: len(a) - len(full)]
        kw, vw, ks, vs = a[len(cache) :] if full else (None,) * 4
        return prerope_decode(
            *cache,
            key_bits=key_bits,
            value_bits=value_bits,
            group_size=group_size,
            sm_scale=1 / math.sqrt(head_dim),
            basis_scale=1 / math.sqrt(head_dim),
            skip=8,
            windows=(kw, vw) if full else None,
            sinks=(ks, vs) if full else None,
            max_len=T + window if window else 0,
        )

    f = jax.jit(call)
    return _dumped_ptx(
        f,
        s((B, hq, head_dim), jnp.bfloat16),
        s(per_row((T // pk, head_dim)), jnp.uint8),
        s(per_row((T // group_size, head_dim)), jnp.float16),
        s(per_row((T // group_size, head_dim)), jnp.float16),
        s(per_row(v_codes), jnp.uint8),
        s(per_row((J, T)), jnp.float16),
        s(per_row((J, T)), jnp.float16),
        s((B,), jnp.int32),
        s((), jnp.int32),
        s((head_dim // 2,), jnp.float32),
        s((head_dim, head_dim), jnp.float32),
        *full,
    )


def ptx_name(key_bits: int, value_bits: int, group_size: int, flags: str, window: int = 0) -> str:
    """The file name of a configuration's PTX: '2_2_32_num_splits12.ptx', '2_2_128_default.ptx',
    '2_2_128_default_w128.ptx' (with windows of 128 slots)."""
    tag = flags.replace(",", "_").replace("=", "") or "default"
    return f"{key_bits}_{value_bits}_{group_size}_{tag}{f'_w{window}' if window else ''}.ptx"


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kbg", default="2:128", help="bits:G (or kbits:vbits:G) list")
    ap.add_argument(
        "--flags", default="", help="TuningConfig overrides name=value,...; ';' separates variants"
    )
    ap.add_argument("--hq", type=int, default=32, help="query heads (of Hkv = 8)")
    ap.add_argument("--D", type=int, default=128, help="head dim")
    ap.add_argument(
        "--window",
        default="0",
        help="residual-window slots attended in the kernel (0: none); a comma list compiles each",
    )
    ap.add_argument("--fp8", default="", help="G list: the fp8 kernel's PTX instead (fp8_{G}.ptx)")
    ap.add_argument(
        "--prerope",
        default="",
        help="bits:G list: the pre-RoPE kernel's PTX instead (prerope_{k}_{v}_{G}.ptx)",
    )
    ap.add_argument("--out", required=True, help="directory for the .ptx files")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if a.fp8:
        for g in (int(x) for x in a.fp8.split(",")):
            path = out / f"fp8_{g}.ptx"
            path.write_text(compile_fp8_ptx(g, hq=a.hq, head_dim=a.D))
            print(path, flush=True)
            paths.append(path)
        return paths
    if a.prerope:
        for kb, vb, g in parse_kbg(a.prerope):
            for w in (int(x) for x in a.window.split(",")):
                path = out / f"prerope_{kb}_{vb}_{g}{f'_w{w}' if w else ''}.ptx"
                ptx = compile_prerope_ptx(kb, vb, g, hq=a.hq, head_dim=a.D, window=w)
                path.write_text(ptx)
                print(path, flush=True)
                paths.append(path)
        return paths
    for kb, vb, g in parse_kbg(a.kbg):
        for flags in a.flags.split(";"):
            for w in (int(x) for x in a.window.split(",")):
                path = out / ptx_name(kb, vb, g, flags, w)
                path.write_text(compile_ptx(kb, vb, g, flags, hq=a.hq, head_dim=a.D, window=w))
                print(path, flush=True)
                paths.append(path)
    return paths


if __name__ == "__main__":
    main()
