#!/usr/bin/env bash
# CPU per relayed request of two kvgate builds in upstream mode, side by side in one run (the
# A/B behind BENCHMARKS.md's proxy CPU figures): both gateways front the same stub
# (examples/stub_upstream.rs) with the policy of scripts/bench-proxy-vs-nginx.sh
# (scripts/bench-proxy-policy.toml); rounds
# alternate which goes first. Per round and build:
#   c=1   one connection for 4 s (wrk -t1 -c1): p50, and the gateway process's user and system
#         CPU per request (utime/stime from /proc/PID/stat over the run, divided by requests);
#   peak  64 connections for 10 s (wrk -t2 -c64): requests/s, CPU per request, and context
#         switches per request (all of the gateway's threads).
#   rate  with RATE=N: N requests/s over 32 connections for 8 s (oha -q N, latency-corrected):
#         on-CPU time per request of all the process's threads (/proc/PID/task/*/schedstat),
#         and p50/p99. At a fixed rate below the peak each request finds the caches cold, as
#         in scripts/bench-proxy-tail.sh: the CPU a request costs there, not back to back.
# Everything shares the machine's cores: at peak the gateway, wrk and the stub compete for
# them, so requests/s also depends on how the scheduler shares the cores out.
#
#   scripts/bench-proxy-cpu.sh NEW_KVGATE OLD_KVGATE      # ROUNDS=4 by default
#   FLOOR=1 scripts/bench-proxy-cpu.sh NEW_KVGATE OLD_KVGATE
#   RATE=300 KVGATE_ARGS="--http-workers 1" scripts/bench-proxy-cpu.sh NEW_KVGATE OLD_KVGATE
#
# FLOOR=1 measures three more targets in the same rounds, the floor under a gateway's cost:
#   nginx  Debian's nginx with one worker process as a plain keep-alive reverse proxy
#   hyp1   examples/bare_proxy.rs (tokio + hyper, forwarding only) on one worker thread
#   hyp2   the same on the runtime's default worker threads (one per core, as kvgate)
#
# KVGATE_ARGS: more `serve` options for both builds. Needs wrk (apt-get install wrk), oha for
# RATE (cargo install oha), curl, the stub (cargo build --example stub_upstream; STUB=
# to use another build) and the default model (`kvgate fetch-model`).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: $0 NEW_KVGATE OLD_KVGATE" >&2; exit 2; }
NEW="$1" OLD="$2"
ROUNDS="${ROUNDS:-4}"
STUB="${STUB:-./target/debug/examples/stub_upstream}"
BARE="${BARE:-$(dirname "$STUB")/bare_proxy}"
FLOOR="${FLOOR:-0}"
RATE="${RATE:-}"
KVGATE_ARGS="${KVGATE_ARGS:-}"
[ -z "$RATE" ] || command -v oha >/dev/null || { echo "bench-proxy-cpu: oha is missing (RATE)" >&2; exit 1; }
for tool in wrk curl "$NEW" "$OLD" "$STUB"; do
  command -v "$tool" >/dev/null || { echo "bench-proxy-cpu: $tool is missing" >&2; exit 1; }
done

