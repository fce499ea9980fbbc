#!/usr/bin/env bash
# The side-by-side run behind BENCHMARKS.md's "Proxy overhead: kvgate --upstream vs nginx":
# one minimal fast upstream (examples/stub_upstream.rs, answers a small chat completion at
# once), reached three ways in one run:
#   direct  the stub itself (the baseline)
#   nginx   Debian's nginx as a plain reverse proxy in front of it (keep-alive to the stub)
#   hyper   examples/bare_proxy.rs: the floor of any proxy on kvgate's stack (tokio + hyper):
#           forwards each request as it came on a keep-alive connection of its own, nothing else
#   kvgate  `kvgate serve --upstream stub=...`: authenticates, tokenizes (tiktoken), applies
#           the policy, admits into the upstream's capacity pool, routes, relays with the
#           model renamed
# For each: latency p50/p99 at a fixed request rate (oha -q, latency-corrected), whose
# difference from `direct` in the same round is the proxy's added latency; then peak
# requests/s with a closed loop (wrk, or oha when wrk is missing). Rounds interleave the targets
# so drifting machine load hits all three alike.
#
#   scripts/bench-proxy-vs-nginx.sh            # RATE=300 DURATION=20s CONNS=32 ROUNDS=2
#   RATE=500 ROUNDS=3 PROFILE=release scripts/bench-proxy-vs-nginx.sh
#   KVGATE_BEFORE=/tmp/kvgate-old PROFILE=release scripts/bench-proxy-vs-nginx.sh
#
# KVGATE_BEFORE (optional): another kvgate binary (an older build) run as a fourth target,
# `before`, with the same policy and upstream, so a change is compared in the same rounds.
#
# Needs: nginx (apt-get install nginx-light), oha (cargo install oha), wrk (apt-get install
# wrk; optional), curl, python3, and the default model (kvgate serve loads it; `kvgate
# fetch-model`). PROFILE=dev (default) uses the workspace's dev profile, which is opt-level 3.
set -euo pipefail
cd "$(dirname "$0")/.."

RATE="${RATE:-300}"
DURATION="${DURATION:-20s}"
CONNS="${CONNS:-32}"
ROUNDS="${ROUNDS:-2}"
PEAK_DURATION="${PEAK_DURATION:-15s}"
PEAK_CONNS="${PEAK_CONNS:-64}"
PROFILE="${PROFILE:-dev}"
OHA="${OHA:-oha}"
STUB_PORT="${STUB_PORT:-19100}"
NGINX_PORT="${NGINX_PORT:-19101}"
KVGATE_PORT="${KVGATE_PORT:-19102}"
BEFORE_PORT="${BEFORE_PORT:-19103}"
HYPER_PORT="${HYPER_PORT:-19104}"
KVGATE_BEFORE="${KVGATE_BEFORE:-}"
TARGETS="direct nginx hyper kvgate"
[ -n "$KVGATE_BEFORE" ] && TARGETS="$TARGETS before"

for tool in nginx curl python3 "$OHA"; do
  command -v "$tool" >/dev/null || { echo "bench-proxy-vs-nginx: $tool is missing" >&2; exit 1; }
done
WRK="$(command -v wrk || true)"

if [ "$PROFILE" = release ]; then
  cargo build --release -q -p kvgate --bin kvgate --example stub_upstream --example bare_proxy
  BIN="${CARGO_TARGET_DIR:-./target}/release"
else
  cargo build -q -p kvgate --bin kvgate --example stub_upstream --example bare_proxy
  BIN="${CARGO_TARGET_DIR:-./target}/debug"
fi
"$BIN/kvgate" fetch-model >/dev/null

. scripts/bench-proxy-nginx.sh
bench_workdir bench-proxy

wait_for() { # URL: until it answers 2xx, at most 60 s
  for _ in $(seq 600); do
    curl -sf -o /dev/null "$1" && return 0
    sleep 0.1
  done
  echo "bench-proxy-vs-nginx: $1 never answered" >&2
  exit 1
}

# --- the stub, one worker thread: it must never be the bottleneck of a proxy run.
"$BIN/examples/stub_upstream" "127.0.0.1:$STUB_PORT" 1 >"$WORK/stub.log" 2>&1 &
PIDS+=($!)
wait_for "http://127.0.0.1:$STUB_PORT/health"

# --- nginx: a plain reverse proxy, as its docs set one up for HTTP/1.1 keep-alive upstreams.
start_nginx "$WORK/nginx" auto "$NGINX_PORT" "$STUB_PORT"
PIDS+=($!)
wait_for "http://127.0.0.1:$NGINX_PORT/health"

# --- the bare hyper proxy, with the runtime's default workers (as kvgate).
"$BIN/examples/bare_proxy" "127.0.0.1:$HYPER_PORT" "127.0.0.1:$STUB_PORT" >"$WORK/hyper.log" 2>&1 &
PIDS+=($!)
wait_for "http://127.0.0.1:$HYPER_PORT/health"

