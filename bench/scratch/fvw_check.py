"""Run 90: fold_v_warp (each warp's value scale folded into its B, G < D) against the f32 twin
and against the same launch without it, before the full GPU module."""
import dataclasses
import math
import sys

import jax.numpy as jnp

sys.path.insert(0, "tests")
from test_kivi_decode_sm90 import make_cache, make_q  # noqa: E402

from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402

ok_all = True
for kb, vb, G, D, dt in ((2, 2, 32, 128, jnp.float16), (4, 4, 32, 128, jnp.bfloat16),
                         (2, 2, 64, 128, jnp.bfloat16), (4, 2, 32, 128, jnp.float16),
                         (2, 2, 32, 64, jnp.float16)):
    B, Hq, Hkv, T = 3, 32, 8, 16384
    tun = kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=vb, group_size=G, head_dim=D)
    cache = make_cache(kb * 100 + G + D, 2, B, Hkv, D, T, kb, vb, G)
    q = make_q(G + kb + D, B, Hq, D, dt)
    nt = jnp.array([T, 7001, 255], jnp.int32)
    kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=1 / math.sqrt(D))
    a, la = kd.kivi_decode(q, *cache, nt, jnp.int32(1), **kw, tuning=tun)
    b, lb = kd.kivi_decode(q, *cache, nt, jnp.int32(1), **kw,
                           tuning=dataclasses.replace(tun, fold_v_warp=False))
    ro, rl = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(1), **kw)
    m = float(jnp.abs(ro).max())
    ea, eb = float(jnp.abs(a - ro).max()) / m, float(jnp.abs(b - ro).max()) / m
    el = float(jnp.abs(la - rl).max())
    ok = ea < 5e-3 and el < 5e-3 and bool(jnp.isfinite(a).all())
    ok_all &= ok
    print(f"kb={kb} vb={vb} G={G} D={D} W={tun.wg_per_block} fvw "
          f"{kd._folds_values_warp(tun, G, D, False)}: rel err {ea:.2e} (without {eb:.2e}), "
          f"lse err {el:.2e} {'ok' if ok else 'FAIL'}", flush=True)
print("ALL OK" if ok_all else "FAILED")
sys.exit(0 if ok_all else 1)
