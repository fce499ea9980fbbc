#!/usr/bin/env bash
# The latency *tail* of proxies in front of one fast stub, side by side (BENCHMARKS.md, "Proxy
# overhead"): p50, p90, p99 and p99.9 at a fixed rate (oha -q, latency-corrected), each minus
# the stub reached directly in the same round, rounds interleaving the targets. Where
# scripts/bench-proxy-vs-nginx.sh compares kvgate with nginx and the bare hyper proxy, this
# one takes any list of targets, so that kvgate builds, worker counts and the bare hyper proxy
# made to spend CPU per request (BARE_PROXY_SPIN_US) can be set against nginx in one run.
#
#   scripts/bench-proxy-tail.sh TARGET...        # RATE=300 DURATION=15s CONNS=32 ROUNDS=3
#
# SLICE=2s interleaves the targets finely: each round's DURATION per target is cut into slices
# of SLICE, run target after target (who goes first rotating), and each target's slices are
# pooled into one set of percentiles (oha's per-request CSV; the first SLICE_SKIP_MS=250 ms of
# each slice, when its connections are opened, left out). On a host whose noise comes in
# bursts of seconds, a burst then lands on every target alike instead of on whichever one's
# single run it fell in.
#
# Every run has `direct` (the stub) and `nginx` (Debian's, `worker_processes auto`). A TARGET:
#   NAME=hyper:WORKERS              examples/bare_proxy.rs on WORKERS worker threads
#   NAME=raw:WORKERS                examples/raw_proxy.rs (tokio, httparse, no HTTP library)
#   NAME=spin:IN:OUT                the same on 1 worker, busy-waiting IN µs before forwarding
#                                   and OUT µs after the answer's head (BARE_PROXY_SPIN_US)
#   NAME=kvgate:BINARY[:ARG,ARG..]  `BINARY serve` as scripts/bench-proxy-vs-nginx.sh runs it,
#                                   plus ARGs (commas for spaces: --http-workers,1)
# e.g.
#   cargo build --release -p kvgate --bin kvgate --example stub_upstream --example bare_proxy
#   scripts/bench-proxy-tail.sh hyp1=hyper:1 s40=spin:20:20 s80=spin:40:40 \
#     kvg1=kvgate:target/release/kvgate:--http-workers,1 kvg2=kvgate:target/release/kvgate
#
# Needs nginx, oha, curl, python3, the release stub, bare and raw proxies (BIN=target/release), and
# the default model (`kvgate fetch-model`; `serve` loads it).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n '2,22p' "$0" >&2; exit 2; }
RATE="${RATE:-300}"
DURATION="${DURATION:-15s}"
CONNS="${CONNS:-32}"
ROUNDS="${ROUNDS:-3}"
SLICE="${SLICE:-}"
SLICE_SKIP_MS="${SLICE_SKIP_MS:-250}"
BIN="${BIN:-target/release}"
STUB_PORT="${STUB_PORT:-19100}"
NGINX_PORT="${NGINX_PORT:-19101}"
FIRST_PORT="${FIRST_PORT:-19110}"
for tool in nginx oha curl python3 "$BIN/examples/stub_upstream" "$BIN/examples/bare_proxy" \
  "$BIN/examples/raw_proxy"; do
  command -v "$tool" >/dev/null || { echo "bench-proxy-tail: $tool is missing" >&2; exit 1; }
done

. scripts/bench-proxy-nginx.sh
bench_workdir bench-proxy-tail

declare -A PORT=([direct]="$STUB_PORT" [nginx]="$NGINX_PORT")
NAMES="direct nginx"
"$BIN/examples/stub_upstream" "127.0.0.1:$STUB_PORT" 1 >"$WORK/stub.log" 2>&1 &
PIDS+=($!)
start_nginx "$WORK/nginx" auto "$NGINX_PORT" "$STUB_PORT"
PIDS+=($!)

port="$FIRST_PORT"
for spec in "$@"; do
  name="${spec%%=*}" kind="${spec#*=}"
  case "$kind" in
    hyper:*)
      "$BIN/examples/bare_proxy" "127.0.0.1:$port" "127.0.0.1:$STUB_PORT" "${kind#hyper:}" \
        >"$WORK/$name.log" 2>&1 &
      ;;
    raw:*)
      "$BIN/examples/raw_proxy" "127.0.0.1:$port" "127.0.0.1:$STUB_PORT" "${kind#raw:}" \
        >"$WORK/$name.log" 2>&1 &
      ;;
    spin:*:*)
      BARE_PROXY_SPIN_US="${kind#spin:}" "$BIN/examples/bare_proxy" "127.0.0.1:$port" \
        "127.0.0.1:$STUB_PORT" 1 >"$WORK/$name.log" 2>&1 &
      ;;
    kvgate:*)
      rest="${kind#kvgate:}" binary="${rest%%:*}" args=""
      [ "$rest" != "$binary" ] && args="${rest#*:}"
      # shellcheck disable=SC2086 # ARGs split on purpose
      start_kvgate_proxy "$binary" "$port" "$STUB_PORT" "$WORK/$name.log" ${args//,/ }
      ;;
    *) echo "bench-proxy-tail: unknown target $spec" >&2; exit 2 ;;
  esac
  PIDS+=($!)
  PORT[$name]="$port"
  NAMES="$NAMES $name"
  port=$((port + 1))
