#!/usr/bin/env bash
# One prepared check of the CUDA backend on a lent GPU (an H200: driver 580 = CUDA 13.0, no
# network, at most 64 MiB carried in), in two halves:
#
#   scripts/gpu-check.sh build            # HERE (no GPU): release test binary + kvgate, stripped,
#                                         # into target/gpu-check/ (checked to fit in 64 MiB)
#   scripts/gpu-check.sh run [--dry-run]  # THERE, from the repository root with target/gpu-check
#                                         # carried: synthetic models, the #[ignore] GPU tests
#                                         # under KVGATE_REQUIRE_GPU=1, benchmarks, a summary
#
# The GPU tests include the tiled matmuls (kernels/cuda/mmq.cu: mmq_* for quantized weights,
# mm_f16 for F16): bit-identical to the matvec kernels on the device
# (tiled_matmul_is_bit_identical_to_matvec_on_the_device, lines
# `GPU-CHECK mmq_bit_identical_<type>_<cols>=passed`), and timed against the chunked matvec at
# batch 8, 16, 32, 64, 128 and 512 on Llama-2-13B's Q4_0 5120x5120 and 13824x5120 matrices and
# its 5120x5120 in F16 (bench_tiled_vs_chunked_matvec_llama2_13b_q4_0, lines
# `GPU-CHECK mmq_<rows>x<cols>_q4_0_batch<N> tiled_us= matvec_us= tiled_speedup=` and
# `GPU-CHECK mm_f16_5120x5120_batch<N> ...`). The
# runtime's switch-over, MMQ_MIN_EXCLUSIVE_BATCH in runtime/src/backend/cuda/step.rs, is an
# unmeasured guess until that output is read: set it to the largest batch whose
# tiled_speedup is below 1 (results are the same bits either way; only speed changes).
# They also check the tiled prefill attention kernel (paged_attention_tiled_d*) bit for bit
# against the row kernel on the device (tiled_attention_is_bit_identical_to_the_row_kernel_on_
# the_device, lines `GPU-CHECK tiled_attention_bit_identical_d<D>_g<group>=passed`).
#
# `run --dry-run` does everything that needs no GPU (finds the binaries, writes the small
# synthetic models, prints each command) so the script can be checked on a CPU-only machine.
# The run is meant to finish in under 8 minutes; each stage has its own timeout.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=target/gpu-check
LIMIT=$((64 * 1024 * 1024))

