#!/usr/bin/env bash
# Checks kvoffload on a machine with an NVIDIA GPU (prepared for an H200; finishes well under
# 5 minutes). Everything it prints also goes to $OUT/gpu-check.log, and a one-line-per-step
# summary to $OUT/summary.txt, when OUT is set.
#
#   scripts/gpu-check.sh            on the GPU machine. With cargo there: nvidia-smi, release
#                                   build, `cargo test --release`, the ignored real-GPU test
#                                   (real_gpu_round_trip in tests/cuda_fake.rs), and the `gpu`
#                                   benchmarks of
#                                   benches/transfer.rs if that bench exists (host<->device GB/s
#                                   at 16 KiB..2 MiB blocks, about 80 s; summary table at the end).
#                                   Without cargo there (the lent H200 image has no Rust): runs the
#                                   same test and bench executables from target/gpu-bundle/.
#   scripts/gpu-check.sh targets    anywhere with cargo: only the CPU benchmarks behind the vLLM
#                                   0.33 performance targets (see `targets` below), with their
#                                   figures set against the targets. The GPU machine runs them
#                                   too, after the GPU benches: its CPU is another point of
#                                   comparison than a build machine's.
#   scripts/gpu-check.sh bundle     on a build machine with cargo (same CPU architecture; glibc
#                                   no newer than the GPU machine's): builds those executables in
#                                   release mode into target/gpu-bundle/ (stripped). Carry that
#                                   path to the GPU machine, e.g. run(carry=["target/gpu-bundle"],
#                                   command="scripts/gpu-check.sh").
#
# Environment: KVO_GPU_CHECK_NO_CARGO=1 forces the bundle even where cargo exists; KVO_TRACES is
# the folder of the request traces (default ../shared/traces; the bundle carries a copy).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUNDLE=target/gpu-bundle
START=$SECONDS
FAILED=0
SUMMARY=""

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/gpu-check.log") 2>&1
fi

log() { printf '[%s +%4ds] %s\n' "$(date -u +%H:%M:%S)" "$((SECONDS - START))" "$*"; }

# step NAME TIMEOUT_S COMMAND...: runs the command under a time limit; a failure is recorded and
# the script goes on.
step() {
  local name=$1 limit=$2
  shift 2
  log "=== $name: $*"
  local t0=$SECONDS rc=0
  timeout --kill-after=10 "$limit" "$@" || rc=$?
  local line
  if [ "$rc" -eq 0 ]; then
    line="ok    $name ($((SECONDS - t0)) s)"
  else
    if [ "$rc" -eq 124 ]; then
      line="FAIL  $name: timed out after ${limit} s"
    else
      line="FAIL  $name: exit $rc ($((SECONDS - t0)) s)"
    fi
    FAILED=1
  fi
  log "$line"
  SUMMARY+="$line"$'\n'
}

finish() {
  log "=== summary"
  printf '%s' "$SUMMARY"
  if [ -n "${OUT:-}" ]; then printf '%s' "$SUMMARY" >"$OUT/summary.txt"; fi
  log "done, $([ "$FAILED" -eq 0 ] && echo 'all passed' || echo 'FAILURES')"
  exit "$FAILED"
}

gpu_info() {
  log "=== machine: $(uname -srm); $(nproc) CPUs"
  if command -v nvidia-smi >/dev/null 2>&1; then
    step nvidia-smi 30 nvidia-smi
    # The host link the transfer benches compare against (current gen drops when idle).
    log "pcie: $(nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max --format=csv,noheader 2>&1 | head -4 | tr '\n' ';' || true)"
  else
    log "nvidia-smi not found"
  fi
  log "libcuda: $( (ldconfig -p 2>/dev/null | grep -m3 'libcuda\.so' | tr -s ' \t' ' ') || true)"
  if [ ! -e /dev/nvidia0 ]; then log "warning: /dev/nvidia0 does not exist; the GPU tests will skip themselves"; fi
}

