#!/usr/bin/env bash
# End-to-end decode/prefill speed of `charm generate` on the yardstick model of ../shared/bench
# (GLM-5.2 architecture, 673.6M parameters): 128-token prompt, 64 greedy tokens, per storage
# format and activation mode, best of 3 runs. Compare engines side by side on the same machine.
#
# usage: benches/yardstick.sh HF_DIR [WORK_DIR]
#   HF_DIR: made by `python ../shared/bench/make_bench_model.py HF_DIR` (torch + transformers)
set -euo pipefail
hf=${1:?usage: benches/yardstick.sh HF_DIR [WORK_DIR]}
work=${2:-$(dirname "$hf")/charm-yardstick}
cd "$(dirname "$0")/.."
cargo build --release -q
bin=target/release/charm
mkdir -p "$work"
ids=$(python3 -c "print(','.join(str((i * 37 + 11) % 8190 + 2) for i in range(128)))")

run() { # label model activations
  local best_d=0 best_p=0
  for _ in 1 2 3; do
    out=$("$bin" generate --model "$2" --ids "$ids" --max-tokens 64 --temperature 0 --json --activations "$3")
    d=$(echo "$out" | python3 -c "import json,sys; print(json.load(sys.stdin)['decode_tok_s'])")
    p=$(echo "$out" | python3 -c "import json,sys; print(json.load(sys.stdin)['prefill_tok_s'])")
    best_d=$(python3 -c "print(max($best_d, $d))"); best_p=$(python3 -c "print(max($best_p, $p))")
  done
  printf '| %-34s | %-5s | %8.1f | %8.1f |\n' "$1" "$3" "$best_d" "$best_p"
}

convert() { # name experts dense embedding
  [ -f "$work/$1/charm.json" ] || "$bin" convert --model "$hf" --out "$work/$1" --experts "$2" --dense "$3" --embedding "$4" --mtp "$3" 2>/dev/null
}
convert int4-default int4 int8 int8
convert int4-all int4 int4 int4
convert int8-all int8 int8 int8
convert bf16-all bf16 bf16 bf16

echo "threads: ${RAYON_NUM_THREADS:-all ($(nproc))}"
echo "| weights (experts / dense / embedding) | acts | decode tok/s | prefill tok/s |"
echo "|---|---|---|---|"
run "checkpoint bf16, computed in f32" "$hf" f32
run "bf16 / bf16 / bf16" "$work/bf16-all" f32
run "int8 / int8 / int8" "$work/int8-all" f32
run "int8 / int8 / int8" "$work/int8-all" int8
run "int4 / int8 / int8 (default)" "$work/int4-default" f32
run "int4 / int8 / int8 (default)" "$work/int4-default" int8
run "int4 / int4 / int4" "$work/int4-all" f32
run "int4 / int4 / int4" "$work/int4-all" int8
