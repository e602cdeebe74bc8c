#!/usr/bin/env bash
# A yardstick decode step against the memory bound, in interleaved rounds: each round runs the
# decode profile (`cargo bench --bench profile`) on every configuration in turn (int4 then int8
# experts; one row, then four identical rows; this CPU's kernels, then `CHARM_ISA=avx2` where the
# CPU has AVX-512 VNNI), 2 threads, int8 activations, 128 steps after a 16-token prompt.
#
# usage: benches/decode_rounds.sh [ROUNDS] [WORK_DIR]
#        benches/decode_rounds.sh --summarize [RUN_LOG]    # the table again from a saved run's log
#   ROUNDS:   rounds to run (default 5)
#   WORK_DIR: where the synthetic yardstick containers (`charm synth --preset yardstick`) and the
#             run logs go (default target/decode-rounds)
#
# It prints, per ISA and expert format, the medians (min-max) over the rounds of: the one-row
# step, its share of the bound (the step's weight bytes over the memory probe of the same run),
# the probe, four rows' step over one row's (each run's own alternating runs), and attention over
# the cache's share of a profiled step at one row and at four. The raw per-run lines are saved in
# WORK_DIR (decode-rounds-COMMIT-TIME.txt).
set -euo pipefail

summary_py=$(cat <<'PY'
import re, statistics, sys

runs, cur, meta = [], None, {}
for line in sys.stdin:
    m = re.match(r'# (\w+): (.*)', line)
    if m:
        meta[m[1]] = m[2].strip()
        continue
    m = re.match(r'run (\d+) (\S+) (\S+) (\d+)', line)
    if m:
        cur = dict(round=int(m[1]), isa=m[2], experts=m[3], rows=int(m[4]))
        runs.append(cur)
        continue
    if cur is None:
        continue
    m = re.match(r'step ([\d.]+) ms.* at ([\d.]+) GB/s .*: ([\d.]+)% of the bound', line)
    if m:
        cur.update(step=float(m[1]), probe=float(m[2]), share=float(m[3]))
    m = re.match(r'rows \d+: .*: ([\d.]+)x', line)
    if m:
        cur['ratio'] = float(m[1])
    m = re.match(r'\s+Attend\s+([\d.]+) ms\s+([\d.]+)%', line)
    if m:
        cur.update(attend=float(m[1]), attend_share=float(m[2]))

def med(v, digits, unit):
    v = sorted(x for x in v if x is not None)
    if not v:
        return '-'
    f = lambda x: f'{x:.{digits}f}'
    return f'{f(statistics.median(v))}{unit} ({f(v[0])}-{f(v[-1])}{unit})'

print('| ISA | experts | step, one row | of the bound | probe | four rows / one row | attention, one row | attention, four rows | rounds |')
print('|---|---|---|---|---|---|---|---|---|')
keys = sorted({(r['isa'], r['experts']) for r in runs}, key=lambda k: (k[0] != 'native', k))
for isa, experts in keys:
    one = [r for r in runs if (r['isa'], r['experts'], r['rows']) == (isa, experts, 1) and 'step' in r]
    four = [r for r in runs if (r['isa'], r['experts'], r['rows']) == (isa, experts, 4) and 'ratio' in r]
    probes = [r['probe'] for r in one]
    name = meta.get(f'isa_{isa}', isa)
    print(f"| {name} | {experts} | {med([r['step'] for r in one], 2, ' ms')} "
          f"| {med([r['share'] for r in one], 0, '%')} "
          f"| {min(probes, default=0):.0f}-{max(probes, default=0):.0f} GB/s "
          f"| {med([r['ratio'] for r in four], 2, 'x')} "
          f"| {med([r.get('attend_share') for r in one], 1, '%')} "
          f"| {med([r.get('attend_share') for r in four], 1, '%')} "
          f"| {len(one)} |")
print()
print(f"charm commit {meta.get('commit', '?')}; CPU {meta.get('cpu', '?')}; 2 threads; "
      "int8 activations; 128 steps after a 16-token prompt")
PY
)

if [ "${1:-}" = "--summarize" ]; then
  python3 -c "$summary_py" < "${2:-/dev/stdin}"
  exit
fi

usage="usage: benches/decode_rounds.sh [ROUNDS] [WORK_DIR]"
rounds=${1:-5}
case $rounds in ''|*[!0-9]*|0) echo "ROUNDS must be a positive integer; $usage" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
work=${2:-target/decode-rounds}
cargo build --release -q
profile=$(cargo bench --bench profile --no-run --message-format=json 2>/dev/null |
  python3 -c "import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get('reason') == 'compiler-artifact' and m['target']['name'] == 'profile' and m.get('executable'):
        print(m['executable'])")
[ -x "$profile" ] || { echo "could not build the profile bench" >&2; exit 1; }
mkdir -p "$work"
[ -f "$work/int4/charm.json" ] || target/release/charm synth --preset yardstick --out "$work/int4" >/dev/null
[ -f "$work/int8/charm.json" ] || target/release/charm synth --preset yardstick --experts int8 --out "$work/int8" >/dev/null
isa_of() {
  env "$@" RAYON_NUM_THREADS=2 target/release/charm generate --model "$work/int4" --ids 1,2 --max-tokens 1 --json 2>/dev/null |
    python3 -c "import json,sys; print(json.load(sys.stdin)['isa'])"
}
native=$(isa_of)
isas="native"
[ "$native" = Avx512Vnni ] && isas="native avx2"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit="$commit+uncommitted"
log=$work/decode-rounds-$commit-$(date +%Y%m%d-%H%M%S).txt
{
  echo "# commit: $commit"
  echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
  echo "# isa_native: $native"
  echo "# isa_avx2: Avx2"
} > "$log"
for r in $(seq 1 "$rounds"); do
  for isa in $isas; do
    env=()
    [ "$isa" = avx2 ] && env=(CHARM_ISA=avx2)
    for experts in int4 int8; do
      for rows in 1 4; do
        echo "run $r $isa $experts $rows" >> "$log"
        env "${env[@]}" RAYON_NUM_THREADS=2 "$profile" --model "$work/$experts" --activations int8 \
          --tokens 128 --rows "$rows" 2>&1 | grep -E '^(step|rows)|Attend' >> "$log"
      done
    done
  done
  echo "round $r of $rounds done" >&2
done
python3 -c "$summary_py" < "$log"
echo "log: $log"
