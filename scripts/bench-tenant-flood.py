#!/usr/bin/env python3
"""Tenant isolation benchmark: one tenant floods the engine with long prompts, another sends
short chats one after another; how long do the short chats take, and what does the flood get?

Runs the real server (`kvgate serve --policy policies/multi-tenant.toml`) once per scheduling
mode, side by side in one invocation:

  * ``new``: the defaults (step-time target, tenant-fair prefill);
  * ``old``: ``--target-itl off --prefill-order fcfs``, the scheduling before them.

Per mode: tenant beta sends ``--alone`` short chats (~40 prompt tokens, max_tokens 8) one
after another on an idle server; then tenant alpha starts ``--clients`` concurrent clients,
each sending ~420-token prompts (max_tokens 32) back to back, and after ``--warmup`` seconds
beta sends its chats again for ``--window`` seconds. Printed: beta's p50/p99 latency alone and
under the flood, and alpha's prompt and generated tokens/s over the same window (tokens of the
alpha requests that completed in it, from the responses' ``usage``), plus the engine's mean
step time in the window from ``/metrics``.

Standard library only. Example (about 4 minutes; one run varies by ±15% on a small VM, so
claims come from `--repeat N` and the means it prints):

    cargo build --release
    python3 scripts/bench-tenant-flood.py --kvgate target/release/kvgate -- --threads 2
"""

import argparse
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

ALPHA_KEY = "sk-demo-alpha"
BETA_KEY = "sk-demo-beta"
MODES = {
    "new": [],
    "old": ["--target-itl", "off", "--prefill-order", "fcfs"],
}
WORDS = (
    "river stone market lantern orbit velvet harbor cipher meadow signal copper "
    "garden thunder pixel canyon ember quartz willow beacon fabric glacier"
).split()


def mode_flags(mode):
    """Flags for a mode: a name in MODES, or ``itl<ms>`` (the new scheduling at that target)."""
    if mode in MODES:
        return MODES[mode]
    if mode.startswith("itl") and mode[3:].isdigit() and int(mode[3:]) > 0:
        return ["--target-itl", f"{int(mode[3:])}ms"]
    return None


