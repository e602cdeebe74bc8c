#!/usr/bin/env python3
"""Summarizes an expert-store I/O timeline (`charm generate ... --io-trace FILE`).

Splits the disk's delivered rate by what the forward pass was doing meanwhile: waiting for
experts, or computing (dense layers, attention, experts). Each read is assumed to get an equal
share of the disk with the reads in flight beside it, and the disk one rate while the forward
waits and another while it computes; the two rates are the least-squares fit over all reads.
On a machine whose disk slows while the cores stream memory, the second is the lower.

usage: benches/io_phases.py TRACE.jsonl [--bin-ms 0.5]
"""
import json
import sys


def main():
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if args else 2
    dt = 0.0005
    if "--bin-ms" in args:
        dt = float(args[args.index("--bin-ms") + 1]) / 1e3
    events = [json.loads(line) for line in open(args[0]) if line.strip()]
    steps = [e for e in events if e["kind"] == "experts"]
    if not steps:
        print("no expert steps in the trace (did the run stream experts?)")
        return 1
    t0 = min(e["start_s"] for e in steps)
    t1 = max(e["end_s"] for e in steps)
    # reads made for the run (warm-up reads before the first step are left out)
    reads = [e for e in events if e["kind"] == "read" and e["end_s"] > t0]
    waits = [e for e in events if e["kind"] == "wait"]
    n = int((t1 - t0) / dt) + 2
    conc = [0] * n
    computing = [True] * n

    def span(a, b):
        return max(0, int((a - t0) / dt)), min(n, int((b - t0) / dt) + 1)

    for e in reads:
        i, j = span(e["start_s"], e["end_s"])
        for k in range(i, j):
            conc[k] += 1
    for e in waits:
        i, j = span(e["start_s"], e["end_s"])
        for k in range(i, j):
            computing[k] = False
    # normal equations of  bytes_r = rate_wait * x0_r + rate_compute * x1_r
    s00 = s01 = s11 = b0 = b1 = 0.0
    for e in reads:
        i, j = span(e["start_s"], e["end_s"])
        x0 = sum(dt / max(conc[k], 1) for k in range(i, j) if not computing[k])
        x1 = sum(dt / max(conc[k], 1) for k in range(i, j) if computing[k])
        y = e["bytes"]
        s00 += x0 * x0
        s01 += x0 * x1
        s11 += x1 * x1
        b0 += x0 * y
        b1 += x1 * y
    det = s00 * s11 - s01 * s01
    secs = t1 - t0
    total = sum(e["bytes"] for e in reads)
    busy = sum(1 for c in conc if c > 0)
    busy_computing = sum(1 for c, p in zip(conc, computing) if c > 0 and p)
    print(f"run: {secs:.2f} s, {len(reads)} reads, {total / 1e9:.2f} GB, "
          f"{total / secs / 1e9:.3f} GB/s read over the run")
    print(f"disk busy (>= 1 read in flight): {100 * busy / n:.1f}% of the run; "
          f"of that, the forward pass computing: {100 * busy_computing / max(busy, 1):.1f}%")
    hist = {}
    for c in conc:
        hist[min(c, 8)] = hist.get(min(c, 8), 0) + 1
    print("reads in flight, share of the run: " +
          ", ".join(f"{k}{'+' if k == 8 else ''}: {100 * v / n:.1f}%" for k, v in sorted(hist.items())))
    if det > 0:
        rw = (b0 * s11 - b1 * s01) / det
        rc = (s00 * b1 - s01 * b0) / det
        print(f"disk rate while the forward waits: {rw / 1e9:.3f} GB/s; "
              f"while it computes: {rc / 1e9:.3f} GB/s")
    else:
        print("too few reads in one of the phases to split the rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
