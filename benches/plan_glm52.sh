#!/usr/bin/env bash
# The GLM-5.2 table of docs/cluster.md: `charm plan --cluster MACHINES.json` from GLM-5.2's
# config.json alone, for 1-4 identical CPU-only machines (64 or 128 GiB, 60 GB/s memory, 3 GB/s
# NVMe) on 1, 2.5 and 10 GbE (0.1 ms round trip), int4 experts with int8 or int4 dense weights.
#   benches/plan_glm52.sh [path/to/charm]
set -euo pipefail
charm=${1:-target/release/charm}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cp tests/data/glm-5.2-config.json "$dir/config.json"
echo "| dense | machines | RAM each | link | tok/s | with --draft 3 (70%) | per token: dense / round trips / transfer / experts RAM / experts disk | bottleneck |"
echo "|---|---|---|---|---|---|---|---|"
for dense in int8 int4; do
  for n in 1 2 3 4; do
    for ram in 64 128; do
      for link in 1 2.5 10; do
        [ "$n" = 1 ] && [ "$link" != 10 ] && continue   # one machine: no link
        f="$dir/m.json"
        python3 - "$n" "$ram" "$link" > "$f" <<'PY'
import json, sys
n, ram, link = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
print(json.dumps({"machines": [
    {"name": f"m{i}", "ram_gib": ram, "mem_gb_s": 60, "disk_gb_s": 3,
     "link_gbit_s": link, "rtt_ms": 0.1} for i in range(n)]}))
PY
        "$charm" plan --model "$dir" --cluster "$f" --activations int8 --dense "$dense" \
          --ctx 4096 --json > "$dir/out.json" || true
        python3 - "$dense" "$n" "$ram" "$link" "$dir/out.json" <<'PY'
import json, sys
dense, n, ram, link, path = sys.argv[1:]
p = json.load(open(path))["prediction"]
t = p["token"]
net = "-" if n == "1" else f"{link} GbE"
print(f"| {dense} | {n} | {ram} GiB | {net} | {p['tok_s']:.2f} | {p['speculative']['tok_s']:.2f} | "
      f"{t['dense_ms']:.0f} / {t['round_trips_ms']:.0f} / {t['transfer_ms']:.0f} / "
      f"{t['expert_compute_ms']:.0f} / {t['expert_disk_ms']:.0f} ms | {p['bottleneck']} |")
PY
      done
    done
  done
done