def percentile(values, q):
    """Nearest-rank percentile of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


class Server:
    """`kvgate serve` on an ephemeral port; the port is read from its `kvgate ready` log line."""

    def __init__(self, binary, policy, extra):
        cmd = [binary, "serve", "--policy", policy, "--listen", "127.0.0.1:0",
               "--log-format", "json", *extra]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True)
        self.port = None
        deadline = time.time() + 300
        for line in self.proc.stderr:
            found = re.search(r"127\.0\.0\.1:(\d+)", line)
            if "kvgate ready" in line and found:
                self.port = int(found.group(1))
                break
            if time.time() > deadline:
                break
        if self.port is None:
            self.stop()
            sys.exit(f"kvgate serve did not start: {' '.join(cmd)}")
        # Keep draining its log so it never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()

    def get(self, path, key=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            conn.request("GET", path, headers=headers)
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Client:
    """One keep-alive connection sending chat completions."""

    model = None  # the embedded model's id, read from /v1/models once the server is up

    def __init__(self, port, key):
        self.port, self.key, self.conn = port, key, None

    def chat(self, content, max_tokens):
        """(status, seconds, usage, retry_after) of one non-streamed chat completion."""
        body = json.dumps({
            "model": Client.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
        })
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        started = time.monotonic()
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
            self.conn.request("POST", "/v1/chat/completions", body, headers)
            response = self.conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException):
            self.conn = None
            return None, time.monotonic() - started, None, None
        elapsed = time.monotonic() - started
        usage = None
        if response.status == 200:
            usage = json.loads(payload).get("usage")
        return response.status, elapsed, usage, response.getheader("retry-after")


def text(words, seed):
    """`words` words of filler drawn from `seed`; a short random tag first, so no two prompts
    share a prefix (and a cache of prefixes could not shortcut the prefill)."""
    rng = random.Random(seed)
    tag = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(4))
    return f"{tag}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def calibrate(port, key, target):
    """Words of filler that make a chat prompt of about `target` tokens (the chat template's
    own tokens included), from two probes."""
    client = Client(port, key)
    counts = []
    for words in (5, 200):
        status, _, usage, _ = client.chat(text(words, f"probe-{words}"), 1)
        if status != 200:
            sys.exit(f"calibration request failed with HTTP {status}")
        counts.append(usage["prompt_tokens"])
    per_word = (counts[1] - counts[0]) / 195
    return max(1, round(5 + (target - counts[0]) / per_word))


def beta_run(port, words, stop_at=None, count=None):
    """Sequential beta chats until `stop_at` (monotonic) or `count` requests: latencies."""
    client = Client(port, BETA_KEY)
    latencies, rejected, failed, prompt_tokens, computed = [], 0, 0, [], 0
    n = 0
    while (count is not None and n < count) or (stop_at is not None and time.monotonic() < stop_at):
        n += 1
        status, elapsed, usage, retry_after = client.chat(text(words, f"beta-{n}-{time.time()}"), 8)
        if status == 200:
            latencies.append(elapsed)
            prompt_tokens.append(usage["prompt_tokens"])
            # Tokens the engine computed for it: the prompt, then one per generated token but
            # the last (sampled from the step that computed the one before).
            computed += usage["prompt_tokens"] + max(0, usage["completion_tokens"] - 1)
        elif status == 429:
            rejected += 1
            time.sleep(float(retry_after or 1))
        else:
            failed += 1
            time.sleep(0.5)
    return latencies, rejected, failed, prompt_tokens, computed


def metric_sum(scrape, name, label=None):
    """Sum of a series' samples, optionally only those carrying `label` (e.g. 'tenant="beta"')."""
    total = 0.0
    for line in scrape.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if label is None or label in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def metric_mean(before, after, name, label=None):
    """Mean of a histogram over the window between two scrapes (None when nothing was observed)."""
    total = metric_sum(after, name + "_sum", label) - metric_sum(before, name + "_sum", label)
    count = metric_sum(after, name + "_count", label) - metric_sum(before, name + "_count", label)
    return total / count if count else None


