"""A kernel variant's PTX on a machine without a GPU: a deviceless XLA compile for an H200.

    bash bench/aot_setup.sh            # once: .venv-aot with jax[cuda13] (plugin + PJRT)
    .venv-aot/bin/python bench/aot_ptx.py --kbg 2:32 --flags "" --out /tmp/ptx
    python3 bench/sass_static.py /tmp/ptx/*.ptx --nvdisasm ...

The CUDA PJRT plugin compiles for a `GpuTargetConfigProto` (bench/h200_target_config.txtpb)
without a device (a compile-only topology, `jax.experimental.topologies`), and Mosaic GPU
lowers its kernels to PTX during that compile, so MOSAIC_GPU_DUMP_PTX leaves the same PTX the
H200 compiles (checked against run 97's dump of the 2-bit G=32 default: identical but for the
source line numbers), and with it the register count ptxas reports. Kernels never run here:
for timing and numerics the device is still needed; for the instruction mix (with
bench/sass_static.py) and for Mosaic's LLVM passes (the native-only failure of run 92) it is
not. Shapes: B=2, Hkv=8, D=128, T=8k, one layer; the launch choose_tuning's at B=8 T=128k
(the anchor's), with --flags overrides on top (`decode_attention.override`).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import tempfile

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check against

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import decode_attention as da  # noqa: E402

from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402

TARGET = os.path.join(os.path.dirname(__file__), "h200_target_config.txtpb")


def compile_ptx(kb: int, vb: int, G: int, flags: str, *, hq: int = 32, D: int = 128,
                target: str = TARGET) -> str:
    """The PTX text of the kernel for these bits, group size and TuningConfig overrides."""
    topo = topologies.get_topology_desc("", platform="cuda", target_config=open(target).read(),
                                        topology="1x1x1")
    sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    B, Hkv, T, L = 2, 8, 8192, 1
    tun = da.override(kd.choose_tuning(8, Hkv, 131072, key_bits=kb, value_bits=vb,
                                       group_size=G, head_dim=D, q_heads=hq // Hkv), flags)
    cache = (S((L, B, Hkv, T * kb // 8, D), jnp.uint8), S((L, B, Hkv, T // G, D), jnp.float16),
             S((L, B, Hkv, T // G, D), jnp.float16),
             # the cache's value codes (2-bit: blocks of 64 byte columns)
             S((L, B, Hkv, T * vb // 8 // 64, D, 64) if da.value_codes_blocked(vb)
               else (L, B, Hkv, D, T * vb // 8),
               jnp.uint8),
             S((L, B, Hkv, D // G, T), jnp.float16), S((L, B, Hkv, D // G, T), jnp.float16))
    kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=1 / math.sqrt(D), tuning=tun)
    f = jax.jit(lambda q, nt, layer, *c: kd.kivi_decode(q, *c, nt, layer, **kw))
    with tempfile.TemporaryDirectory() as d:
        old = {k: os.environ.get(k) for k in ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTX")}
        os.environ.update(MOSAIC_GPU_DUMP_TO=d, MOSAIC_GPU_DUMP_PTX="1")
        try:
            f.trace(S((B, hq, D), jnp.bfloat16), S((B,), jnp.int32), S((), jnp.int32),
                    *cache).lower().compile()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        ptx = glob.glob(f"{d}/*.ptx")
        if len(ptx) != 1:
            raise RuntimeError(f"expected one PTX dump, found {ptx}: is the CUDA plugin "
                               "installed (bench/aot_setup.sh)?")
        return open(ptx[0]).read()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kbg", default="2:128", help="bits:G (or kbits:vbits:G) list")
    ap.add_argument("--flags", default="", help="TuningConfig overrides; ';' separates variants")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--out", required=True, help="directory for the .ptx files")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for kbg in a.kbg.split(","):
        parts = list(map(int, kbg.split(":")))
        kb, vb, G = parts if len(parts) == 3 else (parts[0], parts[0], parts[1])
        for flags in a.flags.split(";"):
            name = f"{kb}_{vb}_{G}_{flags.replace(',', '_').replace('=', '') or 'default'}"
            path = os.path.join(a.out, f"{name}.ptx")
            ptx = compile_ptx(kb, vb, G, flags, hq=a.hq, D=a.D)  # raises where Mosaic fails
            with open(path, "w") as fh:
                fh.write(ptx)
            print(path, flush=True)


if __name__ == "__main__":
    main()
