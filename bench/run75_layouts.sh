#!/bin/bash
# Run 75: the load pipeline alone for five cache layouts at the three production launches
# (bench/page_probe.py), and the whole kernel on the experimental layout (`to_alt_layout`,
# 2-bit G=128, the previous loop) beside the documented one.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-75}
timeout 300 python3 bench/page_probe.py --kbg 2:128,2:32,4:128 2>&1 | grep "^|" \
  | tee $OUT/page_probe_${D}_run$R.txt
timeout 200 python3 - <<'PY' 2>&1 | grep "^|" | tee $OUT/alt_${D}_run$R.txt
import sys; sys.path.insert(0, "bench")
import decode_attention as da
from pallas_kernels import kivi_decode_sm90 as kd
tun = kd.choose_tuning(8, 8, 131072, key_bits=2, value_bits=2, group_size=128)
for alt in (False, True, False, True):
    r = da.bench_point(8, 32, 8, 128, 131072, 2, 2, 128, tuning=tun, reps=10, alt=alt)
    print(f"| 2 | 128 | {r['kind']} | {r['ms']:.4f} |", flush=True)
PY
