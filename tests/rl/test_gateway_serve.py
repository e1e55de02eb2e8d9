"""``python -m rl.rollout.gateway``: a saved policy served on its own, and clear refusals of a bad
--checkpoint."""

import socket
import subprocess
import sys
import time

import httpx
import pytest
from rl_testutil import ROOT, compose

from model.checkpoint import save_pretrained
from rl.policy import build_policy
from rl.rollout.gateway.serve import main


@pytest.fixture(scope="module")
def policy_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("policy")
    save_pretrained(build_policy(compose().model, seed=0), folder)
    return folder


def refusal(*argv) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["--checkpoint", *argv])
    return str(exited.value.code)


def test_a_missing_or_broken_checkpoint_is_refused_by_name(tmp_path, policy_folder):
    assert "no such file or folder" in refusal(str(tmp_path / "nowhere"))
    assert "holds no policy weights" in refusal(str(tmp_path))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((policy_folder / "config.json").read_text())
    message = refusal(str(broken))
    assert "cannot load the policy" in message and "model.safetensors" in message


def test_the_module_serves_a_saved_policy(policy_folder):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, "-m", "rl.rollout.gateway", "--checkpoint", str(policy_folder),
            "--port", str(port), "--model-name", "saved", "--max-tokens", "8"]  # fmt: skip
    server = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                models = httpx.get(f"{url}/models", timeout=2).json()
                break
            except httpx.TransportError:
                assert server.poll() is None, server.stdout.read()
                assert time.monotonic() < deadline, "the gateway did not answer within 60 s"
                time.sleep(0.2)
        assert [m["id"] for m in models["data"]] == ["saved"]
        reply = httpx.post(f"{url}/completions", json={"model": "saved", "prompt": "ab", "max_tokens": 3})
        assert reply.status_code == 200, reply.text
        assert 1 <= reply.json()["usage"]["completion_tokens"] <= 3
    finally:
        server.terminate()
        server.wait(10)
