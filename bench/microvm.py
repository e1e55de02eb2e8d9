"""The microvm backend beside the container backend (`warm`) in one run, on the same sandbox profile and
the same workload: a process holding `--mb` MiB of random bytes in memory.

Resume, pause, fork(8), forks' memory and create, against the microvm targets; writes the `microvm`
section of docs/benchmarks.md. Usage: python bench/microvm.py [--mb 64] [--dirty 8] [--reps 5] [--no-write]

Design: docs/design/benchmarks.md#bench-microvm.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_report import busy_cores_before, other_load_text, write_section  # noqa: E402

MEMORY_PROCESS = ("nohup python3 -c \"import os,time; big = os.urandom({mb} << 20); "
                  "open('/tmp/tok', 'w').write(str(len(big))); time.sleep(10**6)\" >/dev/null 2>&1 & "
                  "while [ ! -s /tmp/tok ]; do sleep 0.05; done; cat /tmp/tok")
FORKS = 8


@contextlib.contextmanager
def backend_home(name: str, folder: Path) -> Iterator[object]:
    """Sandboxes of this block on backend `name` in a registry of their own; the runtime."""
    from agentenv.sandbox import runtime

    home = folder / name
    home.mkdir(parents=True)
    keys = ("AGENTENV_HOME", "AGENTENV_BACKEND", "AGENTENV_BACKEND_CONFIG")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(AGENTENV_HOME=str(home), AGENTENV_BACKEND=name)
    os.environ.pop("AGENTENV_BACKEND_CONFIG", None)
    rt = runtime()
    try:
        yield rt
    finally:
        from agentenv import Sandbox, spares

        for sb in Sandbox.list():
            with contextlib.suppress(Exception):
                sb.close()
        with contextlib.suppress(Exception):
            spares.expire(rt, 0.0)  # the spare shells made ahead would outlive the deleted home
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _pss_of(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, AttributeError):
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
            total += int(re.search(r"^Pss:\s+(\d+) kB", text, re.M).group(1)) * 1024
    return total


def _pids(rt, sb) -> list[int]:
    """The host processes of a running sandbox."""
    if rt.backend.name == "microvm":
        from agentenv.backend.microvm import qemu

        pid = qemu.running_pid(rt.backend.vms / (sb.container_id or ""))
        return [pid] if pid else []
    from agentenv.backend.cgroups import cgroup_pids

    info = rt.backend.api.inspect_container(sb.container_id)
    return list(cgroup_pids(int(info["State"]["Pid"])))


def measure(name: str, folder: Path, mb: int, dirty: int, reps: int) -> dict[str, object]:
    from agentenv import Sandbox, SandboxConfig
    from agentenv.backend.microvm import snapshots

    out: dict[str, object] = {}
    cfg = SandboxConfig.load(memory="512m", tmpfs={"/tmp": "size=128m,mode=1777"})
    with backend_home(name, folder) as rt:
        out["accelerator"] = getattr(getattr(rt.backend, "accel", None), "name", "")
        creates, resumes, pauses, syncs = [], [], [], []
        sb = Sandbox.create(config=cfg)  # the first create of a machine may boot its golden snapshot
        sb.close()
        for _ in range(reps):
            t = time.perf_counter()
            sb = Sandbox.create(config=cfg)
            creates.append(time.perf_counter() - t)
            sb.close()
        sb = Sandbox.create(config=cfg)
        sb.exec(MEMORY_PROCESS.format(mb=mb), timeout=120)
        one_pss = _pss_of(_pids(rt, sb))
        real_settle = snapshots.settle_ram

        def timed_settle(ram: Path) -> None:
            syncs.append(_timed(lambda: real_settle(ram)))

        snapshots.settle_ram = timed_settle
        try:
            for _ in range(reps):
                pauses.append(_timed(sb.pause))
                resumes.append(_timed(lambda: (sb.resume(), sb.exec("echo ok"))))
        finally:
            snapshots.settle_ram = real_settle
        sb.pause()
        forks_s = []
        for _ in range(max(1, reps // 2)):
            t = time.perf_counter()
            forks = sb.fork(FORKS)
            forks_s.append(time.perf_counter() - t)
            for f in forks:
                f.exec(f"head -c {dirty << 20} /dev/urandom > /tmp/dirty")
            time.sleep(1.0)
            eight_pss = _pss_of([p for f in forks for p in _pids(rt, f)])
            for f in forks:
                f.close()
        sb.close()
        out.update(create_s=statistics.median(creates), resume_shell_s=statistics.median(resumes),
                   pause_s=statistics.median(pauses), sync_s=statistics.median(syncs) if syncs else 0.0,
                   fork8_s=statistics.median(forks_s), one_pss=one_pss, eight_pss=eight_pss)
        if name == "microvm":
            out["boot_s"] = _cold_boot(rt.backend, cfg)
    return out


def _cold_boot(backend, cfg) -> float:
    """A golden snapshot made from scratch (the guest booted until its agent answers, then paused)."""
    from agentenv.backend import images
    from agentenv.backend.microvm import golden

    machine = backend.machine(images.resolve(cfg.image), cfg)
    scratch = Path(tempfile.mkdtemp(prefix="golden-", dir=backend.root))
    try:
        t = time.perf_counter()
        golden.golden(machine, scratch, backend.settings.microvm_boot_timeout_s)
        return time.perf_counter() - t
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _ms(s: float) -> str:
    return f"{s * 1000:.0f} ms"


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f} MiB"


def render(vm: dict, ct: dict, args: argparse.Namespace, busy: float) -> str:
    accel = vm["accelerator"]
    accel_words = {"tcg": "TCG (QEMU's CPU emulation: /dev/kvm here is a nested hypervisor on which a Linux "
                          "guest does not boot)", "kvm": "KVM"}.get(accel, accel)
    mem_target = 1.3 * vm["one_pss"] + FORKS * (args.dirty << 20)
    ct_target = 1.3 * ct["one_pss"] + FORKS * (args.dirty << 20)
    fork_ratio, ct_ratio = vm["fork8_s"] / vm["resume_shell_s"], ct["fork8_s"] / ct["resume_shell_s"]

    def met(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    lines = [
        f"Command: `python bench/microvm.py --mb {args.mb} --dirty {args.dirty} --reps {args.reps}`  ",
        f"Machine: {os.cpu_count()} cores, kernel {platform.release()}; {other_load_text(busy)} "
        f"Accelerator of the microVMs: **{accel_words}**. Both backends on the same profile (memory 512m, "
        f"1 CPU, tmpfs /tmp 128m), a process holding {args.mb} MiB of random bytes; medians of "
        f"{args.reps} repetitions (fork: {max(1, args.reps // 2)}).",
        "",
        "| | microvm | warm (containers) |",
        "|---|---|---|",
        f"| create (microvm: from the golden snapshot) | {_ms(vm['create_s'])} | {_ms(ct['create_s'])} |",
        f"| resume + `exec('echo ok')` answering | {_ms(vm['resume_shell_s'])} | "
        f"{_ms(ct['resume_shell_s'])} |",
        f"| pause | {_ms(vm['pause_s'])} (of it, the RAM file's sync + drop: {_ms(vm['sync_s'])}) | "
        f"{_ms(ct['pause_s'])} |",
        f"| fork(8) of the paused sandbox, all running | {_ms(vm['fork8_s'])} ({fork_ratio:.1f}x a resume) | "
        f"{_ms(ct['fork8_s'])} ({ct_ratio:.1f}x a resume) |",
        f"| PSS of one running sandbox | {_mib(vm['one_pss'])} | {_mib(ct['one_pss'])} |",
        f"| PSS of 8 running forks, each wrote {args.dirty} MiB | {_mib(vm['eight_pss'])} | "
        f"{_mib(ct['eight_pss'])} |",
        f"| cold boot of the guest to its agent (a golden snapshot) | {vm['boot_s']:.1f} s | |",
        "",
        f"Targets on {accel.upper()}: resume to a working shell ≤ 0.3 s ({_ms(vm['resume_shell_s'])}: "
        f"{met(vm['resume_shell_s'] <= 0.3)}); fork(8) ≤ 1.5× one resume ({fork_ratio:.1f}×: "
        f"{met(fork_ratio <= 1.5)}); 8 forks ≤ 1.3× one sandbox's memory + what they wrote "
        f"({_mib(vm['eight_pss'])} vs {_mib(mem_target)}: {met(vm['eight_pss'] <= mem_target)}); pause ≤ "
        f"50 ms + the RAM file's sync ({_ms(vm['pause_s'])} vs {_ms(0.05 + vm['sync_s'])}: "
        f"{met(vm['pause_s'] <= 0.05 + vm['sync_s'])}). The containers on the same memory rule: "
        f"{_mib(ct['eight_pss'])} vs {_mib(ct_target)} ({met(ct['eight_pss'] <= ct_target)}).",
        "",
        "On a KVM host: not measured. This machine has no hardware virtualisation (its `/dev/kvm` is a "
        "nested hypervisor that emulates a guest kernel's instructions), so every microVM figure here is "
        "TCG's; rerun this command on a host where `agentenv info` reports `accelerator: kvm`.",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--dirty", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    busy = busy_cores_before()
    folder = Path(tempfile.mkdtemp(prefix="bench-microvm-"))
    try:
        vm = measure("microvm", folder, args.mb, args.dirty, args.reps)
        ct = measure("warm", folder, args.mb, args.dirty, args.reps)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = render(vm, ct, args, busy)
    print(text)
    if not args.no_write:
        write_section("microvm", text)


if __name__ == "__main__":
    main()