# targets SCHEDULER_BENCH MANAGER_BENCH: the benchmarks of the vLLM 0.33 targets in both
# semantics (0.24 beside 0.33): `build_step` with 256 one-chunk requests (at most 50 us in 0.33)
# and with 8,192-token prompts at factor 4 (at most twice the one-chunk step), and the manager
# replay of the conversation trace (at most 45 ns a block from Rust, 2 us a request through the
# C ABI; skipped without the trace). Each bench is an executable or "cargo:NAME". Prints one line
# per case: its median and, for 0.33, the target and whether it holds.
targets() {
  local sched=$1 manager=$2
  TARGETS_RAW=$(mktemp)
  export TARGETS_RAW
  # bench_cmd BENCH: the command line that runs BENCH's benchmarks, the options to follow.
  bench_cmd() {
    case "$1" in
      cargo:*) BENCH=(cargo bench --bench "${1#cargo:}" --) ;;
      *) BENCH=("$1" --bench) ;;
    esac
    BENCH+=(--warm-up-time 1 --measurement-time 3 --noplot)
  }
  local tee='"$@" | tee -a "$TARGETS_RAW"'
  bench_cmd "$sched"
  step bench_step_targets 300 bash -o pipefail -c "$tee" _ "${BENCH[@]}" \
    'factor1_prompt16(_v033)?$|factor4_prompt8192(_v033)?$'
  local traces=${KVO_TRACES:-$ROOT/../shared/traces} requests=0
  if [ -f "$traces/conversation_trace.jsonl" ]; then
    export KVO_TRACES=$traces
    requests=$(grep -c . "$traces/conversation_trace.jsonl")
    bench_cmd "$manager"
    step bench_replay_targets 300 bash -o pipefail -c "$tee" _ "${BENCH[@]}" \
      'replay_conversation_5859_slots'
  else
    log "no $traces/conversation_trace.jsonl (set KVO_TRACES): replay targets skipped"
  fi
  log "=== vLLM 0.33 targets (medians; 0.24 beside them)"
  awk -v requests="$requests" -f "$ROOT/scripts/targets.awk" "$TARGETS_RAW" |
    if [ -n "${OUT:-}" ]; then tee "$OUT/targets.txt"; else cat; fi
  if [ -n "${OUT:-}" ]; then cp "$TARGETS_RAW" "$OUT/targets-criterion.txt"; fi
  rm -f "$TARGETS_RAW"
}

# ---- bundle: build the executables here ----------------------------------------------------
if [ "${1:-}" = "bundle" ]; then
  log "=== building release test and bench executables into $BUNDLE"
  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE"
  listing=$(mktemp)
  cargo test --release --no-run --message-format=json-render-diagnostics >"$listing"
  if [ -f benches/transfer.rs ]; then
    cargo bench --bench transfer --no-run --message-format=json-render-diagnostics >>"$listing"
  fi
  for b in scheduler manager; do
    cargo bench --bench "$b" --no-run --message-format=json-render-diagnostics >>"$listing"
  done
  cargo build --release --lib
  # One line per executable: KIND NAME PATH (kind: lib or bin unit tests, test, bench).
  python3 - "$listing" >"$BUNDLE/MANIFEST" <<'PY'
import json, sys
seen = set()
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    if m.get("reason") != "compiler-artifact" or not exe:
        continue
    t = m["target"]
    kinds = set(t["kind"])
    kind = "lib" if kinds & {"lib", "rlib", "cdylib"} else t["kind"][0]
    if kind not in ("lib", "bin", "test", "bench") or (kind, t["name"]) in seen:
        continue
    seen.add((kind, t["name"]))
    print(kind, t["name"], exe)
PY
  rm -f "$listing"
  while read -r kind name exe; do
    # tests/python.rs and tests/install.rs run cargo (the latter through CMake): useless where
    # there is none.
    case "$kind/$name" in test/python | test/install) continue ;; esac
    cp "$exe" "$BUNDLE/$kind-$name"
    strip --strip-debug "$BUNDLE/$kind-$name" 2>/dev/null || true
  done <"$BUNDLE/MANIFEST"
  # The cdylib, for tests/c_api.rs (it looks next to its executable).
  cp target/release/libkvoffload.so "$BUNDLE/"
  strip --strip-debug "$BUNDLE/libkvoffload.so" 2>/dev/null || true
  # The replay target needs the conversation trace (not part of the repository).
  traces=${KVO_TRACES:-$ROOT/../shared/traces}
  if [ -f "$traces/conversation_trace.jsonl" ]; then
    mkdir -p "$BUNDLE/traces" && cp "$traces/conversation_trace.jsonl" "$BUNDLE/traces/"
  else
    log "warning: no $traces/conversation_trace.jsonl: the bundle runs no replay target"
  fi
  # The tests carry compile-time paths (CARGO_MANIFEST_DIR, CARGO_TARGET_TMPDIR) under this root.
  echo "$ROOT" >"$BUNDLE/build-root"
  ls -l "$BUNDLE"
  log "bundle: $(du -sh "$BUNDLE" | cut -f1) (64 MiB may travel in all); carry \"$BUNDLE\""
  exit 0
