#!/usr/bin/env bash
# The GLM-5.2 GPU table of docs/cluster.md: `charm plan --cluster MACHINES.json` from GLM-5.2's
# config.json alone, for 1-4 identical 128 GiB machines (60 GB/s memory, 3 GB/s NVMe) on 1, 2.5
# and 10 GbE (0.1 ms round trip), int4 experts and int4 dense weights, int8 activations, each
# without a GPU and with a 24 GiB one at 900 GB/s on every machine ("gpu": {"vram_gib": 24,
# "mem_gb_s": 900}). Predictions with an assumed GPU efficiency, not measurements.
#   benches/plan_glm52_gpu.sh [path/to/charm]
set -euo pipefail
charm=${1:-target/release/charm}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cp tests/data/glm-5.2-config.json "$dir/config.json"
echo "| machines | link | tok/s, CPU only | tok/s with GPUs | with GPUs and --draft 3 (70%) | VRAM each / share of a token's expert reads from VRAM | per token with GPUs: dense / round trips / transfer / experts (GPU's part) / disk | bottleneck with GPUs |"
echo "|---|---|---|---|---|---|---|---|"
for n in 1 2 3 4; do
  for link in 1 2.5 10; do
    [ "$n" = 1 ] && [ "$link" != 10 ] && continue   # one machine: no link
    for gpu in 0 24; do
      python3 - "$n" "$link" "$gpu" > "$dir/m$gpu.json" <<'PY'
import json, sys
n, link, gpu = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
ms = []
for i in range(n):
    m = {"name": f"m{i}", "ram_gib": 128, "mem_gb_s": 60, "disk_gb_s": 3,
         "link_gbit_s": link, "rtt_ms": 0.1}
    if gpu:
        m["gpu"] = {"vram_gib": gpu, "mem_gb_s": 900}
    ms.append(m)
print(json.dumps({"machines": ms}))
PY
      "$charm" plan --model "$dir" --cluster "$dir/m$gpu.json" --activations int8 --dense int4 \
        --ctx 4096 --json > "$dir/out$gpu.json" || true
    done
    python3 - "$n" "$link" "$dir/out0.json" "$dir/out24.json" <<'PY'
import json, sys
n, link, cpu, gpu = sys.argv[1:]
c = json.load(open(cpu))["prediction"]
p = json.load(open(gpu))["prediction"]
t = p["token"]
net = "-" if n == "1" else f"{link} GbE"
vram = max(l["vram_bytes"] for l in p["links"]) / 2**30
print(f"| {n} | {net} | {c['tok_s']:.2f} | {p['tok_s']:.2f} | {p['speculative']['tok_s']:.2f} | "
      f"{vram:.1f} GiB / {100 * p['vram_read_share']:.0f}% | "
      f"{t['dense_ms']:.0f} / {t['round_trips_ms']:.0f} / {t['transfer_ms']:.0f} / "
      f"{t['expert_compute_ms']:.0f} ({t['expert_vram_ms']:.0f}) / {t['expert_disk_ms']:.0f} ms | {p['bottleneck']} |")
PY
  done
done
