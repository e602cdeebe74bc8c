#!/usr/bin/env bash
# Single-box streaming: decode from a synthetic GLM-5.2-shaped container whose routed experts are
# larger than the RAM budget. For each budget: a cold run (empty cache, no routing history) and a
# warm run (same steps, pinned set loaded from the history of the cold run), beside the
# all-resident run over the same steps and the disk's O_DIRECT bandwidth for expert-sized random
# reads measured in the same session (`charm iobench` on the model's own expert files). Tokens are
# sampled (temperature 1, seed 1): the random weights would otherwise repeat one token, and one
# token routes the same way every step. Every run decodes the same tokens.
#
# usage: [ACTIVATIONS=f32|int8] benches/streaming.sh [WORK_DIR] [BUDGETS_GIB...]
#   WORK_DIR defaults to /tmp/charm-streaming; the model is made there once with
#   `charm synth --layers 3 --dense-layers 1 --vocab 32768` (about 15.5 GiB on disk).
#   ACTIVATIONS (default f32) is passed to `charm generate --activations`: int8 computes faster,
#   which leaves the disk as the limit of more of each step. CHARM_BIN runs that charm binary
#   instead of building one.
set -euo pipefail
work=${1:-/tmp/charm-streaming}
shift || true
budgets=${*:-4 6 8}
cd "$(dirname "$0")/.."
if [ -n "${CHARM_BIN:-}" ]; then
  bin=$CHARM_BIN
else
  cargo build --release -q
  bin=$PWD/target/release/charm
fi
model=$work/glm-synth
mkdir -p "$work"
[ -f "$model/charm.json" ] || "$bin" synth --out "$model" --layers 3 --dense-layers 1 --vocab 32768
ids=$(python3 -c "print(','.join(str((i * 37 + 11) % 32000 + 2) for i in range(16)))")
steps=32

# the disk's O_DIRECT bandwidth for expert-sized random reads, measured again before each run
# (a shared machine's disk drifts)
probe() {
  "$bin" iobench --model "$model" --seconds 5 --json | python3 -c "import json,sys; print(json.load(sys.stdin)['bytes_per_s'])"
}
disk=$(probe)
printf 'disk: %.3f GB/s O_DIRECT random reads of one expert record (charm iobench, 4 threads)\n' "$(python3 -c "print($disk/1e9)")"

gen() { # ram-flag history -> json
  "$bin" generate --model "$model" --ids "$ids" --max-tokens "$steps" --temperature 1 --seed 1 --json $1 --history "$2" \
    --activations "${ACTIVATIONS:-f32}"
}

row() { # label json
  python3 - "$1" "$2" "$disk" <<'EOF'
import json, sys
label, v, disk = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
e = v["stats"].get("experts", {})
secs = v["prefill_seconds"] + v["decode_seconds"]
# delivered: bytes of experts the computation used (read-aheads never used are not counted)
used = e.get("bytes_read", 0) - e.get("wasted_bytes", 0)
delivered = used / secs if secs else 0
busy = e.get("disk_busy_seconds", 0) / secs if secs else 0
print(f"| {label:<24} | {v['decode_tok_s']:6.2f} | {v['prefill_tok_s']:6.2f} | {100*e.get('hit_rate',0):5.1f}% "
      f"| {e.get('bytes_read',0)/1e9:6.2f} | {e.get('wasted_bytes',0)/1e9:5.2f} | {delivered/1e9:5.3f} "
      f"| {disk/1e9:5.3f} | {100*delivered/disk:5.1f}% | {100*busy:5.1f}% "
      f"| {e.get('wait_seconds',0):6.2f} | {e.get('compute_seconds',0):6.2f} "
      f"| {100*(e.get('lookahead_recall') or 0):5.1f}% | {e.get('early_used',0)}/{e.get('early_reads',0)} "
      f"| {v['stats']['peak_rss_bytes']/2**30:5.2f} |")
EOF
}

echo "| run | decode tok/s | prefill tok/s | hit rate | GB read | GB read ahead, unused | delivered GB/s | disk GB/s (just before) | of disk | disk busy | wait s | compute s | lookahead recall | early guesses used/read | peak RSS GiB |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
row "all resident" "$(gen "" none)"
# no expert cache at all: every expert a step uses comes from the disk
resident=$("$bin" plan --model "$model" --json --ram 64 --ctx $((16 + steps)) --history none | python3 -c "import json,sys; print(json.load(sys.stdin)['resident_bytes'] / 2**30 + 1e-6)")
disk=$(probe)
row "no expert cache" "$(gen "--ram $resident" none)"
for b in $budgets; do
  h=$work/history-$b.json
  rm -f "$h"
  disk=$(probe)
  row "budget $b GiB, cold" "$(gen "--ram $b" "$h")"
  disk=$(probe)
  row "budget $b GiB, warm" "$(gen "--ram $b" "$h")"
done
