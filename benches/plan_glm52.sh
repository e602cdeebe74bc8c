#!/usr/bin/env bash
# The GLM-5.2 tables of docs/cluster.md: `charm plan --cluster MACHINES.json` from GLM-5.2's
# config.json alone, for 1-4 identical machines (60 GB/s memory, 3 GB/s NVMe) on 1, 2.5 and
# 10 GbE (0.1 ms round trip), int4 experts, int8 activations. Predictions, not measurements.
#   benches/plan_glm52.sh [path/to/charm]
#     CPU-only machines of 64 or 128 GiB, int8 or int4 dense weights.
#   benches/plan_glm52.sh --gpu [path/to/charm]
#     128 GiB machines, int4 dense weights, each row without a GPU and with a 24 GiB one at
#     900 GB/s on every machine ("gpu": {"vram_gib": 24, "mem_gb_s": 900}; the GPU's
#     efficiency is assumed).
#   benches/plan_glm52.sh --dense-gpu [path/to/charm]
#     64 or 128 GiB machines, int4 dense weights, the coordinator's machine with one 24 GiB GPU
#     at 936 GB/s (an RTX 3090) running the dense pass (`--dense-device gpu`), each row against
#     the same machines with the dense pass on the CPU, and with two copies of as many of each
#     layer's experts as the machines' RAM and VRAM hold (`--replicas 2 --hot-share F`, F the
#     plan's room for replicas).
set -euo pipefail
vram=0 dense_gpu=0
if [ "${1:-}" = --gpu ]; then
  vram=24
  shift
elif [ "${1:-}" = --dense-gpu ]; then
  dense_gpu=1
  shift
fi
charm=${1:-target/release/charm}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cp tests/data/glm-5.2-config.json "$dir/config.json"

# plan OUT N RAM LINK DENSE VRAM [DEVICE [FLAGS...]]: `charm plan --json` of N machines of RAM
# GiB on LINK GbE with DENSE dense weights, a VRAM GiB GPU on each (0: none; -1: a 24 GiB one at
# 936 GB/s on the first only), the dense pass on DEVICE (default cpu) and further FLAGS, into OUT
plan() {
  python3 - "$2" "$3" "$4" "$6" > "$dir/m.json" <<'PY'
import json, sys
n, ram, link, vram = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
ms = []
for i in range(n):
    m = {"name": f"m{i}", "ram_gib": ram, "mem_gb_s": 60, "disk_gb_s": 3,
         "link_gbit_s": link, "rtt_ms": 0.1}
    if vram > 0:
        m["gpu"] = {"vram_gib": vram, "mem_gb_s": 900}
    if vram < 0 and i == 0:
        m["gpu"] = {"vram_gib": 24, "mem_gb_s": 936}
    ms.append(m)
print(json.dumps({"machines": ms}))
PY
  "$charm" plan --model "$dir" --cluster "$dir/m.json" --activations int8 --dense "$5" \
    --ctx 4096 --draft 3 --dense-device "${7:-cpu}" "${@:8}" --json > "$1" || true
}

if [ "$dense_gpu" = 1 ]; then
  echo "| machines | RAM each | link | tok/s, dense on the CPU | tok/s, dense on the GPU | with --draft 3 (70%) | with --replicas 2 (--hot-share) | per token, dense on the GPU: dense / round trips / transfer / experts RAM (GPU's part) / experts disk | bottleneck, dense on the GPU |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for n in 1 2 3 4; do
    for ram in 64 128; do
      for link in 1 2.5 10; do
        [ "$n" = 1 ] && [ "$link" != 10 ] && continue   # one machine: no link
        plan "$dir/cpu.json" "$n" "$ram" "$link" int4 -1 cpu
        plan "$dir/gpu.json" "$n" "$ram" "$link" int4 -1 gpu
        share=$(python3 -c 'import json, math, sys; p = json.load(open(sys.argv[1])).get("prediction"); print(math.floor(p["replica_room"] * 100) / 100 if p else 0)' "$dir/gpu.json")
        plan "$dir/rep.json" "$n" "$ram" "$link" int4 -1 gpu --replicas 2 --hot-share "$share"
        python3 - "$n" "$ram" "$link" "$dir/cpu.json" "$dir/gpu.json" "$dir/rep.json" <<'PY'
import json, sys
n, ram, link, cpu, gpu, rep = sys.argv[1:]
c = json.load(open(cpu)).get("prediction")
p = json.load(open(gpu)).get("prediction")
r = json.load(open(rep)).get("prediction")
net = "-" if n == "1" else f"{link} GbE"
if p is None:
    print(f"| {n} | {ram} GiB | {net} | - | does not fit | | | | |")
    sys.exit()
t = p["token"]
room = int(p["replica_room"] * 100) / 100
rep = f"{r['tok_s']:.2f} ({room:.2f})" if room > 0 and n != "1" else "-"
print(f"| {n} | {ram} GiB | {net} | {c['tok_s']:.2f} | {p['tok_s']:.2f} | {p['speculative']['tok_s']:.2f} | {rep} | "
      f"{t['dense_ms']:.0f} / {t['round_trips_ms']:.0f} / {t['transfer_ms']:.0f} / "
      f"{t['expert_compute_ms']:.0f} ({t['expert_vram_ms']:.0f}) / {t['expert_disk_ms']:.0f} ms | {p['bottleneck']} |")
PY
      done
    done
  done
  exit 0
fi

if [ "$vram" = 0 ]; then
  echo "| dense | machines | RAM each | link | tok/s | with --draft 3 (70%) | per token: dense / round trips / transfer / experts RAM / experts disk | bottleneck |"
else
  echo "| machines | link | tok/s, CPU only | tok/s with GPUs | with GPUs and --draft 3 (70%) | VRAM each / share of a token's expert reads from VRAM | per token with GPUs: dense / round trips / transfer / experts (GPU's part) / disk | bottleneck with GPUs |"
fi
echo "|---|---|---|---|---|---|---|---|"
denses="int8 int4" rams="64 128"
[ "$vram" = 0 ] || { denses=int4; rams=128; }
for dense in $denses; do
  for n in 1 2 3 4; do
    for ram in $rams; do
      for link in 1 2.5 10; do
        [ "$n" = 1 ] && [ "$link" != 10 ] && continue   # one machine: no link
        plan "$dir/cpu.json" "$n" "$ram" "$link" "$dense" 0
        if [ "$vram" = 0 ]; then
          python3 - "$dense" "$n" "$ram" "$link" "$dir/cpu.json" <<'PY'
import json, sys
dense, n, ram, link, path = sys.argv[1:]
p = json.load(open(path))["prediction"]
t = p["token"]
net = "-" if n == "1" else f"{link} GbE"
print(f"| {dense} | {n} | {ram} GiB | {net} | {p['tok_s']:.2f} | {p['speculative']['tok_s']:.2f} | "
      f"{t['dense_ms']:.0f} / {t['round_trips_ms']:.0f} / {t['transfer_ms']:.0f} / "
      f"{t['expert_compute_ms']:.0f} / {t['expert_disk_ms']:.0f} ms | {p['bottleneck']} |")
PY
        else
          plan "$dir/gpu.json" "$n" "$ram" "$link" "$dense" "$vram"
          python3 - "$n" "$link" "$dir/cpu.json" "$dir/gpu.json" <<'PY'
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
        fi
      done
    done
  done
done
