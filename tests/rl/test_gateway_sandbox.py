"""The gateway from inside sandboxes that have no network device (`rl.rollout.gateway.sandbox_link`): a
program in
the sandbox calls ``OPENAI_BASE_URL`` (the link's listener in the sandbox's loopback) and each call is
recorded under its episode's key, also by a program that lives across a pause and resume, and in forks
under the forks' own keys. The client is python3's http.client: the base image has no openai SDK."""

from __future__ import annotations

import json
import time

import pytest
from gateway_testutil import MODEL, tiny_gateway
from rl_testutil import compose

from agentenv import Sandbox, SandboxConfig
from agentenv.errors import ConfigError, InvalidArgument, SandboxStateError
from rl.rollout.gateway.capture import KEY_PREFIX
from rl.rollout.gateway.sandbox_link import SandboxLink

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("one_torch_thread")]

# client.py MODEL FLAG TEXT...: one chat completion per TEXT through one http.client connection (which
# connects again when the server closed it after an answer); before the i-th call (i >= 1) it waits for the
# file FLAG.i. Prints {"status", "body"} per call.
CLIENT = r"""
import http.client, json, os, sys, time, urllib.parse
model, flag, texts = sys.argv[1], sys.argv[2], sys.argv[3:]
url = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}
conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
for i, text in enumerate(texts):
    deadline = time.monotonic() + 60
    while i and not os.path.exists(f"{flag}.{i}") and time.monotonic() < deadline:
        time.sleep(0.02)
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    conn.request("POST", url.path + "/chat/completions", json.dumps(body), headers)
    reply = conn.getresponse()
    print(json.dumps({"status": reply.status, "body": json.loads(reply.read())}), flush=True)
"""


@pytest.fixture(scope="module")
def model_cfg():
    return compose().model


@pytest.fixture(scope="module")
def link(model_cfg):
    with SandboxLink(tiny_gateway(model_cfg, max_tokens=4)) as running:
        yield running


@pytest.fixture
def sandboxes(link):
    """The test's sandboxes (forks included), unlinked and closed at its end."""
    made: list[Sandbox] = []
    yield made
    for sb in made:
        link.detach(sb)
        sb.close()


@pytest.fixture
def new_sandbox(sandbox_config, sandboxes):
    def make() -> Sandbox:
        sb = Sandbox.create(config=SandboxConfig.from_dict(sandbox_config))
        sandboxes.append(sb)
        sb.write_file("client.py", CLIENT)
        return sb

    return make


def call(link: SandboxLink, sb: Sandbox, key: str, text: str = "hello") -> dict:
    result = sb.exec(["python3", "-S", "client.py", MODEL, "-", text], env=link.env(sb, key), timeout=90)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def answered(reply: dict) -> dict:
    assert reply["status"] == 200, reply
    (choice,) = reply["body"]["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    return reply["body"]


def interfaces(sb: Sandbox) -> list[str]:
    return sb.exec("ls /sys/class/net").stdout.split()


def replies(sb: Sandbox, count: int) -> list[dict]:
    """The first ``count`` answers the detached client printed (waits up to 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        lines = sb.read_file("out.jsonl").decode().splitlines()
        if len(lines) >= count:
            return [json.loads(line) for line in lines[:count]]
        assert time.monotonic() < deadline, sb.read_file("err.txt").decode()
        time.sleep(0.1)


def prompts(link: SandboxLink, key: str) -> list[str]:
    """The prompts of the calls recorded under ``key`` (its episode is closed)."""
    return [link.gateway.tokenizer.decode(c.prompt_ids) for c in link.gateway.keys.close(key).calls]


def test_a_program_calls_the_gateway_across_a_pause_and_resume(link, new_sandbox):
    sb = new_sandbox()
    assert interfaces(sb) == ["lo"]  # no network device: only the host's listener in the loopback
    key = link.gateway.keys.open()
    started = sb.exec(f"setsid python3 -S client.py {MODEL} go first second </dev/null >out.jsonl "
                      "2>err.txt &", env=link.env(sb, key))
    assert started.exit_code == 0, started.stderr
    (first,) = replies(sb, 1)
    sb.pause()  # the client holds no connection: the answer closed it
    sb.resume()
    assert interfaces(sb) == ["lo"]
    link.env(sb, key)  # the namespace is the same: its listener is kept
    sb.write_file("go.1", "")
    second = replies(sb, 2)[1]
    bodies = [answered(first), answered(second)]
    record = link.gateway.keys.close(key)
    assert len(record.calls) == 2
    for body, captured in zip(bodies, record.calls, strict=True):
        assert body["usage"]["completion_tokens"] == len(captured.completion_ids) >= 1
        assert body["usage"]["prompt_tokens"] == len(captured.prompt_ids)
    texts = [link.gateway.tokenizer.decode(c.prompt_ids) for c in record.calls]
    assert "first" in texts[0] and "second" in texts[1]


def test_forks_call_under_their_own_keys(link, new_sandbox, sandboxes):
    sb = new_sandbox()
    parent = link.gateway.keys.open()
    answered(call(link, sb, parent, "before the fork"))
    forks = sb.fork(2)
    sandboxes.extend(forks)
    keys = [link.gateway.keys.open() for _ in forks]
    for fork, key in zip(forks, keys, strict=True):
        assert fork.network_namespace() != sb.network_namespace()  # each fork: a listener of its own
        assert interfaces(fork) == ["lo"]
        answered(call(link, fork, key, f"in {fork.id}"))
    answered(call(link, sb, parent, "after the fork"))  # the source, resumed by the fork, still reaches it
    for fork, key in zip(forks, keys, strict=True):
        (text,) = prompts(link, key)
        assert f"in {fork.id}" in text
    assert [("before" in t, "after" in t) for t in prompts(link, parent)] == [(True, False), (False, True)]


def test_a_wrong_key_gets_openais_401(link, new_sandbox):
    reply = call(link, new_sandbox(), KEY_PREFIX + "not-an-open-episode")
    assert reply["status"] == 401
    error = reply["body"]["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"


def test_an_unreachable_gateway_is_a_502_in_openais_shape(model_cfg, new_sandbox):
    sb = new_sandbox()
    gateway = tiny_gateway(model_cfg)  # a gateway is served by one server: its batcher runs in it
    with SandboxLink(gateway, port=4142) as other:
        env = other.env(sb, gateway.keys.open())
        other.socket_path.unlink()  # the gateway's server is gone from where the link looks
        result = sb.exec(["python3", "-S", "client.py", MODEL, "-", "hello"], env=env, timeout=90)
    reply = json.loads(result.stdout)
    assert reply["status"] == 502
    error = reply["body"]["error"]
    assert error["code"] == "gateway_unreachable" and "not reachable" in error["message"], error


def test_bad_ports_and_stopped_sandboxes_are_refused_by_name(link, new_sandbox):
    sb = new_sandbox()
    with pytest.raises(ConfigError, match="port must be an integer"):
        SandboxLink(link.gateway, port=0)
    with pytest.raises(InvalidArgument, match="port must be an integer"):
        sb.loopback_listener(70000)
    with pytest.raises(RuntimeError, match="not started"):
        SandboxLink(link.gateway).env(sb, "k")
    sb.pause()
    assert sb.network_namespace() is None
    with pytest.raises(SandboxStateError, match="is paused"):
        link.env(sb, "k")
