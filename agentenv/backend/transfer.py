"""The stream a paused sandbox moves in: one ustar archive (`tar tvf` lists it) of regular files.

A manifest first (so the destination can refuse before the bytes arrive), then the checkpoint images,
the work dir, the writable layer and a SHA256SUMS hashed in the same pass; `Unpacker` accepts only the
declared members and raises `BadStream` naming a corrupted, missing, extra or truncated one.

Design: docs/design/sandboxes.md#agentenv-backend-transfer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import platform
import re
import subprocess
import tarfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

from agentenv.errors import BackendUnavailable, CheckpointError, InvalidArgument

FORMAT = "k3rl-move/1"
MANIFEST = "manifest.json"
SUMS = "SHA256SUMS"
WORKDIR = "workdir.tar"
ROOTFS = "rootfs.tar"
IMAGES = "images/"
BLOCK = 512
CHUNK = 1 << 20
MAX_MANIFEST = 1 << 20
_IMAGE_NAME = re.compile(r"images/[A-Za-z0-9][A-Za-z0-9._-]{0,90}")
# GNU tar, as root on both ends: numeric owners, modes, xattrs of every namespace (user.e2b.* metadata,
# trusted.overlay.* opaque dirs), ACLs, hard links, sparse files; whiteouts are character devices 0:0
_TAR_FLAGS = ["--numeric-owner", "--xattrs", "--xattrs-include=*", "--acls", "--sparse"]


class BadStream(InvalidArgument):
    """A move's stream (or its manifest) is malformed, truncated, or does not match its checksums: the
    destination refuses it (400), and the source keeps the sandbox."""


@dataclass(frozen=True)
class Part:
    """One file of the stream on the sending side: its member name and where its bytes are."""

    name: str
    path: Path

    @property
    def size(self) -> int:
        return self.path.stat().st_size


class Sink(Protocol):
    """Where the destination writes one member's bytes."""

    def write(self, data: bytes | memoryview) -> None: ...

    def close(self) -> None: ...


