"""The launches of one decode step, counted from a deviceless compile for the H200: what a
model's generation loop runs per layer and per step around the GEMMs, the copies and
transposes of whole cache buffers that XLA's layout assignment inserts, and the distinct
kernels XLA compiles.

    .venv-aot/bin/python bench/step_launches.py                          # fp16, kivi2
    .venv-aot/bin/python bench/step_launches.py --caches kivi2 --group-size 32 --sinks 8 \\
        --rotate both --check
    .venv-aot/bin/python bench/step_launches.py --time-layers 32   # compile seconds, Llama-3-8B

The generation loop (`models.generate.decode_loop_jit`, as `bench.generate` runs it: Llama-3-8B
shapes with fewer layers, bf16, B = --batch rows (1) of T = --context tokens (4k), implementation
"auto") is compiled at two layer
counts for the H200 target (`bench/h200_target_config.txtpb`, a compile-only topology: no GPU);
its while body's kernels are counted (fusions, custom calls, copies: each a launch). The
difference between the two counts is the launches per layer, the rest those per step. A
`copy` or `transpose` whose result has the shape of a whole [L, B, Hkv, W, D] window array is
a full pass over that cache buffer; one per layer is an L-squared cost. With several rows the
layers' window writes are scatters, and XLA copies the window where a read of it is not
ordered before them (check B > 1 too). A copy, transpose or slice of a layer's stores (at
least half the elements of its 2-bit keys) is a move too: a GEMM that reads a slice of a
stacked store gets a copy of it first, what `kivi_jax.make_cache`'s per_layer avoids for fp8.
Distinct kernels are the fused computations that differ other than by names: XLA compiles
each once and reuses it for every identical fusion, so in an unrolled model they should not
grow with the layers (a layer index folded into the fusions as a constant makes every layer's
kernels its own, and the compile time grows with them; XLA's shape-dependent fusion choices
still add or merge one or two between layer counts). `--check` exits 1 on any move, or when
distinct kernels grow by one per two layers or more; `--max-per-layer NAME=N` exits 1 where a
cache's launches per layer exceed N.
Feeds the launch counts of docs/performance.md; run as
`.venv-aot/bin/python bench/step_launches.py` (`.ci/run` runs the check).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies

TARGET = Path(__file__).with_name("h200_target_config.txtpb")
LAUNCH = re.compile(r" (fusion|custom-call|copy|transpose)\(")


def step_body(hlo: str) -> list[str]:
    """The instructions of the decode loop's while body in a compiled module's text."""
    body = re.search(r"while\(.*?body=%?([\w.\-]+)", hlo).group(1)
    start = hlo.index(f"%{body} ")
    return [line.strip() for line in hlo[start : hlo.index("\n}\n", start)].splitlines()[1:]]


INSTRUCTION = re.compile(r"^(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<type>.*?) (?P<op>[\w\-]+)\(")
# A launch that writes a new buffer from an old one: a copy, a transpose, a slice's fusion (not
# a dynamic-update-slice's, which writes in place).
MOVE = re.compile(r"copy|transpose|(?<!update_)slice_fusion")


def count(lines: list[str], window_shape: str, store_elements: int) -> tuple[int, int]:
    """(launches, moves) among a while body's instructions. Moves: copies and transposes of a
    whole [L, ...] window array, and copies, transposes and slices of at least
    `store_elements` elements (a layer's stores read through a copy of their slice)."""
    launches, moves = 0, 0
    for line in lines:
        if not LAUNCH.search(line):
            continue
        launches += 1
        m = INSTRUCTION.match(line)
        if not m or not (MOVE.search(m["op"]) or MOVE.search(m["name"])):
            continue
        window = re.match(rf"{re.escape(window_shape)}\{{", m["type"]) is not None
        sizes = [
            np.prod([int(d) for d in x.split(",") if d])
            for x in re.findall(r"\[([\d,]*)\]", m["type"])
        ]
        moves += window or max(sizes, default=0) >= store_elements
    return launches, moves


def distinct_kernels(hlo: str) -> int:
    """Fused computations of a compiled module's text that differ other than by names and
    metadata: the kernels XLA compiles (identical fusions share one)."""
    bodies = set()
    for m in re.finditer(r"^%fused[\w.\-]* .*?\{\n(.*?)\n\}", hlo, re.M | re.S):
        body = re.sub(r", metadata=\{[^}]*\}", "", m.group(1))
        bodies.add(re.sub(r"%[\w.\-]+", "%x", body))
    return len(bodies)


def compile_step(
    cache_name: str,
    layers: int,
    knobs: dict,
    group_size: int,
    seconds: dict | None = None,
    batch: int = 1,
    context: int = 4096,
) -> tuple[str, str]:
    """The compiled decode loop's text (deviceless, for the H200) and its window's HLO shape;
    `seconds`, where given, receives the wall seconds of its trace, lower and compile."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check
    import kivi_jax.attention
    from bench import generate as bench_generate
    from models import generate, llama
    from models.presets import get_preset

    kivi_jax.attention.pallas_available = lambda: True  # the target is an H200
    kivi_jax.attention.on_gpu = lambda: True
    topo = topologies.get_topology_desc(
        "", platform="cuda", target_config=TARGET.read_text(), topology="1x1x1"
    )
    sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    config = dataclasses.replace(get_preset("llama-3-8b"), num_layers=layers)
    dtype, steps = jnp.bfloat16, 64
    params = jax.eval_shape(
        lambda: llama.decode_params(llama.init_params(config, jax.random.key(0), dtype))
    )
    cache = jax.eval_shape(
        lambda: bench_generate.filled_cache(
            cache_name, config, batch, context, steps, dtype, 128, group_size, True, knobs or None
        )
    )
    args = (
        params,
        jax.ShapeDtypeStruct((batch, config.vocab_size), jnp.float32),
        cache,
        jax.eval_shape(lambda: jax.random.key(0)),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    args = jax.tree.map(spec, args)
    start = time.perf_counter()
    traced = generate.decode_loop_jit.trace(
        *args,
        generate._pad_stops([]),
        config=config,
        num_slots=generate.bucket(steps + 1),
        sampling=generate.GREEDY,
        implementation="auto",
    )
    stamps = [start, time.perf_counter()]
    lowered = traced.lower()
    stamps.append(time.perf_counter())
    hlo = lowered.compile().as_text()
    stamps.append(time.perf_counter())
    if seconds is not None:
        seconds.update(zip(("trace", "lower", "compile"), np.diff(stamps), strict=True))
    hkv, d = config.num_kv_heads, config.head_dim
    window_shape = f"bf16[{layers},{batch},{hkv},128,{d}]"
    return hlo, window_shape


def time_compiles(names: list[str], layers: int, knobs: dict, group_size: int) -> int:
    """Prints the seconds of each cache's deviceless trace, lower and compile of the loop
    (this machine's CPU, the Mosaic kernel's own compile included: its lowering to Mosaic's
    IR under "lower", the rest under "compile"; a GPU host's compile and first run adds
    loading the kernels)."""
    print(f"cache | seconds to compile at L={layers} (trace, lower, compile) | distinct kernels")
    for name in names:
        kn = {} if name == "fp16" else knobs
        seconds = {}
        hlo, _ = compile_step(name, layers, kn, group_size, seconds)
        split = ", ".join(f"{v:.2f}" for v in seconds.values())
        label = name + "".join(f" {k}={v}" for k, v in kn.items())
        total = sum(seconds.values())
        print(f"{label} | {total:.2f} ({split}) | {distinct_kernels(hlo)}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caches", default="fp16,kivi2", help="cache names")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=0, help="sinks of the quantized caches")
    ap.add_argument("--rotate", default="none", help="rotation of the quantized caches")
    ap.add_argument("--layers", default="2,4", help="the two layer counts compiled")
    ap.add_argument("--batch", type=int, default=1, help="rows of the cache")
    ap.add_argument("--context", type=int, default=4096, help="tokens per row")
    ap.add_argument(
        "--check",
        action="store_true",
        help="exit 1 on a move, or if distinct kernels grow by one per two layers",
    )
    ap.add_argument(
        "--max-per-layer",
        default="",
        help="NAME=N,...: exit 1 where a cache's launches per layer exceed N (a regression)",
    )
    ap.add_argument(
        "--time-layers",
        type=int,
        default=0,
        help="instead: seconds to trace, lower and compile the loop at this many layers",
    )
    args = ap.parse_args(argv)
    from models.presets import get_preset

    la, lb = (int(x) for x in args.layers.split(","))
    if not 0 < la < lb:
        raise SystemExit("--layers: two increasing positive counts, e.g. 2,4")
    knobs = {}
    if args.sinks:
        knobs["sinks"] = args.sinks
    if args.rotate != "none":
        knobs["rotation"] = args.rotate
    if args.time_layers:
        return time_compiles(args.caches.split(","), args.time_layers, knobs, args.group_size)
    print(
        "cache | launches per layer | launches per step besides | moves per step | distinct kernels"
    )
    budget = parse_budget(args.max_per_layer)
    grows = over = False
    for name in args.caches.split(","):
        kn = {} if name == "fp16" else knobs
        hlos = [
            compile_step(name, n, kn, args.group_size, batch=args.batch, context=args.context)
            for n in (la, lb)
        ]
        shape = get_preset("llama-3-8b")  # compile_step's model
        # half the elements of a layer's 2-bit keys (four codes a byte)
        store = args.batch * args.context * shape.num_kv_heads * shape.head_dim // 8
        (na, ma), (nb, mb) = (count(step_body(hlo), shape, store) for hlo, shape in hlos)
        ka, kb = (distinct_kernels(hlo) for hlo, _ in hlos)
        per_layer = (nb - na) / (lb - la)
        label = name + "".join(f" {k}={v}" for k, v in kn.items())
        print(
            f"{label} | {per_layer:g} | {na - per_layer * la:g} | {ma} at L={la}, {mb} at L={lb}"
            f" | {ka} at L={la}, {kb} at L={lb}"
        )
        grows |= ma > 0 or mb > 0 or 2 * (kb - ka) >= lb - la
        if per_layer > budget.get(name, float("inf")):
            print(f"{name}: {per_layer:g} launches per layer, over {budget[name]}", file=sys.stderr)
            over = True
    if args.check and grows:
        print("a move of a window or stores, or kernels growing with the layers", file=sys.stderr)
    return 1 if (args.check and grows) or over else 0


def parse_budget(text: str) -> dict[str, float]:
    """'kivi2=15,best3=20' -> {'kivi2': 15.0, 'best3': 20.0} (empty: no budget)."""
    budget = {}
    for item in filter(None, text.split(",")):
        name, _, n = item.partition("=")
        if not name or not n:
            raise SystemExit(f"--max-per-layer: NAME=N items, got {item!r}")
        budget[name] = float(n)
    return budget


if __name__ == "__main__":
    sys.exit(main())
