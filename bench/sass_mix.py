"""Instruction mix of one kernel launch from an Nsight Compute SASS export.

    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 bench/sass_mix.py sass.csv --steps 32768

(the profile needs ncu's SourceCounters section; bench/ncu_sass.sh collects it).

Sums "Instructions Executed" (warp-level) per opcode and normalizes by --steps (the number of
256-token steps over all (b, h) of the launch, e.g. B=8, Hkv=8, T=128k: 8 * 8 * 512) and by
the 4 warps of a warpgroup: the result is instructions per warp per 256-token step, the unit
of docs/performance.md. Also the share of warp-stall samples per opcode and, last, the stall
samples by reason.
"""

import argparse
import collections
import csv
import re


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=8 * 8 * 512)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv)))
    hdr, data = rows[1], rows[2:]
    i_src = hdr.index("Source")
    i_exe = hdr.index("Instructions Executed")
    i_smp = hdr.index("Warp Stall Sampling (All Samples)")
    total, samples_total = 0, 0
    count, samples = collections.Counter(), collections.Counter()
    for r in data:
        if len(r) <= i_exe:
            continue
        op = re.sub(r"^@!?U?P\w+\s+", "", r[i_src].strip()).split(" ")[0].split(".")[0]
        n, s = int(r[i_exe] or 0), int(r[i_smp] or 0)
        total += n
        samples_total += s
        count[op] += n
        samples[op] += s
    per = lambda n: n / a.steps / 4
    print(f"total warp-instr executed {total}  per 256-token step per warp: {per(total):.1f}")
    for op, n in count.most_common(a.top):
        print(f"{op:10s} {n / total * 100:5.1f}%  per step per warp {per(n):7.1f}   "
              f"stall samples {samples[op] / max(samples_total, 1) * 100:5.1f}%")
    # warp stall samples by reason (ncu's stall_* columns), all instructions together
    reasons = collections.Counter()
    cols = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    for r in data:
        for i in cols:
            if i < len(r):
                reasons[hdr[i]] += int(r[i] or 0)
    n_all = max(sum(reasons.values()), 1)
    print("stall reasons: " + ", ".join(f"{k[6:]} {v / n_all * 100:.1f}%"
                                        for k, v in reasons.most_common(9)))


if __name__ == "__main__":
    main()
