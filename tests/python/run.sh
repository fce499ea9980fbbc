#!/usr/bin/env bash
# Runs the openai-client tests against a freshly built kvgate: builds the binary, makes a venv
# with the official `openai` package, fetches the default model if missing, then pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYENV=.cache/kvgate/pyenv
cargo build -p kvgate
./target/debug/kvgate fetch-model >/dev/null
if [ ! -x "$PYENV/bin/python" ]; then
  python3 -m venv "$PYENV"
fi
"$PYENV/bin/pip" install -q --disable-pip-version-check -r tests/python/requirements.txt
KVGATE_BIN=./target/debug/kvgate "$PYENV/bin/python" -m pytest -q tests/python "$@"
