#!/usr/bin/env python3
"""The 48 MiB measurement of issue 16, at full size: `kvgate serve --kv-memory 48MiB` on the
default model and policy, 40 concurrent chat requests of ~700 prompt tokens x 300 max_tokens.

Reports, per outcome, how many requests got it and how long they took to be answered, and the
Retry-After values of refusals. Before issue 16, 27 of 40 waited the whole 30 s max_queue_wait
for a 503 queue_timeout; now those that cannot start in time should get 429 kv_cache_saturated
within about a second, and the rest be served.

Usage: python3 scripts/kv48-scenario.py [path/to/kvgate [--same-prompt] [SERVE-ARGS...]]
(default target/debug/kvgate; SERVE-ARGS are added to `kvgate serve`, e.g. --prefix-cache off:
all 40 requests send the same prompt, so with the cache on they share its blocks)
Needs KVGATE_CACHE_DIR (or the default cache) to hold the default model.
"""

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict

REQUESTS = 40
PROMPT = "The quick brown fox jumps over the lazy dog. " * 70  # ~700 tokens with the template
# Each request's prompt starts with its own number, so that (past the chat template's shared
# system header) no two share KV blocks: 40 different requests, as in the issue. `--same-prompt`
# sends one prompt 40 times instead (then the prefix cache shares it).
SAME_PROMPT = "--same-prompt" in sys.argv
MAX_TOKENS = 300


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def post(base, results, index):
    body = json.dumps({
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{"role": "user", "content": PROMPT if SAME_PROMPT else f"Request {index}. {PROMPT}"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }).encode()
    request = urllib.request.Request(
        base + "/v1/chat/completions", data=body, headers={"content-type": "application/json"})
    sent = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            payload = json.load(reply)
            outcome = ("200", None, payload.get("usage", {}))
    except urllib.error.HTTPError as error:
        payload = json.load(error)
        outcome = (f"{error.code} {payload['error'].get('code')}", error.headers.get("retry-after"), None)
    results[index] = (outcome, time.monotonic() - sent)


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/debug/kvgate"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [binary, "serve", "--kv-memory", "48MiB", "--listen", f"127.0.0.1:{port}",
         *[arg for arg in sys.argv[2:] if arg != "--same-prompt"]],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(base + "/readyz", timeout=1):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                # Bound but still loading (the listener is bound before the model loads).
                time.sleep(0.2)
        else:
            sys.exit("server never became ready")
        results = [None] * REQUESTS
        threads = [threading.Thread(target=post, args=(base, results, i)) for i in range(REQUESTS)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        total = time.monotonic() - started
    finally:
        server.terminate()
        server.wait(timeout=60)
    by_outcome = defaultdict(list)
    for (status, retry_after, usage), took in results:
        by_outcome[status].append((took, retry_after, usage))
    print(f"{REQUESTS} requests, all answered after {total:.1f} s")
    for status, rows in sorted(by_outcome.items()):
        times = sorted(took for took, _, _ in rows)
        line = f"{status}: {len(rows)}, answered after {times[0]:.2f}..{times[-1]:.2f} s"
        line += f" ({sum(t <= 1.0 for t in times)} within 1 s, median {times[len(times) // 2]:.2f} s)"
        retry = sorted({int(r) for _, r, _ in rows if r is not None})
        if retry:
            line += f", Retry-After {retry[0]}..{retry[-1]} s"
        used = [u.get("completion_tokens", 0) for _, _, u in rows if u]
        if used:
            line += f", completion_tokens {min(used)}..{max(used)}"
        print(line)


if __name__ == "__main__":
    main()