# ---- the hosts ---------------------------------------------------------------------------------------
@cache
def host_facts() -> dict[str, str]:
    """What a restore depends on beyond the files: CRIU's version, the kernel release, the machine."""
    try:
        out = subprocess.run(["criu", "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BackendUnavailable(f"cannot run `criu --version`: {e}") from None
    version = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Version:")), out.strip()[:80])
    return {"criu": version, "kernel": platform.release(), "machine": platform.machine()}


def check_host(source: Mapping[str, Any], here: Mapping[str, str] | None = None) -> None:
    """Refuse a checkpoint made where CRIU, the kernel or the machine differ from this host (`here`,
    default `host_facts()`): CRIU restores only what a matching CRIU and kernel dumped."""
    here = here if here is not None else host_facts()
    differ = [f"{k} {source.get(k)!r} there, {v!r} here" for k, v in here.items() if source.get(k) != v]
    if differ:
        raise BackendUnavailable("this host cannot restore the sandbox's checkpoint: " + "; ".join(differ)
                                 + " (move it to a host with the same CRIU and kernel)")


# ---- files in and out of trees -----------------------------------------------------------------------
def archive_tree(src: Path, dst: Path) -> None:
    """`dst`: a GNU tar archive of everything under `src` (see `_TAR_FLAGS`)."""
    proc = subprocess.run(["tar", *_TAR_FLAGS, "-C", str(src), "-cf", str(dst), "."], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise CheckpointError(f"archiving {src} for the move failed: {proc.stderr.strip()[-300:]}")


class FileSink:
    """A member written to a new file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "xb", buffering=0)  # noqa: SIM115 - closed by `close`

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            view = view[self._f.write(view):]

    def close(self) -> None:
        self._f.close()


class TreeSink:
    """A member that is a GNU tar archive, unpacked into the folder `dst` as it arrives."""

    def __init__(self, dst: Path) -> None:
        self.dst = dst
        argv = ["tar", *_TAR_FLAGS, "-xpf", "-", "-C", str(dst)]
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE)
        self._ended = False  # tar stopped reading (at the archive's end marker, or failing: `close` says)

    def write(self, data: bytes | memoryview) -> None:
        if not self._ended:
            try:
                self._proc.stdin.write(data)
            except BrokenPipeError:
                self._ended = True

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            self._proc.stdin.close()
        err = self._proc.stderr.read().decode(errors="replace").strip()
        if self._proc.wait() != 0:
            raise CheckpointError(f"unpacking into {self.dst} failed: {err[-300:]}")


# ---- sending -----------------------------------------------------------------------------------------
def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.type = size, 0o600, tarfile.REGTYPE
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")


def _padding(size: int) -> bytes:
    return b"\0" * (-size % BLOCK)


class Packer:
    """The stream of `manifest` and `parts` (in this order), then SHA256SUMS and the end blocks; `size`
    is its exact length (sent as Content-Length) and iterating yields its bytes once."""

    def __init__(self, manifest: Mapping[str, Any], parts: Sequence[Part]) -> None:
        self.manifest = json.dumps(dict(manifest), sort_keys=True).encode()
        self.parts = list(parts)
        self.sizes = {p.name: p.size for p in self.parts}
        names = [MANIFEST, *self.sizes]
        sums = sum(64 + 2 + len(n) + 1 for n in names)
        sizes = (len(self.manifest), *self.sizes.values(), sums)
        self.size = sum(BLOCK + s + len(_padding(s)) for s in sizes) + 2 * BLOCK

    def __iter__(self) -> Iterator[bytes]:
        digests = {MANIFEST: hashlib.sha256(self.manifest).hexdigest()}
        yield _header(MANIFEST, len(self.manifest)) + self.manifest + _padding(len(self.manifest))
        for part in self.parts:
            size = self.sizes[part.name]
            yield _header(part.name, size)
            h, sent = hashlib.sha256(), 0
            with open(part.path, "rb", buffering=0) as f:
                while sent < size:
                    chunk = f.read(min(CHUNK, size - sent))
                    if not chunk:
                        raise CheckpointError(f"{part.path} shrank while it was sent ({sent} of {size} "
                                              "bytes)")
                    h.update(chunk)
                    sent += len(chunk)
                    yield chunk
            digests[part.name] = h.hexdigest()
            yield _padding(size)
        sums = "".join(f"{d}  {n}\n" for n, d in digests.items()).encode()
        yield _header(SUMS, len(sums)) + sums + _padding(len(sums)) + b"\0" * (2 * BLOCK)


# ---- receiving ---------------------------------------------------------------------------------------
class Unpacker:
    """Reads the stream through `read(n)` (up to n bytes; b"" at its end): `manifest()` first, then
    `unpack(open_part)`, which writes each declared part into the sink `open_part(name)` gives and checks
    every checksum."""

    def __init__(self, read: Callable[[int], bytes | memoryview]) -> None:
        self._read = read
        self._digests: dict[str, str] = {}
        self._declared: dict[str, int] = {}
        self.received = 0

    def _exactly(self, n: int, what: str) -> bytes:
        out = bytearray()
        while len(out) < n:
            got = self._read(n - len(out))
            if not got:
                raise BadStream(f"the move's stream ended after {self.received} bytes, inside {what}")
            out += got
            self.received += len(got)
        return bytes(out)

    def _next(self) -> tuple[str, int]:
        block = self._exactly(BLOCK, "a header")
        if block == b"\0" * BLOCK:
            return "", 0
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "strict")
        except tarfile.HeaderError as e:
            raise BadStream("the move's stream holds no valid tar header after "
                                  f"{self.received - BLOCK} bytes ({e})") from None
        if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
            raise BadStream(f"the move's stream holds {info.name!r}, which is not a regular file")
        return info.name, info.size

    def _member(self, name: str, size: int, sink: Sink | None) -> bytes:
        """Stream `size` bytes into `sink` (or return them), hashing them; skip the padding."""
        h, left, kept = hashlib.sha256(), size, bytearray()
        while left:
            got = self._read(min(CHUNK, left))
            if not got:
                raise BadStream(f"the move's stream ended after {self.received} bytes, inside {name} "
                                      f"({size - left} of its {size} bytes)")
            self.received += len(got)
            left -= len(got)
            h.update(got)
            if sink is None:
                kept += got
            else:
                sink.write(got)
        self._exactly(-size % BLOCK, f"the padding of {name}")
        self._digests[name] = h.hexdigest()
        return bytes(kept)

    def manifest(self) -> dict[str, Any]:
        """The first member, checked for its format and the shape of its part list."""
        name, size = self._next()
        if name != MANIFEST or size > MAX_MANIFEST:
            raise BadStream(f"a move's stream starts with {MANIFEST} (at most {MAX_MANIFEST} bytes), "
                                  f"not {name or 'its end'!r} ({size} bytes)")
        try:
            manifest = json.loads(self._member(name, size, None))
        except ValueError as e:
            raise BadStream(f"the move's {MANIFEST} is not JSON: {e}") from None
        self._declared = declared_parts(manifest)
        return manifest

    def unpack(self, open_part: Callable[[str], Sink]) -> None:
        """Every declared part into its sink, then SHA256SUMS checked against what arrived."""
        while True:
            name, size = self._next()
            if name == SUMS:
                break
            if name not in self._declared or name in self._digests:
                raise BadStream(f"the move's stream holds {name or 'its end'!r}, which its manifest "
                                      "does not declare (or declares once)")
            if size != self._declared[name]:
                raise BadStream(f"{name} has {size} bytes in the stream but {self._declared[name]} in "
                                      "the manifest")
            sink = open_part(name)
            try:
                self._member(name, size, sink)
            finally:
                sink.close()
        missing = sorted(set(self._declared) - set(self._digests))
        if missing:
            raise BadStream(f"the move's stream lacks {', '.join(missing)}")
        if size > MAX_MANIFEST:
            raise BadStream(f"the move's {SUMS} is {size} bytes long")
        sums = self._member(SUMS, size, None).decode(errors="replace")
        sent = dict(reversed(line.split("  ", 1)) for line in sums.splitlines() if "  " in line)
        for name, digest in self._digests.items():
            if name != SUMS and sent.get(name) != digest:
                raise BadStream(f"{name} arrived corrupted: its sha256 is {digest}, the source sent "
                                      f"{sent.get(name, 'none')}")
        if self._exactly(2 * BLOCK, "the end blocks") != b"\0" * (2 * BLOCK):
            raise BadStream("the move's stream goes on after its SHA256SUMS")


def declared_parts(manifest: Any) -> dict[str, int]:
    """The parts a manifest declares ({name: size}), or BadStream when it is malformed."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise BadStream(f"not a move of format {FORMAT!r} (got {found!r}); both hosts need this "
                              "version of AgentENV")
    parts = manifest.get("parts")
    if not isinstance(parts, dict) or not parts:
        raise BadStream("the move's manifest declares no parts")
    for name, size in parts.items():
        if not (_IMAGE_NAME.fullmatch(name) or name in (WORKDIR, ROOTFS)):
            raise BadStream(f"the move's manifest declares a part named {name!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadStream(f"the move's manifest gives part {name} the size {size!r}")
    return dict(parts)
