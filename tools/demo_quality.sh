#!/usr/bin/env bash
# Quality of each storage format on real text: the demo model (models/charm-bard-moe) converted to
# each format mix, scored on its held-out Shakespeare (heldout.safetensors: 64 windows of 256
# tokens) and against transformers' logits of the bf16 checkpoint (reference.safetensors).
# Prints the markdown table of docs/quality.md.
#
# usage: tools/demo_quality.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d)}
model=models/charm-bard-moe
cargo build --release -q
bin=target/release/charm

row() { # label dir activations
  e=$("$bin" evaluate --model "$2" --ids-file "$model/heldout.safetensors" --activations "$3" --json)
  q=$("$bin" quality --model "$2" --reference "$model/reference.safetensors" --activations "$3" --json)
  python3 - "$1" "$3" "$e" "$q" <<'PY'
import json, sys
label, act, e, q = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
mtp = "" if e["mtp_acceptance"] is None else f'{100 * e["mtp_acceptance"]:.1f}%'
print(f'| {label} | {act} | {e["perplexity"]:.3f} | {100 * e["top1_accuracy"]:.2f}% | {100 * q["top1"]:.1f}% | {q["mean_kl"]:.2e} | {mtp} |')
PY
}

echo "| weights (experts / dense / embedding / mtp) | activations | held-out perplexity | next-token top-1 | top-1 agreement with transformers (bf16) | mean KL vs transformers | MTP draft acceptance |"
echo "|---|---|---|---|---|---|---|"
row "checkpoint (bf16 values, f32 compute)" "$model" f32
for mix in "bf16 bf16 bf16 bf16" "int8 int8 int8 int8" "int4 int8 int8 int8" "int4 int4 int8 int8" "int4 int8 int8 int4" "int2 int8 int8 int8"; do
  set -- $mix
  out="$work/$1-$2-$3-$4"
  [ -f "$out/charm.json" ] || "$bin" convert --model "$model" --out "$out" --experts "$1" --dense "$2" --embedding "$3" --mtp "$4" 2>/dev/null
  row "$1 / $2 / $3 / $4" "$out" f32
  if [ "$1 $2" = "int4 int8" ] && [ "$4" = int8 ]; then row "$1 / $2 / $3 / $4" "$out" int8; fi
done
