#!/usr/bin/env bash
# Run 111 (stop 24; one device call): 4-bit value codes back in rows (value_codes_blocked: the
# blocks cost the 4-bit kernel 2-3%, runs 109-110). The kernel module's GPU cases and the
# dispatch tests in four shards, then the Hq=32 grid's 4-bit columns.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
M=XLA_PYTHON_CLIENT_MEM_FRACTION
R="$OUT/pytest_gpu_${D}_run111.txt"
{ python3 -m pytest -q -p no:cacheprovider --collect-only -m gpu tests/test_kivi_decode_sm90.py
  python3 -m pytest -q -p no:cacheprovider --collect-only tests/test_attention.py
} 2>/dev/null | grep "::" > /tmp/ids.txt
echo "$(wc -l < /tmp/ids.txt) tests in 4 shards" | tee "$R"
for i in 0 1 2 3; do
  awk -v i=$i 'NR % 4 == i' /tmp/ids.txt > /tmp/shard$i.txt
  mapfile -t ids < /tmp/shard$i.txt  # node ids with spaces (the dispatch tests' configs)
  env $M=0.2 timeout 230 python3 -m pytest -q -p no:cacheprovider "${ids[@]}" \
    > /tmp/shard$i.log 2>&1 &
done
wait
for i in 0 1 2 3; do grep -iE "passed|failed|error" /tmp/shard$i.log | tail -8 \
  | sed "s/^/shard $i: /" | tee -a "$R"; done
mkdir -p "$OUT/g"
env $M=0.95 timeout 130 python3 bench/decode_attention.py --mode grid --hq 32 --batches 8,1,32 \
  --ts 131072,8192,32768 --bits_g 4:128,4:32 --fp16 cudnn --no_twin --lp 0 --budget_s 110 \
  --out "$OUT/g" 2>&1 | grep "^|"
