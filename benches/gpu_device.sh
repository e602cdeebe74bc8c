#!/usr/bin/env bash
# The GPU checks on a lent machine with a real adapter (an NVIDIA GPU through Vulkan): a release
# build, the bit-identity tests (`tests/gpu.rs`, a missing adapter counting as a failure), then
# the dense skeleton's (`tests/dense_gpu.rs`), then the full GPU bench (`benches/gpu.rs`: copy
# bandwidth, int4/int8 expert kernels at GLM-5.2's shape, the demo model end to end, the dense
# pass on the GPU and on the CPU). Everything goes to stdout; about 10 minutes in all.
#
# usage: benches/gpu_device.sh
# Offline: cargo must find every crate already (a carried CARGO_HOME or vendored sources), and a
# carried target/ saves most of the build. Vulkan: a loader (libvulkan.so.1) and the NVIDIA ICD;
# where the machine lacks the loader, carry `.gl/*.deb` (see the device notes) and they are
# unpacked here.
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_NET_OFFLINE=true CHARM_REQUIRE_GPU=1

# the Vulkan loader, and the NVIDIA driver's ICD where the loader does not find it by itself
if ! ldconfig -p | grep -q libvulkan.so.1 && ls .gl/*.deb >/dev/null 2>&1; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
nv=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$nv" ] && [ -z "${VK_DRIVER_FILES:-}" ] && export VK_DRIVER_FILES=$nv
command -v nvidia-smi >/dev/null && nvidia-smi -L
command -v cargo >/dev/null || { echo "no cargo on this machine: carry a toolchain"; exit 2; }
echo "cores $(nproc), $(cargo --version), VK_DRIVER_FILES=${VK_DRIVER_FILES:-unset}"

step() { # label seconds command..: runs a step under a time limit, printing its time and status
  local label=$1 limit=$2 t=$SECONDS
  shift 2
  echo "== $label"
  timeout "$limit" "$@"
  local rc=$?
  echo "== $label: exit $rc after $((SECONDS - t)) s"
  return $rc
}

# 1. build everything the two steps run (release: the test binary, charm, the bench)
step build 300 bash -c 'cargo build --release --bin charm &&
  cargo test --release --test gpu --test dense_gpu --no-run && cargo bench --bench gpu --no-run' || exit 1
# 2. the kernels and the VRAM tier against the CPU, bit for bit, on the first adapter in order;
# then the dense skeleton on the device (every oracle fixture, the demo, the gateway, workers)
step "cargo test --release --test gpu" 100 cargo test --release --test gpu
tests=$?
step "cargo test --release --test dense_gpu" 120 cargo test --release --test dense_gpu
dense=$?
# 3. the bench at full shapes (its own MISMATCH lines and exit 1 if the GPU differs)
step "cargo bench --bench gpu" 80 cargo bench --bench gpu
bench=$?
echo "tests exit $tests, dense tests exit $dense, bench exit $bench"
[ "$tests" -eq 0 ] && [ "$dense" -eq 0 ] && [ "$bench" -eq 0 ]
