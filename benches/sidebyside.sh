#!/usr/bin/env bash
# charm and llama.cpp on the yardstick model, side by side on this machine: interleaved rounds,
# 2 threads, 128-token prompt, 64 tokens decoded after it (llama-bench: pp128 and tg64 at depth 128).
#
# usage: benches/sidebyside.sh HF_DIR LLAMA_CPP_DIR [WORK_DIR] [ROUNDS] [LLAMA_BUILD]
#        benches/sidebyside.sh --summarize [RUN_LOG]    # the tables again from a saved run's log
#   HF_DIR:        made by `python ../shared/bench/make_bench_model.py HF_DIR`
#   LLAMA_CPP_DIR: a llama.cpp source tree built with `cmake -B build -DGGML_NATIVE=ON` and
#                  `cmake --build build --target llama-bench llama-quantize` (the PyPI sdist of
#                  llama-cpp-python 0.3.36 vendors llama.cpp 0c1e570, the commit of
#                  ../shared/bench/README.md)
#   WORK_DIR:      where the charm containers, the GGUF files and the run logs go
#   ROUNDS:        rounds to run (default 6; single 64-token rounds swing up to 30% on a shared VM)
#   LLAMA_BUILD:   the llama.cpp build directory (default build; e.g. build-avx2, one configured
#                  without AVX-512, beside CHARM_ISA=avx2)
# The GGUF conversion runs under $PYTHON (default python3), which needs torch, numpy, safetensors.
#
# Each round runs each pair back to back: llama.cpp Q4_0 (prefill, decode) and charm int4-all,
# llama.cpp Q8_0 and charm int8-all (which of the two goes first alternates from round to round),
# then charm int4-default. charm's prefill is timed twice: cold (`prefill`: `charm generate`'s
# prompt, the process's first forward pass) and warm (`prefill-warm`: `--warmup 1`); llama-bench
# times its runs after a warm-up run, and both are paired with its prefill. The run prints the
# tok/s of every round, then for each pair and measure
# the median of the per-round ratios charm / llama.cpp, their min-max and interquartile range, the
# number of rounds, the ISA, and the commit. The raw per-round lines are saved in WORK_DIR
# (sidebyside-COMMIT-ISA-TIME.txt); `--summarize` reads such a file (or stdin) and prints the
# tables again.
set -euo pipefail

# The summary: reads lines `ROUND ENGINE WEIGHTS MEASURE TOK_S` (`3 llama.cpp Q4_0 decode 249.1`)
# and `# KEY: VALUE` lines (commit, cpu, charm kernels, llama.cpp, threads).
summary_py=$(cat <<'PY'
import statistics, sys

meta, rows, rounds = {}, {}, set()
for line in sys.stdin:
    line = line.strip()
    if not line:
        continue
    if line.startswith('#'):
        key, _, value = line[1:].partition(':')
        meta.setdefault(key.strip(), [])
        if value.strip() not in meta[key.strip()]:
            meta[key.strip()].append(value.strip())
        continue
    r, engine, weights, measure, value = line.split()
    rows.setdefault((engine, weights, measure), {})[int(r)] = float(value)
    rounds.add(int(r))

def m(key):
    return ', '.join(meta.get(key, ['unknown']))

print(f"CPU: {m('cpu')}")
print(f"charm kernels: {m('charm kernels')}")
print()
print('| engine, weights, measure | tok/s per round |')
print('|---|---|')
for (engine, weights, measure), v in sorted(rows.items()):
    per = ' / '.join(f'{v[r]:.1f}' if r in v else '-' for r in sorted(rounds))
    print(f'| {engine} {weights} {measure} | {per} |')

def reading(ratios, q1, q3):
    if len(ratios) < 3:
        return 'too few rounds'
    lo, hi = (q1, q3) if q1 is not None else (min(ratios), max(ratios))
    return 'charm ahead' if lo > 1 else 'llama.cpp ahead' if hi < 1 else 'level'

print()
print('Paired ratios charm / llama.cpp (the two runs of a round back to back; above 1: charm faster)')
print()
print('| charm | llama.cpp | measure | median | min-max | IQR | rounds | reading | per round |')
print('|---|---|---|---|---|---|---|---|---|')
for charm_w, llama_w in (('int4-all', 'Q4_0'), ('int8-all', 'Q8_0')):
    # prefill-warm: charm's prefill after an untimed one, against llama-bench's (timed after its
    # own warm-up run)
    for measure in ('decode', 'prefill', 'prefill-warm'):
        c = rows.get(('charm', charm_w, measure), {})
        l = rows.get(('llama.cpp', llama_w, 'prefill' if measure == 'prefill-warm' else measure), {})
        paired = [r for r in sorted(rounds) if r in c and r in l and l[r] > 0]
        ratios = [c[r] / l[r] for r in paired]
        if not ratios:
            print(f'| {charm_w} | {llama_w} | {measure} | - | - | - | 0 | no paired rounds | - |')
            continue
        q1 = q3 = None
        iqr = '-'
        if len(ratios) >= 4:
            q1, _, q3 = statistics.quantiles(ratios, n=4, method='inclusive')
            iqr = f'{q1:.2f}-{q3:.2f}x'
        per = ' / '.join(f'{x:.2f}' for x in ratios)
        print(f'| {charm_w} | {llama_w} | {measure} | {statistics.median(ratios):.2f}x '
              f'| {min(ratios):.2f}-{max(ratios):.2f}x | {iqr} | {len(ratios)} '
              f'| {reading(ratios, q1, q3)} | {per} |')
print()
print(f"charm commit {m('commit')}; charm kernels {m('charm kernels')}; CPU {m('cpu')}; "
      f"llama.cpp build_commit {m('llama.cpp build_commit')} ({m('llama.cpp')}); "
      f"{m('threads')} threads; {len(rounds)} rounds")
print('reading: charm or llama.cpp ahead where the interquartile range (min-max under 4 rounds) '
      'lies wholly above or below 1.00x, level where it contains 1.00x')
PY
)