# --- kvgate (start_kvgate_proxy). The `before` build, when given, the same.
start_kvgate() { # NAME BINARY PORT
  start_kvgate_proxy "$2" "$3" "$STUB_PORT" "$WORK/$1.log"
  PIDS+=($!)
  wait_for "http://127.0.0.1:$3/healthz"
}
start_kvgate kvgate "$BIN/kvgate" "$KVGATE_PORT"
[ -n "$KVGATE_BEFORE" ] && start_kvgate before "$KVGATE_BEFORE" "$BEFORE_PORT"

BODY='{"model":"stub","messages":[{"role":"user","content":"Say ok."}],"max_tokens":16}'
url() {
  case "$1" in
    direct) echo "http://127.0.0.1:$STUB_PORT/v1/chat/completions" ;;
    nginx) echo "http://127.0.0.1:$NGINX_PORT/v1/chat/completions" ;;
    hyper) echo "http://127.0.0.1:$HYPER_PORT/v1/chat/completions" ;;
    kvgate) echo "http://127.0.0.1:$KVGATE_PORT/v1/chat/completions" ;;
    before) echo "http://127.0.0.1:$BEFORE_PORT/v1/chat/completions" ;;
  esac
}
for target in $TARGETS; do
  status="$(curl -s -o "$WORK/check.json" -w '%{http_code}' -H 'content-type: application/json' \
    -d "$BODY" "$(url "$target")")"
  [ "$status" = 200 ] || { echo "$target answered $status: $(cat "$WORK/check.json")" >&2; exit 1; }
done

oha_run() { # TARGET OUT [extra oha options...]
  local target="$1" out="$2"
  shift 2
  "$OHA" --no-tui --output-format json -m POST -H 'content-type: application/json' -d "$BODY" \
    "$@" "$(url "$target")" >"$out"
}

echo "== $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, commit $(git rev-parse --short HEAD)," \
  "profile $PROFILE, load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== fixed rate: $RATE req/s for $DURATION over $CONNS connections, $ROUNDS rounds"
for round in $(seq "$ROUNDS"); do
  for target in $TARGETS; do
    oha_run "$target" /dev/null -z 2s -q "$RATE" -c "$CONNS" # warm-up: connections, caches
    oha_run "$target" "$WORK/fixed-$round-$target.json" -z "$DURATION" -q "$RATE" -c "$CONNS" \
      --latency-correction
  done
  echo "   round $round done, load: $(cut -d' ' -f1-3 /proc/loadavg)"
done

echo "== peak: closed loop, $PEAK_CONNS connections for $PEAK_DURATION ($([ -n "$WRK" ] && echo wrk || echo oha))"
cat >"$WORK/post.lua" <<EOF
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.body = '$BODY'
EOF
for target in $TARGETS; do
  if [ -n "$WRK" ]; then
    "$WRK" -t 2 -c "$PEAK_CONNS" -d "$PEAK_DURATION" -s "$WORK/post.lua" "$(url "$target")" \
      >"$WORK/peak-$target.txt"
  else
    oha_run "$target" "$WORK/peak-$target.json" -z "$PEAK_DURATION" -c "$PEAK_CONNS"
  fi
done
echo "== load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$WORK" "$ROUNDS" $TARGETS <<'EOF'
import json, re, sys
from pathlib import Path

work, rounds = Path(sys.argv[1]), int(sys.argv[2])
targets = sys.argv[3:]

def fixed(round_, target):
    data = json.loads((work / f"fixed-{round_}-{target}.json").read_text())
    pct = data["latencyPercentiles"]
    codes = data.get("statusCodeDistribution", {})
    ok = codes.get("200", 0)
    # Requests still open when -z ran out are cut by oha itself, not failed by the target.
    errors = {e: n for e, n in data.get("errorDistribution", {}).items() if "deadline" not in e}
    total = sum(codes.values()) + sum(errors.values())
    return pct["p50"] * 1e3, pct["p99"] * 1e3, data["summary"]["requestsPerSec"], ok, total

def peak(target):
    wrk = work / f"peak-{target}.txt"
    if wrk.exists():
        text = wrk.read_text()
        rate = float(re.search(r"Requests/sec:\s*([\d.]+)", text).group(1))
        bad = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", text)
        return rate, int(bad.group(1)) if bad else 0
    data = json.loads((work / f"peak-{target}.json").read_text())
    codes = data.get("statusCodeDistribution", {})
    return data["summary"]["requestsPerSec"], sum(n for c, n in codes.items() if c != "200")

print("\n| round | target | p50 (ms) | p99 (ms) | added p50 (ms) | added p99 (ms) | achieved req/s | 200s / sent |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for round_ in range(1, rounds + 1):
    base = fixed(round_, "direct")
    for target in targets:
        p50, p99, rps, ok, total = fixed(round_, target)
        added = ("-", "-") if target == "direct" else (f"{p50 - base[0]:+.3f}", f"{p99 - base[1]:+.3f}")
        print(f"| {round_} | {target} | {p50:.3f} | {p99:.3f} | {added[0]} | {added[1]} | {rps:.0f} | {ok} / {total} |")
print("\n| target | peak req/s | non-200 answers |")
print("|---|---:|---:|")
for target in targets:
    rate, bad = peak(target)
    print(f"| {target} | {rate:.0f} | {bad} |")
EOF
