"""Where a decode step's time goes: one jitted `decode_step` against the bytes it must read.

    PYTHONPATH=. python3 bench/step_anatomy.py --points 1x4096:fp16:reference,16x4096:kivi2:auto
    XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true PYTHONPATH=. python3 bench/step_anatomy.py

For each point (batch x context : cache : implementation[: random]) it times `steps` calls of
the jitted decode step (cache donated, random bf16 weights of the preset), reports ms per step,
the bytes a step must read (weights once, plus the cache) and what that is in TB/s, and lists
the largest non-GEMM buffers the compiled step writes (a copy of a weight matrix per layer is
what a scan over stacked weights costs when XLA cannot read the GEMM operand in place).
Options after the implementation, colon separated: `random` fills the cache with random
codes, scales and residual instead of zeros; `unstacked` runs the layers as a Python loop over
per-layer weight arrays (separate buffers, so no slice of a stacked array is ever a GEMM
operand); `dsf` compiles with XLA's dynamic-slice fusion, `cublas` without Triton GEMM
fusions (`compiler_options`).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models import generate as G
from models import llama
from models.presets import get_preset

_DT_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "u8": 1, "s8": 1, "pred": 1,
             "f8e4m3fn": 1}
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\][^ ]* ([\w\-]+)\(")


def big_writes(hlo: str, min_mb: float = 4.0, skip=("parameter", "get-tuple-element", "tuple",
                                                     "bitcast", "custom-call", "constant")):
    """(op, dtype[shape], MB, count) of instructions writing >= min_mb, largest first."""
    found: dict[tuple[str, str], list] = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, dt, dims, op = m.groups()
        if op in skip or dt not in _DT_BYTES:
            continue
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        mb = n * _DT_BYTES[dt] / 2**20
        if mb < min_mb:
            continue
        kind = name.split(".")[0]
        key = (f"{op}:{kind}", f"{dt}[{dims}]")
        found.setdefault(key, [mb, 0])[1] += 1
    return sorted(((k[0], k[1], v[0], v[1]) for k, v in found.items()), key=lambda r: -r[2] * r[3])


def randomize(cache, key):
    """Random codes, positive scales, signed minimums and residual in place of zeros."""
    leaves, tree = jax.tree.flatten(cache)
    keys = jax.random.split(key, len(leaves))
    out = []
    for leaf, k in zip(leaves, keys, strict=True):
        if leaf.ndim < 3:  # lengths
            out.append(leaf)
        elif leaf.dtype == jnp.uint8:
            out.append(jax.random.bits(k, leaf.shape, jnp.uint8))
        else:
            out.append((jax.random.normal(k, leaf.shape, jnp.float32) * 0.05).astype(leaf.dtype))
    c = jax.tree.unflatten(tree, out)
    if hasattr(c, "keys") and hasattr(c.keys, "scale"):  # scales must be positive
        c = dataclasses.replace(
            c,
            keys=dataclasses.replace(c.keys, scale=jnp.abs(c.keys.scale) + 1e-3),
            values=dataclasses.replace(c.values, scale=jnp.abs(c.values.scale) + 1e-3),
        )
    return c


def run_point(params, config, batch, context, cache_name, impl, opts, steps, group_size,
              show_hlo, unstacked, dump=None):
    c = G.new_cache(cache_name, config, batch, context + steps + 2, jnp.bfloat16,
                    **({} if cache_name == "fp16" else dict(group_size=group_size)))
    c = dataclasses.replace(c, lengths=jnp.full((batch,), context, jnp.int32))
    if "random" in opts:
        c = randomize(c, jax.random.key(1))
    nbytes = c.nbytes().total
    if "unstacked" in opts:
        params = unstacked()
    step = jax.jit(lambda p, t, c: llama.decode_step(p, config, t, c, implementation=impl),
                   donate_argnums=2)
    tokens = jnp.zeros((batch,), jnp.int32)
    copts = {}
    if "dsf" in opts:
        copts["xla_gpu_enable_dynamic_slice_fusion"] = True
    if "cublas" in opts:
        copts["xla_gpu_enable_triton_gemm"] = False
    copts = copts or None
    compiled = step.lower(params, tokens, c).compile(compiler_options=copts)
    writes = big_writes(compiled.as_text()) if show_hlo else []
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        name = f"{batch}x{context}_{cache_name}_{impl}_{'_'.join(opts)}".rstrip("_")
        (dump / f"{name}.hlo.txt").write_text(compiled.as_text())
    logits, c = compiled(params, tokens, c)  # warm-up
    jax.block_until_ready(c)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, c = compiled(params, tokens, c)
        jax.block_until_ready((logits, c))
        times.append((time.perf_counter() - t0) / steps)
    return float(np.median(times)) * 1e3, nbytes, writes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--points", default="1x4096:fp16:reference,16x4096:kivi2:auto")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--hlo", action="store_true", help="list the largest buffers written")
    ap.add_argument("--label", default="")
    ap.add_argument("--dump", type=Path, default=None, help="write each compiled step's HLO here")
    args = ap.parse_args(argv)
    config = get_preset(args.model)
    params = llama.init_params(config, jax.random.key(0), jnp.bfloat16)
    wbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    split = []

    def unstacked():  # per-layer weights (llama.unstack_layers), made once on first use
        if not split:
            split.append(llama.unstack_layers(params))
        return split[0]
    print(f"# {config.name}: {wbytes / 1e9:.2f} GB of weights; {jax.devices()[0].device_kind}; "
          f"jax {jax.__version__}; {args.label}", flush=True)
    rows = []
    for p in args.points.split(","):
        bc, cache_name, impl, *rest = p.split(":")
        batch, context = (int(v) for v in bc.split("x"))
        ms, nbytes, writes = run_point(params, config, batch, context, cache_name, impl,
                                       rest, args.steps, args.group_size, args.hlo, unstacked,
                                       args.dump)
        tbs = (wbytes + nbytes) / (ms * 1e-3) / 1e12
        rows.append((p, ms, (wbytes + nbytes) / 1e9, tbs))
        print(f"{p}: {ms:.3f} ms/step, reads >= {(wbytes + nbytes) / 1e9:.2f} GB "
              f"({tbs:.2f} TB/s)", flush=True)
        for op, shape, mb, n in writes[:12]:
            print(f"    {op:40s} {shape:28s} {mb:8.1f} MB x {n}")
    print(f"\n| point ({args.label}) | ms/step | GB read | TB/s |\n|---|---|---|---|")
    for p, ms, gb, tbs in rows:
        print(f"| {p} | {ms:.3f} | {gb:.2f} | {tbs:.2f} |")


if __name__ == "__main__":
    main()
