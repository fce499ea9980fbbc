#!/usr/bin/env bash
# The side-by-side run behind BENCHMARKS.md: kvgate and llama.cpp's llama-bench on the same GGUF,
# the same thread count, back to back in one script, plus kvgate's KV-waste measurement.
#
#   LLAMA_BENCH=/path/to/llama-bench scripts/bench-vs-llama.sh [THREADS]
#
# MODEL=FILE.gguf compares on another file (default: the default model), e.g. its Q4_K_M
# requantization from `kvgate quantize`; KVGATE=BINARY skips the release build and uses that
# binary (the opt-level-3 dev build, target/debug/kvgate, computes the same); STREAMS=none
# measures only what llama-bench's pp/tg compare with (no aggregate decode, no KV waste).
#
# llama-bench comes from the llama-cpp-python 0.3.36 source package (see BENCHMARKS.md for the
# build). Run it on an otherwise idle machine: both tools read ~97 MB of weights per decoded
# token, so any other job on the cores or the memory bus shows up in the numbers.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${1:-2}"
LLAMA_BENCH="${LLAMA_BENCH:?set LLAMA_BENCH to the llama-bench binary}"

if [ -z "${KVGATE:-}" ]; then
  cargo build --release -q -p kvgate
  KVGATE="${CARGO_TARGET_DIR:-./target}/release/kvgate"
fi
MODEL="${MODEL:-$($KVGATE fetch-model)}"
STREAMS="${STREAMS:-1,4,16,64}"

echo "== $(basename "$MODEL"), $(date -u '+%Y-%m-%d %H:%M UTC'), $THREADS threads, $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== kvgate bench (decode from an empty context, like tg128)"
$KVGATE bench --model "$MODEL" --threads "$THREADS" --streams "$STREAMS" --json
echo "== kvgate bench --decode-depth 200 (like tg128 @ d200)"
$KVGATE bench --model "$MODEL" --threads "$THREADS" --streams "$STREAMS" --json --decode-depth 200
echo "== llama-bench: pp200, tg128 from an empty context and after a 200-token prompt"
LD_LIBRARY_PATH="$(dirname "$LLAMA_BENCH"):${LD_LIBRARY_PATH:-}" \
  "$LLAMA_BENCH" -m "$MODEL" -p 200 -n 128 -t "$THREADS" -r 3 -d 0,200
echo "== kvgate bench again (drift check)"
$KVGATE bench --model "$MODEL" --threads "$THREADS" --streams "$STREAMS" --json
$KVGATE bench --model "$MODEL" --threads "$THREADS" --streams "$STREAMS" --json --decode-depth 200
echo "== kvgate KV waste"
if [ "$STREAMS" != none ]; then
  $KVGATE bench --model "$MODEL" --threads "$THREADS" --kv-waste
fi
echo "== load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
