"""The official `openai` Python client against a live kvgate: chat, streaming with usage,
legacy completions, model listing, typed errors, and retries that honour our Retry-After."""

import threading
import time
import urllib.request

import httpx
import openai
import pytest
from openai import OpenAI


def _client(server, tenant="main", **kwargs):
    return OpenAI(base_url=server["base_url"], api_key=server["keys"][tenant], **kwargs)


def _wait_until_queued(server, tenant, limit=60.0):
    """Polls the gateway's metrics until `tenant` has a request waiting in its queue."""
    metrics = server["base_url"].removesuffix("/v1") + "/metrics"
    prefix = f'kvgate_requests_queued{{tenant="{tenant}"}} '
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with urllib.request.urlopen(metrics, timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith(prefix) and float(line[len(prefix):]) >= 1:
                    return
        time.sleep(0.02)
    raise AssertionError(f"no request of {tenant} reached the queue within {limit} s")


def test_chat_completion(server):
    reply = _client(server).chat.completions.create(
        model=server["model"],
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.id.startswith("chatcmpl-")
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 1 <= reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_with_usage(server):
    stream = _client(server).chat.completions.create(
        model=server["model"],
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices == []
    assert 1 <= chunks[-1].usage.completion_tokens <= 6
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_legacy_completion_and_models(server):
    client = _client(server)
    reply = client.completions.create(model=server["model"], prompt="The sky is", max_tokens=4, temperature=0)
    assert reply.object == "text_completion"
    assert isinstance(reply.choices[0].text, str)
    assert [m.id for m in client.models.list()] == [server["model"]]


def test_errors_are_typed(server):
    client = _client(server, max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=server["model"], messages=[{"role": "user", "content": "hi"}], max_tokens=1, temperature=5
        )
    assert bad.value.param == "temperature"
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=server["base_url"], api_key="sk-wrong", max_retries=0).models.list()


def test_retry_honours_retry_after(server):
    """solo may run one request and queue one. With both taken, a third gets 429 queue_full;
    the client waits what Retry-After says, retries, and succeeds once the others are done."""
    seen = []

    def record(response):
        seen.append((response.status_code, time.monotonic(), response.headers.get("retry-after-ms")))

    retrying = _client(server, "solo", max_retries=10, http_client=httpx.Client(event_hooks={"response": [record]}))
    others = _client(server, "solo", max_retries=0)
    # 1. Hold the running slot with a long stream, read in the background.
    stream = others.chat.completions.create(
        model=server["model"],
        messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
        max_tokens=160,
        temperature=0,
        stream=True,
    )
    chunks = iter(stream)
    next(chunks)
    running = threading.Thread(target=lambda: [None for _ in chunks])
    running.start()
    # 2. Take the queue slot with a second request (it waits for the first).
    queued_result = {}

    def queued_request():
        queued_result["reply"] = others.chat.completions.create(
            model=server["model"], messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )

    queued = threading.Thread(target=queued_request)
    queued.start()
    _wait_until_queued(server, "solo")

    # 3. The third request is refused, honours Retry-After, and gets through on a retry.
    reply = retrying.chat.completions.create(
        model=server["model"], messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    running.join()
    queued.join()
    assert reply.choices[0].message.content is not None
    assert queued_result["reply"].choices[0].message.content is not None
    statuses = [status for status, _, _ in seen]
    assert statuses[0] == 429 and statuses[-1] == 200, statuses
    assert set(statuses[:-1]) == {429}
    # The client waited at least as long as each 429 told it to.
    for (_, at, retry_ms), (_, next_at, _) in zip(seen, seen[1:]):
        assert retry_ms is not None
        assert next_at - at >= int(retry_ms) / 1000 * 0.95, (retry_ms, next_at - at)
