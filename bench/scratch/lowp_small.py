"""Run 30b: the kernel alone at the 16 x 4k generation shape (Tq = 4352), default against
int8_keys + fp8_values at choose_tuning's splits and at the default's.

    PYTHONPATH=. python3 bench/scratch/lowp_small.py
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import decode_attention as da  # noqa: E402

from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402

B, Hq, Hkv, D, T = 16, 32, 8, 128, 4352
d = kd.choose_tuning(B, Hkv, T)
f = kd.choose_tuning(B, Hkv, T, int8_keys=True, fp8_values=True)
rows = [("default", d), (f"lowp S{f.num_splits}", f),
        (f"lowp S{d.num_splits}", dataclasses.replace(f, num_splits=d.num_splits)),
        ("int8_keys", dataclasses.replace(d, int8_keys=True)),
        ("fp8_values", dataclasses.replace(d, fp8_values=True))]
for name, t in rows:
    r = da.bench_point(B, Hq, Hkv, D, T, 2, 2, 128, tuning=t, reps=10)
    print(f"| {name} | S{t.num_splits} | {r['ms']:.4f} ms |", flush=True)
