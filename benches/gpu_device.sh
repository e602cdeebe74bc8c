#!/usr/bin/env bash
# The GPU checks on a lent machine with a real adapter (an NVIDIA GPU through Vulkan): the
# bit-identity tests (`tests/gpu.rs`, a missing adapter counting as a failure), then the dense
# skeleton's (`tests/dense_gpu.rs`), then the full GPU bench (`benches/gpu.rs`: copy bandwidth,
# int4/int8 expert kernels at GLM-5.2's shape, the demo model and the yardstick end to end, their
# dense pass on the GPU and on the CPU), then `charm plan --cluster`'s prediction with the dense
# pass on the GPU against a measured decode (`benches/cluster.rs --predict`). Everything goes to
# stdout; each step has a time limit, under 9 minutes in all (a device call may run 10).
#
# usage: benches/gpu_device.sh prepare   (here, with cargo)
#        benches/gpu_device.sh           (there)
# The lent machines have no Rust toolchain. `prepare` builds the two test and two bench programs
# and charm in release, strips them into .device/bins.tar.xz (about 17 MB; the programs look for
# the checkout at the path they were built in, which the run links to its own) and fetches the
# Vulkan loader's packages into .gl/. Then one device call:
#   run(command="benches/gpu_device.sh 2>&1 | tee $OUT/log", carry=[".device/bins.tar.xz", ".gl"])
# Where the machine has cargo, the script builds there instead (offline: a carried CARGO_HOME or
# vendored sources, and a carried target/ saves most of the build). Vulkan: a loader
# (libvulkan.so.1) and the NVIDIA ICD; where the machine lacks the loader, the carried
# `.gl/*.deb` are unpacked.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = prepare ]; then
  # the programs cargo builds, by kind and name, from its JSON messages
  exe() {
    python3 -c '
import json, sys
kind, name = sys.argv[1:]
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and kind in t.get("kind", []) and t.get("name") == name:
        print(m["executable"])' "$@"
  }
  set -e
  cargo build --release --bin charm
  stage=.device/stage
  rm -rf .device && mkdir -p "$stage"
  for t in gpu dense_gpu; do
    f=$(cargo test --release --test "$t" --no-run --message-format=json | exe test "$t")
    strip -o "$stage/test-$t" "$f"
  done
  for b in gpu cluster; do
    f=$(cargo bench --bench "$b" --no-run --message-format=json | exe bench "$b")
    strip -o "$stage/bench-$b" "$f"
  done
  strip -o "$stage/charm" target/release/charm
  pwd > "$stage/root"
  git rev-parse --short HEAD > "$stage/commit"
  tar -C "$stage" -cJf .device/bins.tar.xz .
  rm -rf "$stage"
  ls -l .device/bins.tar.xz
  # the Vulkan loader (the device notes' recipe), where apt can fetch it
  mkdir -p .gl /tmp/amd64/partial
  o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
  (apt-get $o update -qq && cd .gl && apt-get $o download libvulkan1) ||
    echo "no Vulkan loader fetched: the machine must have its own"
  ls .gl
  exit 0
fi

export CARGO_NET_OFFLINE=true CHARM_REQUIRE_GPU=1

# the Vulkan loader, and the NVIDIA driver's ICD where the loader does not find it by itself
if ! ldconfig -p | grep -q libvulkan.so.1 && ls .gl/*.deb >/dev/null 2>&1; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
nv=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$nv" ] && [ -z "${VK_DRIVER_FILES:-}" ] && export VK_DRIVER_FILES=$nv
command -v nvidia-smi >/dev/null && nvidia-smi -L

step() { # label seconds command..: runs a step under a time limit, printing its time and status
  local label=$1 limit=$2 t=$SECONDS
  shift 2
  echo "== $label"
  timeout "$limit" "$@"
  local rc=$?
  echo "== $label: exit $rc after $((SECONDS - t)) s"
  return $rc
}

if command -v cargo >/dev/null; then
  echo "cores $(nproc), $(cargo --version), VK_DRIVER_FILES=${VK_DRIVER_FILES:-unset}"
  # 1. build everything the two steps run (release: the test binary, charm, the bench)
  step build 300 bash -c 'cargo build --release --bin charm &&
    cargo test --release --test gpu --test dense_gpu --no-run &&
    cargo bench --bench gpu --bench cluster --no-run' || exit 1
  gpu_tests=(cargo test --release --test gpu)
  dense_tests=(cargo test --release --test dense_gpu)
  gpu_bench=(cargo bench --bench gpu --)
  cluster_bench=(cargo bench --bench cluster --)
elif [ -f .device/bins.tar.xz ]; then
  # the programs `prepare` built: they find the checkout (models, fixtures, charm) at the path
  # they were built in
  bin=$PWD/.device/bin
  mkdir -p "$bin" && tar -C "$bin" -xJf .device/bins.tar.xz || exit 1
  root=$(cat "$bin/root")
  if ! [ "$root" -ef "$PWD" ]; then
    [ -e "$root" ] && { echo "$root exists here: the programs would read it"; exit 2; }
    mkdir -p "$(dirname "$root")" && ln -s "$PWD" "$root" || exit 2
  fi
  mkdir -p target/release && cp "$bin/charm" target/release/charm
  cd "$root" || exit 2
  echo "cores $(nproc), programs built at $(cat "$bin/commit"), VK_DRIVER_FILES=${VK_DRIVER_FILES:-unset}"
  gpu_tests=("$bin/test-gpu")
  dense_tests=("$bin/test-dense_gpu")
  gpu_bench=("$bin/bench-gpu" --bench)
  cluster_bench=("$bin/bench-cluster" --bench)
else
  echo "no cargo on this machine and no .device/bins.tar.xz: run 'benches/gpu_device.sh prepare' where cargo is and carry it"
  exit 2
fi
# 2. the kernels and the VRAM tier against the CPU, bit for bit, on the first adapter in order;
# then the dense skeleton on the device (every oracle fixture, the demo, the gateway, workers)
step "tests/gpu.rs" 80 "${gpu_tests[@]}"
tests=$?
step "tests/dense_gpu.rs" 100 "${dense_tests[@]}"
dense=$?
# 3. the bench at full shapes (its own MISMATCH lines and exit 1 if the GPU differs), on the demo
# model and on the yardstick (`charm synth --preset yardstick`)
step "benches/gpu.rs" 60 "${gpu_bench[@]}"
bench=$?
ys=$(mktemp -d)/yardstick
target/release/charm synth --preset yardstick --out "$ys" >/dev/null || exit 1
step "benches/gpu.rs --model yardstick" 80 "${gpu_bench[@]}" --model "$ys"
bench_ys=$?
# the yardstick's dense pass with the other matrix kernel (each lane reading its own row)
step "CHARM_GPU_MATVEC=lanes benches/gpu.rs --model yardstick" 80 \
  env CHARM_GPU_MATVEC=lanes "${gpu_bench[@]}" --model "$ys" --rows 1
bench_lanes=$?
# 4. `charm plan --cluster`'s prediction, probed with the dense pass on the GPU, against the
# measured decode on two loopback workers
step "benches/cluster.rs --predict --dense-device gpu" 120 "${cluster_bench[@]}" --model "$ys" \
  --workers 2 --tokens 64 --delays 0 --predict --activations int8 --dense-device gpu
predict=$?
echo "tests exit $tests, dense tests exit $dense, bench exit $bench / $bench_ys / $bench_lanes, prediction exit $predict"
for rc in "$tests" "$dense" "$bench" "$bench_ys" "$bench_lanes" "$predict"; do
  [ "$rc" -eq 0 ] || exit 1
done