done

BODY='{"model":"stub","messages":[{"role":"user","content":"Say ok."}],"max_tokens":16}'
url() { echo "http://127.0.0.1:${PORT[$1]}/v1/chat/completions"; }
for name in $NAMES; do # until each answers the request itself, at most 60 s
  for _ in $(seq 600); do
    curl -sf -o /dev/null -H 'content-type: application/json' -d "$BODY" "$(url "$name")" && continue 2
    sleep 0.1
  done
  echo "bench-proxy-tail: $name never answered; its log:" >&2
  cat "$WORK/$name.log" >&2 || true
  exit 1
done

seconds() { # 15s | 15 -> 15
  local text="${1%s}"
  [[ "$text" =~ ^[0-9]+$ ]] || { echo "bench-proxy-tail: '$1' is not whole seconds" >&2; exit 2; }
  echo "$text"
}
oha_run() { # NAME OUT [extra oha options...]: JSON unless FORMAT=csv
  local name="$1" out="$2"
  shift 2
  oha --no-tui --output-format "${FORMAT:-json}" -m POST -H 'content-type: application/json' -d "$BODY" \
    "$@" "$(url "$name")" >"$out"
}
echo "== $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, commit $(git rev-parse --short HEAD)," \
  "$RATE req/s for $DURATION over $CONNS connections, $ROUNDS rounds, load $(cut -d' ' -f1-3 /proc/loadavg)"
if [ -n "$SLICE" ]; then
  slices=$(( $(seconds "$DURATION") / $(seconds "$SLICE") ))
  [ "$slices" -ge 1 ] || { echo "bench-proxy-tail: SLICE is longer than DURATION" >&2; exit 2; }
  echo "   (interleaved: $slices slices of $SLICE per target and round, the targets' order" \
    "rotating; each slice's first ${SLICE_SKIP_MS} ms dropped)"
fi
for round in $(seq "$ROUNDS"); do
  if [ -z "$SLICE" ]; then
    for name in $NAMES; do
      oha_run "$name" /dev/null -z 2s -q "$RATE" -c "$CONNS" # warm-up
      oha_run "$name" "$WORK/$round-$name.json" -z "$DURATION" -q "$RATE" -c "$CONNS" \
        --latency-correction
    done
    continue
  fi
  for name in $NAMES; do oha_run "$name" /dev/null -z 2s -q "$RATE" -c "$CONNS"; done # warm-up
  read -ra order <<<"$NAMES"
  for slice in $(seq "$slices"); do
    for name in "${order[@]}"; do
      FORMAT=csv oha_run "$name" "$WORK/$round-$name-$slice.csv" -z "$SLICE" \
        -q "$RATE" -c "$CONNS" --latency-correction
    done
    order=("${order[@]:1}" "${order[0]}") # who goes first moves on each slice
  done
done

python3 - "$WORK" "$ROUNDS" "$SLICE_SKIP_MS" $NAMES <<'EOF'
import csv, glob, json, math, sys

work, rounds, skip, names = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) / 1e3, sys.argv[4:]
keys = ["p50", "p90", "p99", "p99.9"]

def pooled(r, name):
    """A sliced round's slices of one target as one run: the latencies of every request that
    started after its slice's first `skip` seconds (when each connection is opened), pooled,
    and the status codes of all of them; in the shape of oha's JSON."""
    files = sorted(glob.glob(f"{work}/{r}-{name}-*.csv"))
    if not files:
        return None
    times, codes = [], {}
    for path in files:
        with open(path) as f:
            for row in csv.DictReader(f):
                codes[row["status"]] = codes.get(row["status"], 0) + 1
                if float(row["request-start"]) >= skip and row["status"] == "200":
                    times.append(float(row["request-duration"]))
    times.sort()
    pick = lambda q: times[min(len(times) - 1, max(0, math.ceil(q * len(times)) - 1))]
    return {"latencyPercentiles": {k: pick(float(k[1:]) / 100) for k in keys},
            "statusCodeDistribution": codes}

def load(r, name):
    return pooled(r, name) or json.load(open(f"{work}/{r}-{name}.json"))
print("\n| round | target | " + " | ".join(f"{k} (ms)" for k in keys)
      + " | " + " | ".join(f"added {k}" for k in keys) + " | 200s / sent |")
print("|---|---|" + "---:|" * (2 * len(keys) + 1))
for r in range(1, rounds + 1):
    base = load(r, "direct")["latencyPercentiles"]
    for name in names:
        data = load(r, name)
        p = data["latencyPercentiles"]
        codes = data.get("statusCodeDistribution", {})
        errors = {e: n for e, n in data.get("errorDistribution", {}).items() if "deadline" not in e}
        sent = sum(codes.values()) + sum(errors.values())
        added = ["-"] * len(keys) if name == "direct" else \
            [f"{(p[k] - base[k]) * 1e3:+.3f}" for k in keys]
        print(f"| {r} | {name} | " + " | ".join(f"{p[k] * 1e3:.3f}" for k in keys)
              + " | " + " | ".join(added) + f" | {codes.get('200', 0)} / {sent} |")
EOF