build() {
    # The GPU tests live in runtime/tests/gpu.rs; --no-run prints the test executable's path.
    local json exe
    json=$(cargo test --release -p kvgate-runtime --test gpu --no-run --message-format=json 2>/dev/null)
    exe=$(printf '%s\n' "$json" | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
    [ -n "$exe" ] || { echo "gpu-check: no test executable for runtime/tests/gpu.rs" >&2; exit 1; }
    cargo build --release --bin kvgate
    mkdir -p "$OUT"
    cp "$exe" "$OUT/gpu-tests"
    cp target/release/kvgate "$OUT/kvgate"
    strip "$OUT/gpu-tests" "$OUT/kvgate"
    local total
    total=$(du -cb "$OUT/gpu-tests" "$OUT/kvgate" | tail -1 | cut -f1)
    ls -l "$OUT"
    if [ "$total" -gt "$LIMIT" ]; then
        echo "gpu-check: $total bytes to carry, more than the 64 MiB a run may carry" >&2
        exit 1
    fi
    echo "gpu-check: $total bytes in $OUT (limit $LIMIT); carry it: run with carry [\"$OUT\"]"
}

# NVRTC and cuBLAS of the CUDA 13 (or 12) line, wherever the host has them (the H200 has them
# in a Python environment's nvidia/cu13/lib): the kernels are compiled at start-up by NVRTC,
# and 13.x needs its directory on LD_LIBRARY_PATH for libnvrtc-builtins.
find_libs() {
    local lib dir
    for name in 'libnvrtc.so.13*' 'libnvrtc.so.12*'; do
        lib=$(find / -xdev -name "$name" -not -name '*builtins*' 2>/dev/null | head -1 || true)
        [ -n "$lib" ] && break
    done
    [ -n "$lib" ] && { export KVGATE_NVRTC_LIB=$lib; dir=$(dirname "$lib"); export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"; }
    for name in 'libcublas.so.13*' 'libcublas.so.12*'; do
        lib=$(find / -xdev -name "$name" 2>/dev/null | head -1 || true)
        [ -n "$lib" ] && break
    done
    [ -n "$lib" ] && { export KVGATE_CUBLAS_LIB=$lib; dir=$(dirname "$lib"); export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"; }
    echo "NVRTC: ${KVGATE_NVRTC_LIB:-not found}"
    echo "cuBLAS: ${KVGATE_CUBLAS_LIB:-not found}"
}

run() {
    local dry=${1:-}
    local bin=$OUT work=${TMPDIR:-/tmp}/kvgate-gpu-check
    for f in gpu-tests kvgate; do
        [ -x "$bin/$f" ] || { echo "gpu-check: $bin/$f missing: run 'scripts/gpu-check.sh build' first and carry $OUT" >&2; exit 1; }
    done
    mkdir -p "$work"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
    find_libs

    # Models: built here from seeds (nothing can be downloaded). 13B Q4_0 is ~7.3 GB.
    local smol=$work/smollm2-135m-q4_0.gguf big=$work/llama2-13b-q4_0.gguf tiny=$work/tiny-q4_0.gguf
    local tinyk=$work/tiny-k-q4_k_m.gguf
    "$bin/kvgate" synth-model --shape tiny --dtype q4_0 --seed 7 "$tiny"
    # K-quants (Q4_K + Q6_K, llama.cpp's Q4_K_M mix) on the 256-wide tiny shape.
    "$bin/kvgate" synth-model --shape tiny-k --dtype q4_k_m --seed 7 "$tinyk"
    "$bin/kvgate" synth-model --shape smollm2-135m --dtype q4_0 --seed 7 "$smol"
    if [ "$dry" = --dry-run ]; then
        echo "dry run: would write: $bin/kvgate synth-model --shape llama2-13b --dtype q4_0 --seed 7 $big"
    else
        timeout 240 "$bin/kvgate" synth-model --shape llama2-13b --dtype q4_0 --seed 7 "$big"
    fi
    export KVGATE_GPU_MODEL_TINY_Q4_0=$tiny KVGATE_GPU_MODEL_SMOLLM2_135M_Q4_0=$smol
    export KVGATE_GPU_MODEL_TINY_K_Q4_K_M=$tinyk
    export KVGATE_GPU_MODEL_LLAMA2_13B_Q4_0=$big KVGATE_REQUIRE_GPU=1

    local tests=(--ignored --test-threads=1 --nocapture)
    local auto=(generate --device auto --model "$tiny" --max-tokens 8 --temperature 0 --raw hello)
    local kquant=(generate --device cuda --model "$tinyk" --max-tokens 8 --temperature 0 --raw hello)
    if [ "$dry" = --dry-run ]; then
        echo "dry run: would run: KVGATE_REQUIRE_GPU=1 timeout 420 $bin/gpu-tests ${tests[*]}"
        echo "dry run: would run: RUST_LOG=info timeout 60 $bin/kvgate ${auto[*]}"
        echo "dry run: would run: timeout 60 $bin/kvgate ${kquant[*]}"
        "$bin/gpu-tests" --list --ignored
        return 0
    fi
    local log=$work/gpu-tests.log status=0
    timeout 420 "$bin/gpu-tests" "${tests[@]}" 2>&1 | tee "$log" || status=$?
    echo "== kvgate --device auto on this host (device choice and memory plan) =="
    RUST_LOG=info timeout 60 "$bin/kvgate" "${auto[@]}" 2>&1 | grep -E "device:|GPU memory plan|KV cache|model " || true
    echo "== kvgate --device cuda on a Q4_K_M file (K-quant weights load and generate) =="
    if timeout 60 "$bin/kvgate" "${kquant[@]}" >"$work/kquant.out" 2>&1; then
        echo "GPU-CHECK generate_q4_k_m=passed" | tee -a "$log"
    else
        echo "GPU-CHECK generate_q4_k_m=FAILED" | tee -a "$log"; tail -5 "$work/kquant.out"; status=1
    fi

    echo "== summary =="
    echo "tests passed: $(grep -c '^test .* ok$' "$log" || true), failed: $(grep -c '^test .* FAILED$' "$log" || true)"
    grep '^test ' "$log" || true
    grep '^GPU-CHECK ' "$log" | sed 's/^GPU-CHECK //' || true
    echo "targets: attention >= 0.70 of copy bandwidth; single-stream decode >= 0.50 of the weight bound; decode_64 >= 10x single"
    echo "tiled matmul: set MMQ_MIN_EXCLUSIVE_BATCH (runtime/src/backend/cuda/step.rs) to the largest batch whose mmq_*/mm_f16_* tiled_speedup < 1"
    return "$status"
}

case "${1:-}" in
    build) build ;;
    run) shift; run "${1:-}" ;;
    *) echo "usage: scripts/gpu-check.sh build | run [--dry-run]" >&2; exit 2 ;;
esac
