"""The stream a paused sandbox moves in (`agentenv.backend.transfer`), without Docker: every byte and file
attribute arrives, and a corrupted, truncated or padded stream is refused naming what is wrong; a host
with another CRIU or kernel is refused before anything is sent."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from agentenv.backend.transfer import (
    FORMAT,
    IMAGES,
    WORKDIR,
    BadStream,
    FileSink,
    Packer,
    Part,
    TreeSink,
    Unpacker,
    archive_tree,
    check_host,
    host_facts,
)
from agentenv.errors import BackendUnavailable


def _source(tmp_path: Path) -> tuple[dict, list[Part], dict[str, bytes]]:
    """A checkpoint folder's worth of image files and an archived work dir with links, owners, modes and
    extended attributes; (manifest, parts, image bytes by member name)."""
    images = tmp_path / "images"
    images.mkdir()
    data = {"pages-1.img": os.urandom(3 << 20) + b"tail", "core-1.img": b"core", "tmpfs-0.tar": b""}
    for name, content in data.items():
        (images / name).write_bytes(content)
    work = tmp_path / "work"
    (work / "a" / "b").mkdir(parents=True)
    (work / "a" / "b" / "f.txt").write_text("hello\n")
    os.chmod(work / "a" / "b" / "f.txt", 0o751)
    os.chown(work / "a" / "b" / "f.txt", 1000, 1000)
    os.setxattr(work / "a" / "b" / "f.txt", "user.e2b.note", b"kept")
    os.link(work / "a" / "b" / "f.txt", work / "hard.txt")
    os.symlink("a/b/f.txt", work / "link")
    (work / "empty").write_bytes(b"")
    archive_tree(work, tmp_path / WORKDIR)
    parts = [Part(IMAGES + n, images / n) for n in sorted(data)] + [Part(WORKDIR, tmp_path / WORKDIR)]
    manifest = {"format": FORMAT, "move_id": "0" * 16, "parts": {p.name: p.size for p in parts}}
    return manifest, parts, {IMAGES + n: c for n, c in data.items()}


def _unpack(stream: bytes, dest: Path) -> dict:
    """Unpack `stream` into dest/images and dest/work; the manifest."""
    (dest / "images").mkdir(parents=True)
    (dest / "work").mkdir()
    src = io.BytesIO(stream)
    unpacker = Unpacker(src.read)
    manifest = unpacker.manifest()
    unpacker.unpack(lambda name: FileSink(dest / "images" / name[len(IMAGES):]) if name.startswith(IMAGES)
                    else TreeSink(dest / "work"))
    return manifest


def test_every_byte_and_file_attribute_arrives(tmp_path):
    manifest, parts, images = _source(tmp_path)
    packer = Packer(manifest, parts)
    stream = b"".join(packer)
    assert len(stream) == packer.size  # the Content-Length a move sends
    with tarfile.open(fileobj=io.BytesIO(stream)) as tar:  # a plain ustar archive
        assert tar.getnames() == ["manifest.json", *[p.name for p in parts], "SHA256SUMS"]
    assert _unpack(stream, tmp_path / "dest") == manifest
    for name, content in images.items():
        assert (tmp_path / "dest" / "images" / name[len(IMAGES):]).read_bytes() == content
    work = tmp_path / "dest" / "work"
    f = work / "a" / "b" / "f.txt"
    assert f.read_text() == "hello\n"
    st = f.stat()
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_nlink) == (0o751, 1000, 1000, 2)
    assert os.getxattr(f, "user.e2b.note") == b"kept"
    assert os.path.samefile(f, work / "hard.txt")
    assert os.readlink(work / "link") == "a/b/f.txt"
    assert (work / "empty").read_bytes() == b""


def test_a_corrupted_byte_is_refused_naming_its_file(tmp_path):
    manifest, parts, images = _source(tmp_path)
    stream = bytearray(b"".join(Packer(manifest, parts)))
    at = stream.index(images[IMAGES + "pages-1.img"][:64]) + 12345
    stream[at] ^= 0xFF
    with pytest.raises(BadStream, match=r"images/pages-1\.img arrived corrupted: its sha256 is"):
        _unpack(bytes(stream), tmp_path / "dest")


def test_a_truncated_stream_is_refused_saying_where_it_ended(tmp_path):
    manifest, parts, _images = _source(tmp_path)
    stream = b"".join(Packer(manifest, parts))
    with pytest.raises(BadStream, match=r"ended after \d+ bytes, inside images/pages-1\.img"):
        _unpack(stream[:2 << 20], tmp_path / "dest")
    with pytest.raises(BadStream, match="the end blocks"):
        _unpack(stream[:-600], tmp_path / "dest2")


def test_members_must_match_the_manifest(tmp_path):
    manifest, parts, _images = _source(tmp_path)
    undeclared = {**manifest, "parts": {k: v for k, v in manifest["parts"].items() if k != WORKDIR}}
    with pytest.raises(BadStream, match="workdir.tar', which its manifest does not declare"):
        _unpack(b"".join(Packer(undeclared, parts)), tmp_path / "d1")
    resized = {**manifest, "parts": {**manifest["parts"], IMAGES + "core-1.img": 5}}
    with pytest.raises(BadStream, match=r"images/core-1\.img has 4 bytes in the stream but 5"):
        _unpack(b"".join(Packer(resized, parts)), tmp_path / "d2")
    with pytest.raises(BadStream, match="lacks workdir.tar"):
        _unpack(b"".join(Packer(manifest, parts[:-1])), tmp_path / "d3")
    escaping = {**manifest, "parts": {"images/../../etc/passwd": 4}}
    with pytest.raises(BadStream, match="declares a part named 'images/../../etc/passwd'"):
        _unpack(b"".join(Packer(escaping, [])), tmp_path / "d4")
    with pytest.raises(BadStream, match="not a move of format"):
        _unpack(b"".join(Packer({**manifest, "format": "k3rl-move/0"}, parts)), tmp_path / "d5")


def test_another_criu_or_kernel_is_refused_naming_both():
    here = host_facts()
    check_host(here)  # the same host: fine
    other = {**here, "criu": "3.17", "kernel": "5.10.0-old"}
    with pytest.raises(BackendUnavailable) as err:
        check_host(other)
    assert f"criu '3.17' there, {here['criu']!r} here" in str(err.value)
    assert f"kernel '5.10.0-old' there, {here['kernel']!r} here" in str(err.value)
    assert "machine" not in str(err.value)
