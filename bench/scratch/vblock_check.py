"""Run 88: the kernel over V codes in 64-column blocks (`block_value_codes`) against the same
kernel over the documented layout (bit-identical expected: same SMEM image) and the f32 twin."""
import math
import sys

import jax.numpy as jnp

sys.path.insert(0, "tests")
from test_kivi_decode_sm90 import make_cache, make_q  # noqa: E402

from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402

ok_all = True
for kb, G, dt in ((2, 128, jnp.float16), (2, 32, jnp.bfloat16), (4, 128, jnp.bfloat16),
                  (4, 32, jnp.float16), (2, 64, jnp.float16)):
    B, Hq, Hkv, D, T = 3, 32, 8, 128, 16384
    tun = kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=kb, group_size=G)
    cache = make_cache(kb * 100 + G, 2, B, Hkv, D, T, kb, kb, G)
    q = make_q(G + kb, B, Hq, D, dt)
    nt = jnp.array([T, 7001, 255], jnp.int32)
    kw = dict(key_bits=kb, value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D))
    a = kd.kivi_decode(q, *cache, nt, jnp.int32(1), **kw, tuning=tun)
    blk = (*cache[:3], kd.block_value_codes(cache[3]), *cache[4:])
    b = kd.kivi_decode(q, *blk, nt, jnp.int32(1), **kw, tuning=tun)
    ro, _ = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(1), **kw)
    same = bool(jnp.all(a[0] == b[0]) & jnp.all(a[1] == b[1]))
    err = float(jnp.abs(b[0] - ro).max() / jnp.abs(ro).max())
    ok = same and err < 5e-3
    ok_all &= ok
    print(f"kb={kb} G={G} W={tun.wg_per_block} S={tun.num_splits} wsm={tun.warp_softmax} "
          f"blocked==documented {same} rel err vs twin {err:.2e} {'ok' if ok else 'FAIL'}",
          flush=True)
print("ALL OK" if ok_all else "FAILED")
