"""README.md's Python example, run as written there against `kvgate serve` with no flags but
the port: the built-in default policy, started from a directory that is not the checkout. The
block is read from the README itself, so the README cannot drift from what works."""

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from conftest import ROOT, running_kvgate

README_BASE_URL = "http://127.0.0.1:8080/v1"


def _readme_python_block() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as readme:
        text = readme.read()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) == 1, f"README.md must have exactly one python block, found {len(blocks)}"
    assert README_BASE_URL in blocks[0], "the example must point at the README's server address"
    return blocks[0]


@pytest.fixture(scope="module")
def default_server():
    """`kvgate serve` with no flags but the port, run from an empty directory."""
    with tempfile.TemporaryDirectory() as home, running_kvgate([], home) as base:
        yield f"{base}/v1"


# Runs before the README block, unchanged: records what the example prints, so the answer and
# the stream are checked separately (the answer itself may span lines).
OBSERVER = """
import atexit as _atexit, builtins as _builtins, json as _json, sys as _sys
_calls = []
def print(*args, **kwargs):
    _calls.append({"text": " ".join(map(str, args)), "end": kwargs.get("end", "\\n")})
    _builtins.print(*args, **kwargs)
_atexit.register(lambda: _sys.stderr.write("\\nPRINTS=" + _json.dumps(_calls) + "\\n"))
"""


def test_readme_python_example_prints_an_answer_and_a_stream(default_server):
    script = OBSERVER + _readme_python_block().replace(README_BASE_URL, default_server)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    calls = json.loads(done.stderr.rsplit("PRINTS=", 1)[1])
    answer, stream = calls[0], calls[1:]
    assert answer["end"] == "\n" and answer["text"].strip(), f"the chat answer is printed: {calls}"
    assert stream and all(call["end"] == "" for call in stream), calls
    assert "".join(call["text"] for call in stream).strip(), f"the streamed haiku is printed: {calls}"