fi

# ---- targets: only the benchmarks of the vLLM 0.33 targets, here --------------------------
if [ "${1:-}" = "targets" ]; then
  log "=== machine: $(uname -srm); $(nproc) CPUs"
  targets cargo:scheduler cargo:manager
  finish
fi

# ---- on the GPU machine --------------------------------------------------------------------
log "=== kvoffload GPU check in $ROOT"
gpu_info

if command -v cargo >/dev/null 2>&1 && [ "${KVO_GPU_CHECK_NO_CARGO:-0}" != 1 ]; then
  cargo --version
  step build 180 cargo build --release
  step test 120 cargo test --release
  step real_gpu_round_trip 120 cargo test --release --test cuda_fake -- --ignored --nocapture real_gpu_round_trip
  if [ -f benches/transfer.rs ]; then
    step bench_gpu 180 cargo bench --bench transfer -- --warm-up-time 1 --measurement-time 3 gpu
  else
    log "benches/transfer.rs does not exist: skipped"
  fi
  targets cargo:scheduler cargo:manager
  finish
fi

if [ ! -f "$BUNDLE/MANIFEST" ]; then
  log "no cargo here and no $BUNDLE: run 'scripts/gpu-check.sh bundle' on a build machine and carry $BUNDLE"
  exit 2
fi
log "no cargo here (or KVO_GPU_CHECK_NO_CARGO=1): running the executables of $BUNDLE"
build_root=$(cat "$BUNDLE/build-root")
if [ "$build_root" != "$ROOT" ]; then
  if [ ! -e "$build_root" ]; then
    # Let the compile-time paths of the tests resolve to this copy of the tree.
    mkdir -p "$(dirname "$build_root")" && ln -s "$ROOT" "$build_root" &&
      log "linked $build_root -> $ROOT" || log "warning: cannot link $build_root; tests using compile-time paths may fail"
  elif [ "$(cd "$build_root" && pwd -P)" != "$(pwd -P)" ]; then
    log "warning: $build_root exists and is another tree; tests using compile-time paths read it"
  fi
fi
export CARGO_MANIFEST_DIR=$ROOT
# The kvo-replay tests run the binary from its compile-time path (CARGO_BIN_EXE_kvo-replay).
if [ -x "$BUNDLE/bin-kvo-replay" ] && [ ! -e target/release/kvo-replay ]; then
  mkdir -p target/release && cp "$BUNDLE/bin-kvo-replay" target/release/kvo-replay
fi
bench_exe=""
while read -r kind name _; do
  exe="$BUNDLE/$kind-$name"
  [ -x "$exe" ] || continue
  case "$kind/$name" in test/python | test/install) log "skipped $kind-$name: it needs cargo"; continue ;; esac
  case "$kind" in
    lib | bin | test) step "$kind-$name" 120 "$exe" ;;
    bench) if [ "$name" = transfer ]; then bench_exe=$exe; fi ;;
  esac
done <"$BUNDLE/MANIFEST"
if [ -x "$BUNDLE/test-cuda_fake" ]; then
  step real_gpu_round_trip 120 "$BUNDLE/test-cuda_fake" --ignored --nocapture real_gpu_round_trip
fi
if [ -n "$bench_exe" ]; then
  step bench_gpu 180 "$bench_exe" --bench --warm-up-time 1 --measurement-time 3 gpu
else
  log "no transfer bench executable: skipped"
fi
if [ -x "$BUNDLE/bench-scheduler" ] && [ -x "$BUNDLE/bench-manager" ]; then
  if [ -z "${KVO_TRACES:-}" ] && [ -d "$BUNDLE/traces" ]; then export KVO_TRACES=$ROOT/$BUNDLE/traces; fi
  targets "$BUNDLE/bench-scheduler" "$BUNDLE/bench-manager"
else
  log "no scheduler or manager bench executable: targets skipped"
fi
finish