WORK="$(mktemp -d /tmp/bench-proxy-cpu.XXXXXX)"
cleanup() {
  kill $(jobs -p) 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

. scripts/bench-proxy-nginx.sh
"$STUB" 127.0.0.1:19100 1 >"$WORK/stub.log" 2>&1 &
start() { # NAME BINARY PORT
  # shellcheck disable=SC2086 # options split on purpose
  start_kvgate_proxy "$2" "$3" 19100 "$WORK/$1.log" $KVGATE_ARGS
  echo $! >"$WORK/$1.pid"
}
start new "$NEW" 19102
start old "$OLD" 19103
NAMES="new old"
URLS="http://127.0.0.1:19100/health http://127.0.0.1:19102/healthz http://127.0.0.1:19103/healthz"
if [ "$FLOOR" = 1 ]; then
  for tool in nginx "$BARE"; do
    command -v "$tool" >/dev/null || { echo "bench-proxy-cpu: $tool is missing (FLOOR=1)" >&2; exit 1; }
  done
  chmod 755 "$WORK" # nginx's worker runs as an unprivileged user
  start_nginx "$WORK/nginx" 1 19104 19100
  "$BARE" 127.0.0.1:19105 127.0.0.1:19100 1 >"$WORK/hyp1.log" 2>&1 &
  echo $! >"$WORK/hyp1.pid"
  "$BARE" 127.0.0.1:19106 127.0.0.1:19100 >"$WORK/hyp2.log" 2>&1 &
  echo $! >"$WORK/hyp2.pid"
  NAMES="$NAMES nginx hyp1 hyp2"
  URLS="$URLS http://127.0.0.1:19104/health http://127.0.0.1:19105/health http://127.0.0.1:19106/health"
fi
for url in $URLS; do
  for _ in $(seq 600); do curl -sf -o /dev/null "$url" && break; sleep 0.1; done
  curl -sf -o /dev/null "$url" || { echo "bench-proxy-cpu: $url never answered" >&2; exit 1; }
done

BODY='{"model":"stub","messages":[{"role":"user","content":"Say ok."}],"max_tokens":16}'
cat >"$WORK/post.lua" <<EOF_LUA
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.body = '$BODY'
EOF_LUA
port() {
  case "$1" in new) echo 19102 ;; old) echo 19103 ;; nginx) echo 19104 ;; hyp1) echo 19105 ;; hyp2) echo 19106 ;; esac
}
pid_of() { # NAME: the process measured (for nginx its worker, not the master)
  if [ "$1" = nginx ]; then
    pgrep -P "$(cat "$WORK/nginx/nginx.pid")" | head -1
  else
    cat "$WORK/$1.pid"
  fi
}
on_cpu_ns() { cat /proc/"$1"/task/*/schedstat | awk '{s += $1} END {printf "%.0f", s}'; }
cpu() { awk '{u += $14; s += $15} END {print u, s}' "/proc/$1/stat"; }
switches() { cat /proc/"$1"/task/*/status | awk '/^voluntary_ctxt/ {v += $2} /^nonvoluntary_ctxt/ {n += $2} END {print v, n}'; }
TICK_US=$((1000000 / $(getconf CLK_TCK)))
measure() { # NAME CONNS THREADS SECONDS
  local name=$1 pid
  pid="$(pid_of "$name")"
  read -r u0 s0 < <(cpu "$pid")
  read -r v0 n0 < <(switches "$pid")
  wrk -t"$3" -c"$2" -d"$4"s -s "$WORK/post.lua" --latency \
    "http://127.0.0.1:$(port "$name")/v1/chat/completions" >"$WORK/wrk.txt"
  read -r u1 s1 < <(cpu "$pid")
  read -r v1 n1 < <(switches "$pid")
  local n
  n="$(awk '/requests in/ {print $1}' "$WORK/wrk.txt")"
  grep -q "Non-2xx" "$WORK/wrk.txt" && { echo "bench-proxy-cpu: $name answered non-2xx" >&2; exit 1; }
  printf '%-4s c=%-3s %9s req/s  p50 %-9s user %4d us  sys %4d us  switches/request %s + %s\n' \
    "$name" "$2" "$(awk '/Requests\/sec/ {print $2}' "$WORK/wrk.txt")" \
    "$(awk '/ 50%/ {print $2}' "$WORK/wrk.txt")" $(((u1 - u0) * TICK_US / n)) \
    $(((s1 - s0) * TICK_US / n)) \
    "$(awk -v a="$v0" -v b="$v1" -v n="$n" 'BEGIN {printf "%.2f", (b - a) / n}')" \
    "$(awk -v a="$n0" -v b="$n1" -v n="$n" 'BEGIN {printf "%.2f", (b - a) / n}')"
}

measure_rate() { # NAME: RATE req/s for 8 s; on-CPU µs per request of all threads, p50, p99
  local name=$1 pid
  pid="$(pid_of "$name")"
  local url="http://127.0.0.1:$(port "$name")/v1/chat/completions"
  oha --no-tui -z 2s -q "$RATE" -c 32 -m POST -H 'content-type: application/json' -d "$BODY" \
    "$url" >/dev/null # warm-up
  local t0 t1
  t0="$(on_cpu_ns "$pid")"
  oha --no-tui --output-format json -z 8s -q "$RATE" -c 32 --latency-correction -m POST \
    -H 'content-type: application/json' -d "$BODY" "$url" >"$WORK/oha.json"
  t1="$(on_cpu_ns "$pid")"
  python3 - "$name" "$t0" "$t1" "$WORK/oha.json" "$RATE" <<'EOF_PY'
import json, sys
name, t0, t1, path, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
data = json.load(open(path))
ok = data["statusCodeDistribution"].get("200", 0)
sent = sum(data["statusCodeDistribution"].values())
if ok != sent or ok == 0:
    sys.exit(f"bench-proxy-cpu: {name} answered {ok} of {sent} with 200")
p = data["latencyPercentiles"]
print(f"{name:<4} q={rate:<4} on-CPU {(t1 - t0) / ok / 1000:6.1f} us/request  "
      f"p50 {p['p50'] * 1e3:.3f} ms  p99 {p['p99'] * 1e3:.3f} ms")
EOF_PY
}

echo "== $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, new=$NEW old=$OLD, load $(cut -d' ' -f1-3 /proc/loadavg)"
for name in $NAMES; do measure "$name" 1 1 2 >/dev/null; done # warm-up
for round in $(seq "$ROUNDS"); do
  order="$NAMES"
  [ $((round % 2)) = 0 ] && order="$(echo "$NAMES" | tr ' ' '\n' | tac | tr '\n' ' ')"
  for name in $order; do measure "$name" 1 1 4; done
  for name in $order; do measure "$name" 64 2 10; done
  if [ -n "$RATE" ]; then
    for name in $order; do measure_rate "$name"; done
  fi
done
echo "== load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
