import csv, sys, collections, re
rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[1]; data = rows[2:]
iS = hdr.index("Source"); iE = hdr.index("Instructions Executed"); iSamp = hdr.index("Warp Stall Sampling (All Samples)")
tot = 0; by = collections.Counter(); samp = collections.Counter(); stot=0
for r in data:
    if len(r) <= iE: continue
    src = r[iS].strip(); n = int(r[iE] or 0); s = int(r[iSamp] or 0)
    op = re.sub(r"^@!?U?P\w+\s+", "", src).split(" ")[0]
    base = op.split(".")[0]
    tot += n; by[base] += n; samp[base] += s; stot += s
print("total warp-instr executed", tot, " per (b,h,256tok) per warp:", tot / (8*8*512) / 4)
for op, n in by.most_common(40):
    print(f"{op:10s} {n/tot*100:5.1f}%  per-256tok-per-warp {n/(8*8*512)/4:7.1f}   stall-samples {samp[op]/stot*100:5.1f}%")
