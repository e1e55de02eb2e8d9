"""Sandbox images: recipes under sandbox_images/<name>/, built into Docker tags named by content hash.

A tag names the hash of its recipe (and its parent's), so an unchanged recipe is never rebuilt and a
changed one gets a new tag while old sandboxes keep the old one. Used by the backends
(`SandboxBackend.resolve_image`) and the `agentenv images` verbs.

Design: docs/design/sandboxes.md#agentenv-backend-images.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import docker

from agentenv.backend import docker_client
from agentenv.errors import BackendUnavailable, ImageError
from agentenv.paths import images_dir

REPOSITORY = "k3rl"
_PARENT = re.compile(r"^\s*ARG\s+BASE\s*=\s*(\S+)\s*$", re.MULTILINE)
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


@dataclass(frozen=True)
class ImageInfo:
    name: str
    tag: str
    built: bool
    size_bytes: int
    created: str
    parent: str | None

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def recipe_names() -> list[str]:
    root = images_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and ((p / "build.sh").is_file() or (p / "Dockerfile").is_file()))


def _recipe_dir(name: str) -> Path:
    if not _NAME.match(name) or name not in recipe_names():
        known = ", ".join(recipe_names()) or "none"
        raise ImageError(f"no image recipe named {name!r} in {images_dir()} (known: {known})")
    return images_dir() / name


def parent_of(name: str) -> str | None:
    dockerfile = _recipe_dir(name) / "Dockerfile"
    if not dockerfile.is_file():
        return None
    m = _PARENT.search(dockerfile.read_text())
    return m.group(1) if m else None


def content_hash(name: str, _seen: tuple[str, ...] = ()) -> str:
    """sha256 over the recipe's files (paths and bytes) and its parent's hash."""
    if name in _seen:
        raise ImageError(f"image recipes form a cycle: {' -> '.join((*_seen, name))}")
    d = _recipe_dir(name)
    h = hashlib.sha256()
    for path in sorted(p for p in d.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(d)).encode() + b"\0" + path.read_bytes() + b"\0")
    parent = parent_of(name)
    if parent:
        h.update(b"parent:" + content_hash(parent, (*_seen, name)).encode())
    return h.hexdigest()


def tag_of(name: str) -> str:
    return f"{REPOSITORY}/{name}:{content_hash(name)[:12]}"


def _local_image(tag: str) -> dict | None:
    try:
        return docker_client.api().inspect_image(tag)
    except docker.errors.ImageNotFound:
        return None
    except docker.errors.APIError as e:
        raise ImageError(f"cannot inspect image {tag}: {e.explanation or e}") from None
    except BackendUnavailable:
        raise
    except Exception as e:  # connection refused and friends
        raise docker_client.unavailable(e) from None


def info(name: str) -> ImageInfo:
    tag = tag_of(name)
    img = _local_image(tag)
    return ImageInfo(name=name, tag=tag, built=img is not None, size_bytes=int(img["Size"]) if img else 0,
                     created=img["Created"] if img else "", parent=parent_of(name))


def list_images() -> list[ImageInfo]:
    return [info(n) for n in recipe_names()]


def resolve(image: str) -> str:
    """A recipe name -> its built tag; otherwise `image` must be a local Docker tag."""
    if image in recipe_names():
        tag = tag_of(image)
        if _local_image(tag) is None:
            raise ImageError(f"image {image!r} ({tag}) is not built; run `agentenv images build {image}`")
        return tag
    if _local_image(image) is None:
        known = ", ".join(recipe_names()) or "none"
        raise ImageError(f"no image {image!r}: not a recipe in {images_dir()} (known: {known}) and no local "
                         "Docker image with that tag")
    return image


def _run(cmd: list[str], quiet: bool, what: str) -> None:
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else sys.stderr,
                              stderr=subprocess.STDOUT, text=True)
    except FileNotFoundError as e:
        raise BackendUnavailable(f"{what}: {e.filename} is not installed; run `make bootstrap`") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout or "").splitlines()[-15:])
        last = f"; last output:\n{tail}" if tail else ""
        raise ImageError(f"{what} failed (exit {proc.returncode}){last}")


def build(name: str = "base", force: bool = False, quiet: bool = False) -> ImageInfo:
    """Build `name` (and its parents) unless its content-hash tag exists already."""
    d = _recipe_dir(name)
    parent = parent_of(name)
    parent_tag = build(parent, force=False, quiet=quiet).tag if parent else None
    tag = tag_of(name)
    if force or _local_image(tag) is None:
        if not quiet:
            print(f"building image {name} as {tag}", file=sys.stderr)
        if (d / "build.sh").is_file():
            # A build.sh recipe with a Dockerfile naming its parent gets the parent's tag as $2.
            args = [tag, parent_tag] if parent_tag else [tag]
            _run(["bash", str(d / "build.sh"), *args], quiet, f"building image {name}")
        else:
            cmd = ["docker", "build", "-t", tag, "--label", f"org.k3rl.image={name}"]
            if parent_tag:
                cmd += ["--build-arg", f"BASE={parent_tag}"]
            _run([*cmd, str(d)], quiet, f"building image {name}")
    try:
        docker_client.api().tag(tag, f"{REPOSITORY}/{name}", "latest")
    except docker.errors.APIError:
        pass
    return info(name)