def run_mode(args, mode, words):
    server = Server(args.kvgate, args.policy, mode_flags(mode) + args.serve_args)
    try:
        port = server.port
        Client.model = json.loads(server.get("/v1/models", ALPHA_KEY))["data"][0]["id"]
        if words is None:
            words = (calibrate(port, ALPHA_KEY, 420), calibrate(port, BETA_KEY, 40))
        alpha_words, beta_words = words
        beta_run(port, beta_words, count=2)  # warm-up
        alone, _, _, beta_prompt, _ = beta_run(port, beta_words, count=args.alone)

        stop = threading.Event()
        completed = []  # (finished_at, prompt_tokens, completion_tokens)
        errors = []
        lock = threading.Lock()

        def alpha_client(i):
            client = Client(port, ALPHA_KEY)
            n = 0
            while not stop.is_set():
                n += 1
                status, _, usage, retry_after = client.chat(
                    text(alpha_words, f"alpha-{i}-{n}-{time.time()}"), 32)
                now = time.monotonic()
                with lock:
                    if status == 200:
                        completed.append((now, usage["prompt_tokens"], usage["completion_tokens"]))
                    elif not stop.is_set():
                        errors.append(status)
                if status != 200 and not stop.is_set():
                    time.sleep(float(retry_after or 0.5))

        threads = [threading.Thread(target=alpha_client, args=(i,), daemon=True)
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(args.warmup)
        before = server.get("/metrics")
        t0 = time.monotonic()
        flood, rejected, failed, _, beta_computed = beta_run(port, beta_words,
                                                             stop_at=t0 + args.window)
        t1 = time.monotonic()
        after = server.get("/metrics")
        stop.set()
        with lock:
            window = [(p, c) for at, p, c in completed if t0 <= at <= t1]
            alpha_errors = list(errors)
        step_sum = (metric_sum(after, "kvgate_engine_step_duration_seconds_sum")
                    - metric_sum(before, "kvgate_engine_step_duration_seconds_sum"))
        step_count = (metric_sum(after, "kvgate_engine_step_duration_seconds_count")
                      - metric_sum(before, "kvgate_engine_step_duration_seconds_count"))
        span = t1 - t0
        # Everything the engine computed in the window (prompt chunks and decodes, finished
        # requests or not) less beta's share: alpha's throughput without the quantization of
        # counting only the requests that completed in the window.
        batch_tokens = (metric_sum(after, "kvgate_batch_tokens_sum")
                        - metric_sum(before, "kvgate_batch_tokens_sum"))
        preemptions = (metric_sum(after, "kvgate_preemptions_total")
                       - metric_sum(before, "kvgate_preemptions_total"))
        result = {
            "mode": mode,
            "flags": " ".join(mode_flags(mode) + args.serve_args),
            "beta_prompt_tokens": round(sum(beta_prompt) / max(1, len(beta_prompt)), 1),
            "alpha_prompt_tokens": round(sum(p for p, _ in window) / max(1, len(window)), 1),
            "beta_alone_p50_s": percentile(alone, 50),
            "beta_alone_p99_s": percentile(alone, 99),
            "beta_flood_p50_s": percentile(flood, 50) if flood else None,
            "beta_flood_p99_s": percentile(flood, 99) if flood else None,
            "beta_flood_requests": len(flood),
            "beta_flood_latencies": flood,
            "beta_rejected": rejected,
            "beta_failed": failed,
            "alpha_requests": len(window),
            "alpha_errors": len(alpha_errors),
            "alpha_prompt_tok_s": sum(p for p, _ in window) / span,
            "alpha_generated_tok_s": sum(c for _, c in window) / span,
            "window_s": span,
            "mean_step_ms": 1e3 * step_sum / step_count if step_count else None,
            "mean_step_tokens": batch_tokens / step_count if step_count else None,
            "alpha_engine_tok_s": max(0.0, batch_tokens - beta_computed) / span,
            "preemptions": preemptions,
        }
        # Where beta's time goes under the flood: until its first token, then per token.
        for key, name in (("beta_mean_ttft_ms", "kvgate_time_to_first_token_seconds"),
                          ("beta_mean_itl_ms", "kvgate_inter_token_latency_seconds")):
            mean = metric_mean(before, after, name, 'tenant="beta"')
            result[key] = 1e3 * mean if mean is not None else None
        return result, words
    finally:
        server.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kvgate", default=os.environ.get("KVGATE_BIN", "target/release/kvgate"))
    parser.add_argument("--policy", default="policies/multi-tenant.toml")
    parser.add_argument("--modes", default="new,old", help="comma-separated: new, old, itl<ms> (new at that --target-itl)")
    parser.add_argument("--clients", type=int, default=24, help="alpha's concurrent clients")
    parser.add_argument("--alone", type=int, default=20, help="beta requests on an idle server")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of flood before timing")
    parser.add_argument("--window", type=float, default=60.0, help="seconds of timed flood")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of all modes, the order reversed every other round (one run "
                             "varies by ±15%% on a small VM: compare the means)")
    parser.add_argument("--json", action="store_true", help="one JSON object per mode and round")
    parser.add_argument("serve_args", nargs="*", help="extra `kvgate serve` flags (after --)")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if mode_flags(m) is None]
    if unknown:
        sys.exit(f"unknown mode(s) {unknown}: use {', '.join(MODES)} or itl<ms>")
    if args.repeat < 1:
        sys.exit("--repeat must be at least 1")
    if not os.access(args.kvgate, os.X_OK):
        sys.exit(f"{args.kvgate} is not an executable; build kvgate or pass --kvgate")

    results, words = [], None
    for round_no in range(args.repeat):
        for mode in (modes if round_no % 2 == 0 else modes[::-1]):
            result, words = run_mode(args, mode, words)
            result["round"] = round_no + 1
            results.append(result)
            if args.json:
                print(json.dumps({k: v for k, v in result.items() if k != "beta_flood_latencies"}),
                      flush=True)
    if args.json:
        return

    def s(v):
        return "-" if v is None else f"{v:.2f}"

    print(f"alpha: {args.clients} clients, ~{results[0]['alpha_prompt_tokens']:.0f}-token prompts, "
          f"max_tokens 32; beta: ~{results[0]['beta_prompt_tokens']:.0f}-token chats, max_tokens 8, "
          f"one after another; {args.window:.0f} s window after {args.warmup:.0f} s of flood")
    print(f"{'run':>3} {'mode':<5} {'beta alone p50/p99 s':>21} {'beta flood p50/p99 s':>21} {'n':>4} "
          f"{'alpha prompt tok/s':>19} {'alpha gen tok/s':>16} {'alpha reqs':>10} "
          f"{'alpha engine tok/s':>18} {'step ms':>8} {'step tok':>8} "
          f"{'beta ttft/itl ms':>17}  flags")
    for r in results:
        print(f"{r['round']:>3} {r['mode']:<5} "
              f"{s(r['beta_alone_p50_s']) + ' / ' + s(r['beta_alone_p99_s']):>21} "
              f"{s(r['beta_flood_p50_s']) + ' / ' + s(r['beta_flood_p99_s']):>21} "
              f"{r['beta_flood_requests']:>4} {r['alpha_prompt_tok_s']:>19.1f} "
              f"{r['alpha_generated_tok_s']:>16.1f} {r['alpha_requests']:>10} "
              f"{r['alpha_engine_tok_s']:>18.1f} {s(r['mean_step_ms']):>8} "
              f"{s(r['mean_step_tokens']):>8} "
              f"{s(r['beta_mean_ttft_ms']) + ' / ' + s(r['beta_mean_itl_ms']):>17}  "
              f"{r['flags'] or '(defaults)'}")
        if r["preemptions"]:
            print(f"      preemptions in the window: {r['preemptions']:.0f}")
        if r["beta_rejected"] or r["beta_failed"] or r["alpha_errors"]:
            print(f"      beta 429s {r['beta_rejected']}, beta failures {r['beta_failed']}, "
                  f"alpha non-200s {r['alpha_errors']}")
    if "old" not in modes:
        return
    for mode in modes:
        if mode == "old":
            continue
        ratios = []
        for round_no in range(1, args.repeat + 1):
            pair = {r["mode"]: r for r in results if r["round"] == round_no}
            old, new = pair["old"], pair[mode]
            if old["alpha_prompt_tok_s"] > 0:
                ratios.append(new["alpha_prompt_tok_s"] / old["alpha_prompt_tok_s"])
                print(f"run {round_no}: alpha prompt tok/s {mode}/old: {ratios[-1]:.3f}; generated: "
                      f"{new['alpha_generated_tok_s'] / max(old['alpha_generated_tok_s'], 1e-9):.3f}")
        if args.repeat > 1:
            mean = lambda key, m: sum(r[key] for r in results if r["mode"] == m) / args.repeat  # noqa: E731
            flood = [x for r in results if r["mode"] == mode for x in r["beta_flood_latencies"]]
            pooled = (f"beta flood p50/p99 over all runs {percentile(flood, 50):.2f} / "
                      f"{percentile(flood, 99):.2f} s ({len(flood)} requests); " if flood else "")
            print(f"{mode}: {pooled}alpha prompt tok/s mean {mean('alpha_prompt_tok_s', mode):.1f} "
                  f"vs old {mean('alpha_prompt_tok_s', 'old'):.1f}: ratio of means "
                  f"{mean('alpha_prompt_tok_s', mode) / max(mean('alpha_prompt_tok_s', 'old'), 1e-9):.3f}"
                  + (f", per-run ratios {min(ratios):.3f}..{max(ratios):.3f}" if ratios else ""))


if __name__ == "__main__":
    main()
