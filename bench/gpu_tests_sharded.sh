#!/usr/bin/env bash
# The kernel module's GPU cases and the dispatch tests natively, in four pytest processes side
# by side on the one GPU (each 20% of its memory; compiling is the CPU's, one core per process:
# the module in one process outgrew a call's time on a cold compile cache, run 94). Summaries
# to $1; $2: each shard's time limit in seconds (default 260). For the run scripts (107-111).
set -u
R=$1
LIMIT=${2:-260}
{ python3 -m pytest -q -p no:cacheprovider --collect-only -m gpu tests/test_kivi_decode_sm90.py
  python3 -m pytest -q -p no:cacheprovider --collect-only tests/test_attention.py
} 2>/dev/null | grep "::" > /tmp/ids.txt
echo "$(wc -l < /tmp/ids.txt) tests in 4 shards" | tee "$R"
for i in 0 1 2 3; do
  awk -v i=$i 'NR % 4 == i' /tmp/ids.txt > /tmp/shard$i.txt
  mapfile -t ids < /tmp/shard$i.txt  # node ids with spaces (the dispatch tests' configs)
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout "$LIMIT" python3 -m pytest -q -p no:cacheprovider \
    "${ids[@]}" > /tmp/shard$i.log 2>&1 &
done
wait
for i in 0 1 2 3; do grep -iE "passed|failed|error" /tmp/shard$i.log | tail -8 \
  | sed "s/^/shard $i: /" | tee -a "$R"; done