if [ "${1:-}" = "--summarize" ]; then
  python3 -c "$summary_py" < "${2:-/dev/stdin}"
  exit
fi

usage="usage: benches/sidebyside.sh HF_DIR LLAMA_CPP_DIR [WORK_DIR] [ROUNDS] [LLAMA_BUILD]"
hf=${1:?$usage}
llama=${2:?$usage}
work=${3:-$(dirname "$hf")/charm-yardstick}
rounds=${4:-6}
build=${5:-build}   # the llama.cpp build directory (e.g. one configured without AVX-512)
case $rounds in ''|*[!0-9]*|0) echo "ROUNDS must be a positive integer; $usage" >&2; exit 2 ;; esac
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
cpu=$(grep -o -w 'avx2\|avx512f\|avx512_vnni\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ' | sed 's/ $//')
isa=$(RAYON_NUM_THREADS=2 "$bin" generate --model "$work/int4-all" --ids 1,2 --max-tokens 1 --json 2>/dev/null | python3 -c "import json,sys; print(json.load(sys.stdin)['isa'])")
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit="$commit+uncommitted"
log=$work/sidebyside-$commit-$(printf %s "$isa" | tr -c 'A-Za-z0-9_.-' '_')-$(date +%Y%m%d-%H%M%S).txt

# one llama.cpp file: prefill, then decode (`ROUND llama.cpp Q4_0 prefill TOK_S`)
llama_run() {
  "$lb" -m "$work/bench-$2.gguf" -t 2 -p 128 -n 0 -r 1 -o csv 2>/dev/null |
    python3 -c "import csv,sys
for r in csv.DictReader(sys.stdin):
    print('# llama.cpp build_commit:', r.get('build_commit', 'unknown'))
    print('$1 llama.cpp $2 prefill', r['avg_ts'])"
  "$lb" -m "$work/bench-$2.gguf" -t 2 -p 0 -n 64 -d 128 -r 1 -o csv 2>/dev/null |
    python3 -c "import csv,sys; [print('$1 llama.cpp $2 decode', r['avg_ts']) for r in csv.DictReader(sys.stdin)]"
}
# one charm mix: a 128-token prompt and 64 tokens decoded after it (the prompt's prefill cold:
# the process's first forward pass), then the prompt prefilled warm (`--warmup 1`: after one
# untimed prefill, as llama-bench times after its warm-up run)
charm_run() {
  RAYON_NUM_THREADS=2 "$bin" generate --model "$work/$2" --ids "$ids" --max-tokens 64 --temperature 0 --json --activations int8 |
    python3 -c "import json,sys; d=json.load(sys.stdin); print('$1 charm $2 prefill', d['prefill_tok_s']); print('$1 charm $2 decode', d['decode_tok_s'])"
  RAYON_NUM_THREADS=2 "$bin" generate --model "$work/$2" --ids "$ids" --max-tokens 1 --temperature 0 --json --activations int8 --warmup 1 |
    python3 -c "import json,sys; d=json.load(sys.stdin); print('$1 charm $2 prefill-warm', d['prefill_tok_s'])"
}

{
  echo "# commit: $commit"
  echo "# cpu: $cpu"
  echo "# charm kernels: $isa"
  echo "# llama.cpp: $lb"
  echo "# threads: 2"
  for r in $(seq "$rounds"); do
    echo "round $r of $rounds" >&2
    for pair in "Q4_0 int4-all" "Q8_0 int8-all"; do
      set -- $pair
      if [ $((r % 2)) = 1 ]; then
        llama_run "$r" "$1"; charm_run "$r" "$2"
      else
        charm_run "$r" "$2"; llama_run "$r" "$1"
      fi
    done
    charm_run "$r" int4-default
  done
} | tee "$log" | python3 -c "$summary_py"
echo "per-round lines: $log (benches/sidebyside.sh --summarize $log prints these tables again)"
