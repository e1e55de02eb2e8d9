"""Docker's capability names (`cap_drop`, `cap_add` of a sandbox config) as Linux capability numbers: the
guest agent keeps these in the bounding set of every command it starts and drops the rest, which is what
Docker does for a container's processes."""

from __future__ import annotations

from collections.abc import Iterable

from agentenv.errors import ConfigError

NUMBERS = {
    "CHOWN": 0, "DAC_OVERRIDE": 1, "DAC_READ_SEARCH": 2, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6,
    "SETUID": 7, "SETPCAP": 8, "LINUX_IMMUTABLE": 9, "NET_BIND_SERVICE": 10, "NET_BROADCAST": 11,
    "NET_ADMIN": 12, "NET_RAW": 13, "IPC_LOCK": 14, "IPC_OWNER": 15, "SYS_MODULE": 16, "SYS_RAWIO": 17,
    "SYS_CHROOT": 18, "SYS_PTRACE": 19, "SYS_PACCT": 20, "SYS_ADMIN": 21, "SYS_BOOT": 22, "SYS_NICE": 23,
    "SYS_RESOURCE": 24, "SYS_TIME": 25, "SYS_TTY_CONFIG": 26, "MKNOD": 27, "LEASE": 28, "AUDIT_WRITE": 29,
    "AUDIT_CONTROL": 30, "SETFCAP": 31, "MAC_OVERRIDE": 32, "MAC_ADMIN": 33, "SYSLOG": 34, "WAKE_ALARM": 35,
    "BLOCK_SUSPEND": 36, "AUDIT_READ": 37, "PERFMON": 38, "BPF": 39, "CHECKPOINT_RESTORE": 40,
}
# What Docker gives a container before cap_drop and cap_add apply.
DOCKER_DEFAULT = ("CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID",
                  "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE")


def _numbers(names: Iterable[str], key: str) -> set[int]:
    out = set()
    for name in names:
        bare = name.upper().removeprefix("CAP_")
        if bare == "ALL":
            out |= set(NUMBERS.values())
        elif bare in NUMBERS:
            out.add(NUMBERS[bare])
        else:
            raise ConfigError(f"{key}: unknown capability {name!r}")
    return out


def kept_capabilities(cap_drop: Iterable[str], cap_add: Iterable[str]) -> set[int]:
    """Docker's default set, less `cap_drop`, plus `cap_add` (capability numbers)."""
    kept = _numbers(DOCKER_DEFAULT, "default") - _numbers(cap_drop, "cap_drop")
    return kept | _numbers(cap_add, "cap_add")
