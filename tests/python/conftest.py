"""Starts a real `kvgate serve` (the default model, a test policy) for the openai-client tests.

The binary comes from $KVGATE_BIN (default: target/debug/kvgate under the repository root);
`running_kvgate` also serves test_readme.py.
The server is stopped with SIGTERM at the end and must exit 0: a graceful drain.
"""

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
KEYS = {"main": "sk-py-main", "solo": "sk-py-solo"}


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


POLICY = f"""
[defaults]
max_input_tokens = 1024
max_output_tokens = 256
max_total_tokens = 1536
max_concurrency = 8
queue_depth = 16
max_queue_wait = "60s"

[tenants.main]
key_sha256 = ["{_digest(KEYS['main'])}"]

# One request running and one queued at a time: a third concurrent request gets 429 + Retry-After.
[tenants.solo]
key_sha256 = ["{_digest(KEYS['solo'])}"]
max_concurrency = 1
queue_depth = 1
max_queue_wait = "120s"
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(base: str, process: subprocess.Popen, limit_s: float = 300.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvgate exited early with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("kvgate did not become ready")


def _served_model(base: str) -> str:
    request = urllib.request.Request(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEYS['main']}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.load(reply)["data"][0]["id"]


@contextlib.contextmanager
def running_kvgate(args, cwd):
    """`kvgate serve --listen 127.0.0.1:PORT ARGS` in `cwd` until the block ends; yields its base
    URL. The server must then exit 0 on SIGTERM (a graceful drain)."""
    binary = os.path.abspath(os.environ.get("KVGATE_BIN", os.path.join(ROOT, "target", "debug", "kvgate")))
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([binary, "serve", "--listen", f"127.0.0.1:{port}", *args], cwd=cwd)
    try:
        _wait_ready(base, process)
        yield base
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        assert code == 0, f"kvgate must exit 0 after SIGTERM, got {code}"


@pytest.fixture(scope="session")
def server():
    policy = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    policy.write(POLICY)
    policy.close()
    try:
        with running_kvgate(["--policy", policy.name, "--kv-memory", "64MiB"], ROOT) as base:
            yield {"base_url": f"{base}/v1", "keys": KEYS, "model": _served_model(base)}
    finally:
        os.unlink(policy.name)
