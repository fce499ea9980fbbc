#!/usr/bin/env bash
# kvgate's whole test suite, exactly as CI runs it (.ci/run calls this script).
# It installs what the tests need on a fresh machine, then runs every test:
#   1. promtool (Debian's `prometheus` package) and curl for the alert-rule and metrics-format checks;
#      Debian's `redis-server` for the shared tenant limits ([shared] in the policy), started
#      per test on an ephemeral loopback port by gateway/tests/shared_limits.rs;
#   2. a Python venv with the official `openai` client for the client-compatibility test;
#      NVRTC from PyPI (nvidia-cuda-nvrtc-cu12, in its own venv) and g++ for the CUDA kernel
#      checks that need no GPU (compile for sm_80/sm_90; run on the CPU through an emulator);
#   3. the default model (fetched from PyPI by kvgate itself) into the model cache:
#      $KVGATE_CACHE_DIR if set, else $XDG_CACHE_HOME/kvgate or ~/.cache/kvgate, the same place
#      `kvgate serve` looks, so the model is fetched once for tests and use alike;
#      llama.cpp's tokenizer test vocabularies and chat templates (the PyPI sdist
#      llama-cpp-python==0.3.36, unpacked once into the same cache by
#      scripts/fetch-llama-cpp-vocab.py) for tests/tokenizer_conformance.rs;
#   4. a check that no two modules of a crate import each other (scripts/check-import-cycles.py);
#      cargo tests of all crates (unit, end-to-end through the real server and model, the
#      binary as a user runs it, and README.md's examples: tests/readme.rs), then promtool
#      rule tests and the Python tests (the openai client, and README.md's Python example).
# One cargo profile (dev, optimised: see Cargo.toml) and one target/ serve every step; the
# binary it leaves at target/debug/kvgate is the one the tests checked.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

step() { printf '\n==> %s\n' "$*"; }

step "tools: promtool and curl"
if ! command -v promtool >/dev/null 2>&1 || ! command -v curl >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus curl >/dev/null
fi
promtool --version | head -n 1

step "tools: redis-server for the shared tenant limits"
if ! command -v redis-server >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
fi
redis-server --version

step "tools: python venv with the openai client"
PYENV=.cache/kvgate/pyenv
if [ ! -x "$PYENV/bin/python" ]; then
  python3 -m venv "$PYENV"
fi
"$PYENV/bin/pip" install -q --disable-pip-version-check -r tests/python/requirements.txt

step "tools: NVRTC wheel and g++ for the CUDA kernel checks (no GPU needed)"
if ! command -v g++ >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ >/dev/null
fi
NVRTC_ENV=.cache/kvgate/nvrtc
if [ ! -x "$NVRTC_ENV/bin/python" ]; then
  python3 -m venv "$NVRTC_ENV"
fi
"$NVRTC_ENV/bin/pip" install -q --disable-pip-version-check nvidia-cuda-nvrtc-cu12==12.9.86
KVGATE_NVRTC_LIB="$("$NVRTC_ENV/bin/python" -c 'import nvidia.cuda_nvrtc, os; print(os.path.join(nvidia.cuda_nvrtc.__path__[0], "lib", "libnvrtc.so.12"))')"
export KVGATE_NVRTC_LIB
echo "libnvrtc: $KVGATE_NVRTC_LIB"

step "structure: no import circles between the modules of any crate"
python3 scripts/check-import-cycles.py

step "build (dev profile, optimised)"
cargo build --workspace --all-targets

step "default model"
./target/debug/kvgate fetch-model

step "llama.cpp tokenizer vocabularies and chat templates (llama-cpp-python sdist, cached)"
python3 scripts/fetch-llama-cpp-vocab.py

step "cargo test (all crates, unit and end-to-end)"
cargo test --workspace --no-fail-fast

step "promtool: alert rules"
promtool check rules examples/prometheus/alerts.yml
promtool test rules examples/prometheus/alerts_test.yml

step "python: openai client and README example against a live server"
KVGATE_BIN=./target/debug/kvgate "$PYENV/bin/python" -m pytest -q tests/python
