"""The microvm backend: sandboxes as QEMU microVMs (here under TCG; KVM where a Linux guest boots on it).

Pause leaves no process and no host memory (the RAM file is synced and dropped from the page cache) and a
resume brings every process back with its memory; forks map one snapshot copy-on-write, each with its own
identity, seed and kernel RNG; a source that forked pauses its memory into the snapshot stream; a paused
sandbox is resumed by another process; a process killed halfway through a pause or a resume is settled.
Fork and pause cases of the container tests run here too (imported, with this module's fixtures); the
four-fork case of test_agentenv_fork.py is left to this module's own fork test (four counting guests under
TCG cost more than the rest of the module)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from agentenv_testutil import SMALL, run_cli
from microvm_env import TOKEN_PROCESS, backend_config, microvm_home, resident_pages
from test_agentenv_fork import (  # noqa: F401 - collected here with this module's fixtures
    test_a_failed_fork_leaves_no_fork_and_the_running_source_running,
    test_fork_carries_the_writable_layer_when_the_root_is_writable,
    test_forking_a_running_sandbox_pauses_and_resumes_it,
)
from test_agentenv_pause import test_python_keeps_its_variables  # noqa: F401

from agentenv import Sandbox, SandboxConfig
from agentenv.backend.base import ContainerRef
from agentenv.backend.microvm import qemu
from agentenv.backend.microvm.vmdir import STREAM, Snapshot, VmDir
from agentenv.backend.settings import BackendSettings
from agentenv.errors import BackendUnavailable, SandboxStateError
from agentenv.runtime import runtime

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def microvm(base_image, tmp_path_factory):
    with microvm_home(tmp_path_factory.mktemp("microvm-backend")) as home:
        yield home


@pytest.fixture
def make_sandbox(microvm):
    made = []

    def make(**overrides):
        sb = Sandbox.create(config=SandboxConfig.load(**{**SMALL, **overrides}))
        made.append(sb)
        return sb

    yield make
    for sb in made:
        for s in [sb, *Sandbox.list()]:
            if s.parent_id == sb.id or s.id == sb.id:
                s.close()


@pytest.fixture
def sandbox(make_sandbox):
    return make_sandbox()


def _vm(sb: Sandbox) -> VmDir:
    return VmDir(BackendSettings.load().microvm_dir / "vms", sb.container_id or "")


def _token(sb: Sandbox) -> str:
    return sb.exec("cat /tmp/token").stdout


# ---- the host's pieces ---------------------------------------------------------------------------------
def test_a_host_without_the_guest_kernel_fails_naming_the_install_script(base_image, tmp_path):
    from agentenv.backend.microvm.runtime import MicroVMRuntime
    from agentenv.backend.selection import select_backend

    settings = BackendSettings.load(backend_config(tmp_path, microvm_kernel_dir=str(tmp_path / "none")))
    with pytest.raises(BackendUnavailable, match=r"no guest kernel in .*install_microvm\.sh"):
        MicroVMRuntime(tmp_path, settings)
    with pytest.raises(BackendUnavailable, match=r"'microvm' .* cannot run on this host: no guest kernel"):
        select_backend(tmp_path, settings)


def test_info_names_the_accelerator_and_why(microvm):
    r = run_cli("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["backend"] == "microvm" and info["accelerator"] in ("kvm", "tcg")
    assert info["accelerator_reason"] and info["sandbox_user"] == "agent"
    kvm_boots = runtime().backend.accel.name == "kvm"
    assert (info["accelerator"] == "kvm") == kvm_boots


# ---- pause and resume ----------------------------------------------------------------------------------
def test_a_paused_sandbox_has_no_process_and_no_memory_and_comes_back_whole(sandbox):
    sandbox.exec(TOKEN_PROCESS)
    token = _token(sandbox)
    sandbox.write_file("notes.txt", "kept")
    pid = sandbox.exec(["pgrep", "-x", "python3"]).stdout.split()
    vm = _vm(sandbox)
    for _ in range(2):  # the second round pauses and resumes a resumed VM
        sandbox.pause()
        assert qemu.running_pid(vm.path) is None  # no QEMU: no process at all
        st = sandbox.stats()
        assert (st.state, st.rss_bytes, st.pids) == ("paused", 0, 0) and st.checkpoint_bytes > 0
        assert resident_pages(vm.ram) == 0  # the guest's memory is on disk, not in the page cache
        sandbox.resume()
        assert _token(sandbox) == token and sandbox.read_file("notes.txt") == b"kept"
        assert sandbox.exec(["pgrep", "-x", "python3"]).stdout.split() == pid  # the same process
    assert sandbox.exec("cat /run/agentenv/sandbox-id").stdout == sandbox.id


def test_another_process_resumes_a_paused_sandbox(sandbox):
    """The registry and the VM's folder are all a paused sandbox is: a new process (a restarted service)
    resumes it, through the CLI too."""
    sandbox.exec(TOKEN_PROCESS)
    token = _token(sandbox)
    r = run_cli("pause", sandbox.id)
    assert r.returncode == 0, r.stderr
    code = (f"from agentenv import Sandbox; sb = Sandbox.get({sandbox.id!r}); sb.resume(); "
            "print(sb.exec('cat /tmp/token').stdout)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == token, r.stderr


def test_a_vm_killed_behind_the_backends_back_marks_the_sandbox_broken(sandbox):
    qemu.kill(_vm(sandbox).path)
    with pytest.raises(SandboxStateError, match="broken"):
        sandbox.exec("true")


def test_freeze_stops_the_guest_and_thaw_lets_it_go_on(sandbox):
    sandbox.freeze()
    with pytest.raises(SandboxStateError, match="frozen"):
        sandbox.exec("true")
    sandbox.thaw()
    assert sandbox.exec("echo on").stdout == "on\n"


# ---- forks -----------------------------------------------------------------------------------------------
def _pss(pid: int) -> int:
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return int(re.search(r"^Pss:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _rss(pid: int) -> int:
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return int(re.search(r"^Rss:\s+(\d+) kB", text, re.M).group(1)) * 1024


def test_forks_share_the_snapshot_copy_on_write_and_each_gets_its_own_identity(sandbox):
    sandbox.exec("head -c 24000000 /dev/urandom > /tmp/blob")  # 24 MB of guest memory (tmpfs)
    forks = sandbox.fork(3)
    for f in forks:
        assert f.exec("md5sum < /tmp/blob").exit_code == 0  # every fork reads all of it
    pids = [qemu.running_pid(_vm(s).path) for s in (sandbox, *forks)]
    rss, pss = sum(_rss(p) for p in pids), sum(_pss(p) for p in pids)
    assert pss < 0.6 * rss, (pss, rss)  # the blob's pages are one copy shared by the four
    for i, f in enumerate(forks):
        f.exec(f"echo fork-{i} > /tmp/mine")
    assert [f.exec("cat /tmp/mine").stdout for f in forks] == [f"fork-{i}\n" for i in range(3)]
    assert sandbox.exec("test -e /tmp/mine").exit_code == 1  # nothing leaks into the source
    ids = [f.exec("cat /run/agentenv/sandbox-id").stdout for f in forks]
    assert ids == [f.id for f in forks]
    assert len({f.exec("cat /run/agentenv/seed").stdout for f in forks}) == 3
    randoms = {f.exec("head -c 16 /dev/urandom | od -An -tx1").stdout for f in forks}
    assert len(randoms) == 3  # the kernel's generator was reseeded in each


def test_a_source_that_forked_pauses_its_memory_into_the_stream_and_comes_back(sandbox):
    sandbox.exec(TOKEN_PROCESS)
    token = _token(sandbox)
    (fork,) = sandbox.fork(1)
    assert _vm(sandbox).meta["private"]  # its RAM file is shared with the fork: copy-on-write now
    sandbox.exec("echo after > /tmp/after")
    sandbox.pause()
    snap = Snapshot.load(Path(runtime().registry.latest_checkpoint(sandbox.id).path))
    assert snap is not None and snap.format == STREAM
    sandbox.resume()
    assert _token(sandbox) == token and sandbox.exec("cat /tmp/after").stdout == "after\n"
    assert not _vm(sandbox).meta["private"]  # mapped in place again: the next pause leaves RAM in its file
    assert _token(fork) == token and fork.exec("test -e /tmp/after").exit_code == 1


# ---- a process killed halfway ----------------------------------------------------------------------------
def _killed_at(point: str, sandbox_id: str, call: str) -> None:
    code = f"from agentenv import Sandbox; Sandbox.get({sandbox_id!r}).{call}()"
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "AGENTENV_FAULT": point},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr


def _settle(sb: Sandbox, recorded: str):
    rt = runtime()
    rec = rt.registry.get_sandbox(sb.id)
    verdict = rt.backend.settle(ContainerRef(rec.container, ""), sb.id, recorded,
                                rt.registry.latest_checkpoint(sb.id), 10.0)
    if verdict.checkpoint is not None:
        rt.registry.insert_checkpoint(sb.id, verdict.checkpoint)
    if verdict.drop_checkpoint:
        while (ck := rt.registry.latest_checkpoint(sb.id)) is not None:
            rt.registry.delete_checkpoint(ck.id)
    rt.registry.update_sandbox(sb.id, state=verdict.state)
    return verdict


def test_a_pause_and_a_resume_killed_halfway_are_settled(sandbox):
    """Killed before its snapshot was recorded, a pause lets the guest go on (running); killed after (QEMU
    still there, stopped), it is finished (paused); killed as a resume let the guest run, the sandbox runs
    on (its RAM is no longer the snapshot's) with its identity."""
    sandbox.exec(TOKEN_PROCESS)
    token = _token(sandbox)
    _killed_at("microvm-saved", sandbox.id, "pause")
    assert _settle(sandbox, "running").state == "running"
    assert _token(sandbox) == token
    _killed_at("microvm-recorded", sandbox.id, "pause")
    verdict = _settle(sandbox, "running")
    assert verdict.state == "paused" and verdict.checkpoint is not None, verdict
    assert qemu.running_pid(_vm(sandbox).path) is None
    _killed_at("microvm-loaded", sandbox.id, "resume")
    verdict = _settle(sandbox, "paused")
    assert (verdict.state, verdict.note) == ("running", "resumed"), verdict
    assert _token(sandbox) == token
    assert sandbox.exec("cat /run/agentenv/sandbox-id").stdout == sandbox.id
    sandbox.pause()
    sandbox.resume()
    assert _token(sandbox) == token


def test_gc_drops_golden_snapshots_and_initramfs_files_no_longer_current(microvm):
    """A new guest agent makes a new initramfs and new golden snapshots; the old ones are leftovers (a VM
    made from an old initramfs keeps the file it maps)."""
    import dataclasses

    backend = runtime().backend
    goldens = [Snapshot.load(p) for p in (backend.root / "golden").glob("*")]
    current = next(g for g in goldens if g is not None and g.machine.initrd == str(backend.initrd))
    old_initrd = backend.root / "initrd" / "0000000000000000.cpio"
    old_initrd.write_bytes(b"an initramfs of an older agent")
    old = backend.root / "golden" / "gc-test-old-machine"
    old.mkdir()
    dataclasses.replace(current, path=old, machine=dataclasses.replace(current.machine,
                                                                         initrd=str(old_initrd))).save()
    assert {str(old), str(old_initrd)} <= set(backend.collect_leftovers(dry_run=True))
    removed = backend.collect_leftovers()
    assert str(old) in removed and not old.exists() and not old_initrd.exists()
    assert current.path.exists() and backend.initrd.exists()


def test_a_move_is_refused_with_the_reason(sandbox):
    sandbox.pause()
    with pytest.raises(BackendUnavailable, match="microvm backend; a move carries CRIU checkpoints only"):
        sandbox.move("http://127.0.0.1:9", api_key="e2b_" + "0" * 40)
    assert sandbox.status == "paused"
