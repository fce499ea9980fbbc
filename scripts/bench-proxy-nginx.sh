# Sourced by the proxy benchmarks (scripts/bench-proxy-vs-nginx.sh, scripts/bench-proxy-cpu.sh,
# scripts/bench-proxy-tail.sh).
#
# bench_workdir PREFIX makes the run's scratch folder $WORK (readable by nginx's workers) and an
# empty PIDS array; on exit every pid in PIDS is killed and $WORK removed.
bench_workdir() {
  WORK="$(mktemp -d "/tmp/$1.XXXXXX")"
  chmod 755 "$WORK" # nginx's workers run as an unprivileged user
  PIDS=()
  trap bench_cleanup EXIT
}
bench_cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}

# start_kvgate_proxy BINARY PORT STUB_PORT LOG [ARG...] starts `BINARY serve` in the background
# ($! is its pid) as every proxy benchmark runs kvgate: one anonymous tenant whose limits never
# bind (scripts/bench-proxy-policy.toml), the stub as model `stub` with a capacity no run can
# fill, no pre-drain; ARGs are added to its command line.
start_kvgate_proxy() {
  local binary="$1" port="$2" stub_port="$3" log="$4"
  shift 4
  "$binary" serve --listen "127.0.0.1:$port" --kv-memory 64MiB --pre-drain 0s \
    --policy scripts/bench-proxy-policy.toml \
    --upstream "stub=http://127.0.0.1:$stub_port,capacity=100000000" "$@" >"$log" 2>&1 &
}

# start_nginx DIR WORKERS PORT STUB_PORT writes DIR/nginx.conf — Debian's nginx as a plain
# reverse proxy, HTTP/1.1 keep-alive to the stub, access log off — and starts nginx on it in
# the background (its master's pid in DIR/nginx.pid; $! is the master). DIR must be readable
# by nginx's unprivileged worker user.
start_nginx() {
  local dir="$1" workers="$2" port="$3" stub_port="$4"
  mkdir -p "$dir"
  cat >"$dir/nginx.conf" <<EOF_NGINX
worker_processes $workers;
daemon off;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $dir/body;
  proxy_temp_path $dir/proxy;
  fastcgi_temp_path $dir/fastcgi;
  uwsgi_temp_path $dir/uwsgi;
  scgi_temp_path $dir/scgi;
  upstream stub { server 127.0.0.1:$stub_port; keepalive 128; }
  server {
    listen 127.0.0.1:$port;
    location / {
      proxy_pass http://stub;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
EOF_NGINX
  nginx -p "$dir" -c "$dir/nginx.conf" >"$dir/nginx.log" 2>&1 &
}
