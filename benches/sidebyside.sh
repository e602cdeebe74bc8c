#!/usr/bin/env bash
# charm and llama.cpp on the yardstick model, side by side on this machine: alternating runs,
# 2 threads, 128-token prompt, 64 tokens decoded after it (llama-bench: pp128 and tg64 at depth 128).
#
# usage: benches/sidebyside.sh HF_DIR LLAMA_CPP_DIR [WORK_DIR] [ROUNDS] [LLAMA_BUILD]
#   HF_DIR:        made by `python ../shared/bench/make_bench_model.py HF_DIR`
#   LLAMA_CPP_DIR: a llama.cpp source tree built with `cmake -B build -DGGML_NATIVE=ON` and
#                  `cmake --build build --target llama-bench llama-quantize` (the PyPI sdist of
#                  llama-cpp-python 0.3.36 vendors llama.cpp 0c1e570, the commit of
#                  ../shared/bench/README.md)
#   WORK_DIR:      where the charm containers and the GGUF files go
# The GGUF conversion runs under $PYTHON (default python3), which needs torch, numpy, safetensors.
set -euo pipefail
hf=${1:?usage: benches/sidebyside.sh HF_DIR LLAMA_CPP_DIR [WORK_DIR] [ROUNDS]}
llama=${2:?usage: benches/sidebyside.sh HF_DIR LLAMA_CPP_DIR [WORK_DIR] [ROUNDS]}
work=${3:-$(dirname "$hf")/charm-yardstick}
rounds=${4:-3}
build=${5:-build}   # the llama.cpp build directory (e.g. one configured without AVX-512)
cd "$(dirname "$0")/.."
cargo build --release -q
bin=target/release/charm
lb=$llama/$build/bin/llama-bench
mkdir -p "$work"
for m in "int4-all int4 int4 int4" "int4-default int4 int8 int8" "int8-all int8 int8 int8"; do
  set -- $m
  [ -f "$work/$1/charm.json" ] || "$bin" convert --model "$hf" --out "$work/$1" --experts "$2" --dense "$3" --embedding "$4" --mtp "$3" 2>/dev/null
done
[ -f "$work/bench-bf16.gguf" ] || "${PYTHON:-python3}" benches/gguf_placeholder_vocab.py "$llama" "$hf" --outfile "$work/bench-bf16.gguf" --outtype bf16
for q in Q4_0 Q8_0; do
  [ -f "$work/bench-$q.gguf" ] || "$llama/build/bin/llama-quantize" "$work/bench-bf16.gguf" "$work/bench-$q.gguf" "$q" 2 >/dev/null
done
ids=$(python3 -c "print(','.join(str((i * 37 + 11) % 8190 + 2) for i in range(128)))")
# what this CPU offers and which kernels charm runs (CHARM_ISA=avx2 picks the AVX2 path on an
# AVX-512 machine; llama.cpp then needs a build without AVX-512 for a like-for-like run)
echo "CPU: $(grep -o -w 'avx2\|avx512f\|avx512_vnni\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "charm kernels: $(RAYON_NUM_THREADS=2 "$bin" generate --model "$work/int4-all" --ids 1,2 --max-tokens 1 --json 2>/dev/null | python3 -c "import json,sys; print(json.load(sys.stdin)['isa'])")"
for _ in $(seq "$rounds"); do
  for q in Q4_0 Q8_0; do
    "$lb" -m "$work/bench-$q.gguf" -t 2 -p 128 -n 0 -r 1 -o csv 2>/dev/null |
      python3 -c "import csv,sys; [print('llama.cpp $q prefill', r['avg_ts']) for r in csv.DictReader(sys.stdin)]"
    "$lb" -m "$work/bench-$q.gguf" -t 2 -p 0 -n 64 -d 128 -r 1 -o csv 2>/dev/null |
      python3 -c "import csv,sys; [print('llama.cpp $q decode', r['avg_ts']) for r in csv.DictReader(sys.stdin)]"
  done
  for m in int4-all int4-default int8-all; do
    RAYON_NUM_THREADS=2 "$bin" generate --model "$work/$m" --ids "$ids" --max-tokens 64 --temperature 0 --json --activations int8 |
      python3 -c "import json,sys; d=json.load(sys.stdin); print('charm $m prefill', d['prefill_tok_s']); print('charm $m decode', d['decode_tok_s'])"
  done
done | python3 -c "
import sys
rows = {}
for line in sys.stdin:
    *k, v = line.split()
    rows.setdefault(' '.join(k), []).append(float(v))
print('| engine, weights, measure | tok/s per round |')
print('|---|---|')
for k, v in sorted(rows.items()):
    print(f'| {k} | ' + ' / '.join(f'{x:.1f}' for x in v) + ' |')
"
