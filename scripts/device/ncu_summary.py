"""Sums Nsight Compute's gpu__time_duration per kernel name (the CSV of `ncu --csv --metrics gpu__time_duration.sum`),
largest first, with launch counts: where a benchmark's device time goes."""
import csv, sys, collections

tot, cnt = collections.Counter(), collections.Counter()
with open(sys.argv[1], newline="") as f:
    lines = [l for l in f if l.startswith('"')]
for row in csv.DictReader(lines):
    if row.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = row["Kernel Name"]
    short = name.split("(")[0][:110]
    v = float(row["Metric Value"].replace(",", ""))
    unit = row.get("Metric Unit", "ns")
    ns = v * {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}.get(unit, 1)
    tot[short] += ns
    cnt[short] += 1
all_ns = sum(tot.values())
print(f"total {all_ns / 1e6:.1f} ms over {sum(cnt.values())} launches")
for k, v in tot.most_common(60):
    print(f"{v / 1e6:10.2f} ms {100 * v / all_ns:5.1f}% {cnt[k]:7d}  {k}")
