#!/usr/bin/env bash
# Run 12 (one device call): where the run-11 kernel's time goes now. Load pipeline alone,
# compute alone (copies that hit L2), the contiguous value-code layout, at the anchor for
# 2/4-bit G=128 and 2-bit G=32; plus a numerics check of widen8 on that layout.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 120 python3 - <<'PY' 2>&1 | tail -6 | tee "$OUT/alt_check.txt"
import math, jax, jax.numpy as jnp, numpy as np, sys
sys.path.insert(0, "bench")
import decode_attention as da
from pallas_kernels import kivi_decode_sm90 as kd
B, Hq, Hkv, D, T = 3, 32, 8, 128, 4096
for kb, G in [(2, 128), (4, 32), (2, 32)]:
    cache = da.make_cache(jax.random.key(kb * G), 1, B, Hkv, D, T, kb, kb, G)
    q = jax.random.normal(jax.random.key(5), (B, Hq, D), jnp.float32).astype(jnp.bfloat16)
    nt = jnp.array([T, 1000, 3], jnp.int32)
    kw = dict(key_bits=kb, value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D))
    tun = kd.choose_tuning(B, Hkv, T, key_bits=kb, value_bits=kb, group_size=G)
    ro, rl = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(0), **kw)
    alt = kd.to_alt_layout(*cache, value_bits=kb, vch=256)
    o, l = kd._kivi_decode(q, alt, nt, jnp.int32(0), **kw, tuning=tun, interpret=False,
                           stage_smem=False, alt_layout=True)
    e = float(jnp.abs(o - ro).max() / jnp.abs(ro).max())
    print(f"alt+w8 {kb}b G{G}: max|o err|/max|o| {e:.2e}, lse err {float(jnp.abs(l - rl).max()):.2e}")
PY
MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTXAS=1 timeout 400 python3 bench/probe_kernel.py \
  --set floors --pairs 2:128,4:128,2:32 --out "$OUT" 2>&1 | grep "^|\|cuDNN"
