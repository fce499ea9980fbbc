#!/usr/bin/env bash
# Lints a running kvgate's /metrics with `promtool check metrics`.
#
#   scripts/check-metrics.sh [URL]        (default http://127.0.0.1:8080)
#
# The only lines removed before linting are the vLLM-compatibility families
# (`--metrics-compat vllm`): their names contain ':' on purpose, to match what vLLM exports
# and routers scrape, and promtool reserves ':' for recording rules. Every kvgate_* family is
# linted as served. Exits non-zero on a failed scrape, a parse error or any lint problem.
set -euo pipefail

url="${1:-http://127.0.0.1:8080}"
url="${url%/}"

if ! command -v promtool >/dev/null 2>&1; then
  echo "check-metrics: promtool not found (Debian/Ubuntu: apt-get install prometheus)" >&2
  exit 2
fi
if ! command -v curl >/dev/null 2>&1; then
  echo "check-metrics: curl not found" >&2
  exit 2
fi

scrape="$(mktemp)"
trap 'rm -f "$scrape"' EXIT
if ! curl --fail --silent --show-error --max-time 10 "$url/metrics" -o "$scrape"; then
  echo "check-metrics: cannot scrape $url/metrics" >&2
  exit 1
fi

# Sample lines start with the name; HELP/TYPE lines name it after the keyword.
compat_lines="$(grep -c -E '^(# (HELP|TYPE) )?vllm:' "$scrape" || true)"
families="$(grep -c '^# TYPE ' "$scrape" || true)"

# promtool prints nothing and exits 0 when the exposition is clean.
if grep -v -E '^(# (HELP|TYPE) )?vllm:' "$scrape" | promtool check metrics; then
  echo "check-metrics: $url/metrics OK ($families families; $compat_lines vllm: compat lines not linted)"
else
  status=$?
  echo "check-metrics: promtool found problems in $url/metrics (exit $status)" >&2
  exit "$status"
fi
