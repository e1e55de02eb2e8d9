"""Which backend runs, and why, is never a surprise: the configured backend is the one running (or
Sandbox.create fails with the reason), a fallback happens only when configured and says so, bad settings
give clear errors, and the containerd socket is found the way dockerd chooses it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from agentenv_testutil import ROOT, SMALL, count, run_cli, start_counter

from agentenv import Sandbox, SandboxConfig
from agentenv.backend.containerd import SYSTEM_SOCKET, find_containerd, resolve_address, serving
from agentenv.backend.selection import select_backend
from agentenv.backend.settings import BackendSettings
from agentenv.errors import BackendUnavailable, ConfigError
from agentenv.runtime import runtime

CONF = ROOT / "conf" / "agentenv" / "backend.yaml"


def _conf(tmp_path: Path, **changes: str) -> Path:
    text = CONF.read_text()
    for key, value in changes.items():
        lines = [ln for ln in text.splitlines() if ln.startswith(f"{key}:")]
        assert len(lines) == 1, key
        text = text.replace(lines[0], f"{key}: {value}")
    path = tmp_path / "backend.yaml"
    path.write_text(text)
    return path


def test_the_configured_backend_is_the_one_running(agentenv_home):
    configured = BackendSettings.load().backend
    backend = runtime().backend
    assert backend.name == configured, f"{configured!r} configured, {backend.name!r} runs: {backend.reason}"
    assert backend.reason.startswith("configured")


def test_info_names_the_backend_and_why(agentenv_home):
    proc = run_cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["backend"] == BackendSettings.load().backend and "configured" in info["backend_reason"]
    if info["backend"] == "fastpath":
        assert Path(info["containerd_address"]).is_socket() and info["containerd_found_by"]


def test_a_backend_that_cannot_run_fails_create_with_the_reason(tmp_path, monkeypatch, base_image):
    monkeypatch.setenv("AGENTENV_BACKEND_CONFIG", str(_conf(tmp_path, backend="fastpath",
                                                              ctr="agentenv-no-such-ctr")))
    monkeypatch.delenv("AGENTENV_BACKEND", raising=False)
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path / "home"))
    with pytest.raises(BackendUnavailable, match="'fastpath' .* cannot run on this host: containerd's "
                       "CLI 'agentenv-no-such-ctr' is not on PATH.*fallback: docker-criu"):
        Sandbox.create()
    proc = run_cli("info", "--json")
    assert proc.returncode == 1 and json.loads(proc.stdout)["backend"] is None
    assert "agentenv-no-such-ctr" in json.loads(proc.stdout)["backend_error"]


def test_a_configured_fallback_runs_and_says_why(tmp_path, monkeypatch):
    monkeypatch.delenv("AGENTENV_BACKEND", raising=False)
    settings = BackendSettings.load(_conf(tmp_path, backend="fastpath", ctr="agentenv-no-such-ctr",
                                          fallback="docker-criu"))
    backend = select_backend(tmp_path, settings)
    assert backend.name == "docker-criu"
    assert backend.reason.startswith("fallback") and "agentenv-no-such-ctr" in backend.reason


def test_the_environment_overrides_the_configured_backend(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTENV_BACKEND", "docker-criu")
    backend = select_backend(tmp_path)
    assert backend.name == "docker-criu" and "$AGENTENV_BACKEND" in backend.reason
    monkeypatch.setenv("AGENTENV_BACKEND", "podman")
    with pytest.raises(ConfigError, match="backend must be one of"):
        select_backend(tmp_path)


def test_settings_load_and_reject_bad_values(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("AGENTENV_BACKEND", raising=False)
    s = BackendSettings.load()
    assert s.store_dir.is_absolute() and s.disk_cap > 0 and s.fallback in ("none", "docker-criu")
    with pytest.raises(ConfigError, match="unknown key"):
        BackendSettings.from_dict({**s.__dict__, "store": "/x"})
    for key, value, error in (("disk_cap", "lots", "disk_cap"), ("store_dir", "relative/dir", "absolute"),
                              ("link_pages", "yes", "link_pages"), ("fallback", "podman", "fallback"),
                              ("containerd_address", "relative.sock", "containerd_address")):
        with pytest.raises(ConfigError, match=error):
            s.replace(**{key: value})
    monkeypatch.setenv("AGENTENV_BACKEND_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="backend config .*missing.yaml does not exist"):
        BackendSettings.load()
    bad = tmp_path / "bad.yaml"
    for text, expected in (("a: [unclosed\n", "is not valid YAML"), ("- a list\n", "must be a mapping"),
                           ("", "missing key")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=expected):
            BackendSettings.load(bad)


@pytest.mark.parametrize("args, daemon_json, sockets, expected", [
    (["dockerd", "--containerd=/run/c.sock"], {}, {SYSTEM_SOCKET}, ("/run/c.sock", "--containerd flag")),
    (["dockerd", "--containerd", "/c.sock"], {"containerd": "/x"}, set(), ("/c.sock", "--containerd")),
    (["dockerd"], {"containerd": "/run/j.sock"}, {SYSTEM_SOCKET}, ("/run/j.sock", "config file")),
    (["dockerd"], {}, {SYSTEM_SOCKET}, (SYSTEM_SOCKET, "system containerd")),
    (["dockerd", "--experimental"], {}, set(),
     ("/var/run/docker/containerd/containerd.sock", "started itself")),
    (["dockerd", "--exec-root=/srv/d/"], {}, set(), ("/srv/d/containerd/containerd.sock", "started itself")),
    (["dockerd"], {"exec-root": "/e"}, set(), ("/e/containerd/containerd.sock", "started itself")),
])
def test_containerd_socket_is_resolved_as_dockerd_does(args, daemon_json, sockets, expected):
    address, source = resolve_address(args, daemon_json, lambda p: p in sockets)
    assert address == expected[0] and expected[1] in source


def test_containerd_process_says_what_it_serves():
    assert serving(["containerd", "--config", "/c.toml"], {"grpc": {"address": "/a.sock"}, "state": "/s"}) \
        == ("/a.sock", "/s")
    assert serving(["containerd", "--address=/b.sock", "--state", "/t"], {}) == ("/b.sock", "/t")
    assert serving(["containerd"], {}) == (SYSTEM_SOCKET, "/run/containerd")


def test_containerd_detection_on_this_host(sandbox):
    found = find_containerd()
    assert Path(found.address).is_socket(), found
    # The socket found must be the one serving Docker's containers: it lists this sandbox's container.
    ns = BackendSettings.load().containerd_namespace
    listed = subprocess.run(["ctr", "--address", found.address, "--namespace", ns, "containers", "ls", "-q"],
                            capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0 and sandbox.container_id in listed.stdout.split(), listed
    assert (found.bundle(ns, sandbox.container_id) / "config.json").is_file(), found


@pytest.mark.serial  # ends by checking containerd's content store, which every test's dumps share
def test_the_docker_criu_backend_pauses_resumes_and_forks(tmp_path, monkeypatch, base_image):
    """The fallback is a real backend, not a name: Docker's checkpoint API dumps into the same store."""
    monkeypatch.setenv("AGENTENV_BACKEND", "docker-criu")
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path / "home"))
    backend = runtime().backend
    assert backend.name == "docker-criu" and backend.describe()["dump"] == "Docker checkpoint API"
    sb = Sandbox.create(config=SandboxConfig.load(**SMALL))
    try:
        before = start_counter(sb)
        sb.pause()
        record = backend.store.latest(sb.container_id)
        assert record is not None and sb.stats().checkpoint_bytes == record.image_bytes > 0
        sb.resume()
        assert count(sb) >= before
        (fork,) = sb.fork(1)
        assert count(fork) >= before and fork.exec("cat /run/agentenv/sandbox-id").stdout == fork.id
        fork.close()
        # Checkpoints of one container back to back: containerd still holds the previous one's blobs
        # unless collected first, and refusing the second one's spec blob would lose the processes.
        for _ in range(3):
            sb.pause()
            sb.resume()
        assert count(sb) >= before
        backend.dumper._collect_previous_checkpoint()
        left = subprocess.run([backend.host.ctr_path, "--address", backend.host.containerd.address,
                               "--namespace", backend.settings.containerd_namespace, "content", "ls", "-q"],
                              capture_output=True, text=True, timeout=30)
        assert left.returncode == 0 and left.stdout.split() == [], left
    finally:
        sb.close()
