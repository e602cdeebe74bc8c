#!/usr/bin/env bash
# charm serve and llama.cpp's llama-server on the yardstick model, side by side on this machine:
# the same streams of token-id prompts (32 ids, 64 greedy tokens past end-of-sequence, 1, 4 and
# 8 at once) against each server in turn, 2 threads, 8 parallel slots each, int8 activations for
# charm (llama.cpp quantizes activations to 8 bits too).
#
# usage: benches/gateway_sidebyside.sh HF_DIR LLAMA_CPP_DIR [WORK_DIR]
#   HF_DIR, LLAMA_CPP_DIR, WORK_DIR: as for benches/sidebyside.sh (LLAMA_CPP_DIR built with the
#   llama-server target too: `cmake --build build --target llama-server llama-quantize`)
set -euo pipefail
hf=${1:?usage: benches/gateway_sidebyside.sh HF_DIR LLAMA_CPP_DIR [WORK_DIR]}
llama=${2:?usage: benches/gateway_sidebyside.sh HF_DIR LLAMA_CPP_DIR [WORK_DIR]}
work=${3:-$(dirname "$hf")/charm-yardstick}
cd "$(dirname "$0")/.."
cargo build --release -q
cargo bench --bench gateway --no-run -q 2>/dev/null
bin=target/release/charm
mkdir -p "$work"
for m in "int4-all int4 int4 int4" "int8-all int8 int8 int8"; do
  set -- $m
  [ -f "$work/$1/charm.json" ] || "$bin" convert --model "$hf" --out "$work/$1" --experts "$2" --dense "$3" --embedding "$4" --mtp "$3" 2>/dev/null
  # the yardstick has no tokenizer: a placeholder of its vocabulary's size (prompts are token ids)
  [ -f "$work/$1/tokenizer.json" ] || python3 -c "
import json, sys
n = json.load(open('$hf/config.json'))['vocab_size']
json.dump({'version': '1.0', 'truncation': None, 'padding': None, 'added_tokens': [], 'normalizer': None,
           'pre_tokenizer': {'type': 'Whitespace'}, 'post_processor': None, 'decoder': None,
           'model': {'type': 'WordLevel', 'vocab': {f't{i}': i for i in range(n)}, 'unk_token': 't0'}},
          open('$work/$1/tokenizer.json', 'w'))"
done
[ -f "$work/bench-bf16.gguf" ] || "${PYTHON:-python3}" benches/gguf_placeholder_vocab.py "$llama" "$hf" --outfile "$work/bench-bf16.gguf" --outtype bf16
for q in Q4_0 Q8_0; do
  [ -f "$work/bench-$q.gguf" ] || "$llama/build/bin/llama-quantize" "$work/bench-bf16.gguf" "$work/bench-$q.gguf" "$q" 2 >/dev/null
done
args=(--prompt-ids 32 --tokens 64 --streams 1,4,8 --vocab 8192)
for pair in "Q4_0 int4-all" "Q8_0 int8-all"; do
  set -- $pair
  echo "== llama-server $1 (-np 8 -t 2)"
  "$llama/build/bin/llama-server" -m "$work/bench-$1.gguf" -t 2 -np 8 -c 8192 --port 18734 >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:18734/health >/dev/null && break; sleep 0.5; done
  cargo bench -q --bench gateway -- --url http://127.0.0.1:18734 "${args[@]}" 2>/dev/null | grep -v '^$'
  kill $pid; wait $pid 2>/dev/null || true
  echo "== charm serve $2 (--parallel 8, int8 activations)"
  RAYON_NUM_THREADS=2 cargo bench -q --bench gateway -- --model "$work/$2" --parallel 8 --activations int8 "${args[@]}" 2>/dev/null | grep -v '^$'
done
