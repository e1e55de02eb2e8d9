"""Create the containers a fork restores into: same configuration as the source, copies of its files.

CRIU images hold memory, not files (docker/cli #4621), and CRIU refuses to restore a process whose open
files changed size. So a fork container gets the source's configuration, a copy of its writable root
layer and a copy of every Docker volume it mounts (the AgentENV workspace is one), taken while the
source is checkpointed (stopped), so files and memory belong to the same moment.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from typing import Any

import docker

from agentenv.fastpath.errors import CheckpointError

FORK_LABEL = "org.k3rl.agentenv.fork-of"


def _copy_tree(src: str, dst: str) -> None:
    """`cp -a src/. dst/`: keeps owners, modes, xattrs (overlay whiteouts and opaque dirs), hard links."""
    r = subprocess.run(["cp", "-a", "--", f"{src}/.", f"{dst}/"], capture_output=True, text=True)
    if r.returncode != 0:
        raise CheckpointError(
            f"copying the source's files for a fork failed ({src} -> {dst}): {r.stderr.strip()}"
        )


def _volume_renames(api: docker.APIClient, source: dict[str, Any], suffix: str) -> dict[str, str]:
    """Create a fresh named volume for every named volume of the source: {old name: new name}."""
    renames: dict[str, str] = {}
    host = source["HostConfig"]
    named = {b.split(":", 1)[0] for b in host.get("Binds") or [] if not b.startswith("/")}
    named |= {
        m.get("Source") for m in host.get("Mounts") or [] if m.get("Type") == "volume" and m.get("Source")
    }
    for m in source.get("Mounts") or []:
        if m.get("Type") == "volume" and m.get("Name") in named:
            info = api.inspect_volume(m["Name"])
            new = f"{m['Name']}.{suffix}"
            api.create_volume(name=new, driver=info.get("Driver", "local"), labels=info.get("Labels") or {})
            renames[m["Name"]] = new
    return renames


def _rename_bind(bind: str, renames: dict[str, str]) -> str:
    name, sep, rest = bind.partition(":")
    return renames.get(name, name) + sep + rest


def clone_container(
    api: docker.APIClient,
    source: dict[str, Any],
    name: str | None = None,
    labels: dict[str, str] | None = None,
) -> str:
    """Create (not start) a copy of the container `source` (its `docker inspect`); returns the new id.

    The source must be stopped (checkpointed): its writable layer and volumes are copied as they are.
    """
    suffix = "fork-" + uuid.uuid4().hex[:10]
    renames = _volume_renames(api, source, suffix)
    config = dict(source["Config"])
    config["Image"] = source["Image"]  # the image id: a retagged image must not change the fork's files
    config["Labels"] = {**(config.get("Labels") or {}), **(labels or {}), FORK_LABEL: source["Id"]}
    host = dict(source["HostConfig"])
    host["Binds"] = [_rename_bind(b, renames) for b in host.get("Binds") or []] or None
    if host.get("Mounts"):
        host["Mounts"] = [
            {**m, "Source": renames.get(m.get("Source"), m.get("Source"))} if m.get("Type") == "volume" else m
            for m in host["Mounts"]
        ]
    config["HostConfig"] = host
    try:
        new_id = api.create_container_from_config(config, name=name)["Id"]
    except docker.errors.APIError as e:
        for vol in renames.values():
            _remove_volume(api, vol)
        raise CheckpointError(
            f"creating a fork container of {source['Id'][:12]} failed: {e.explanation}"
        ) from None
    try:
        new = api.inspect_container(new_id)
        _copy_tree(source["GraphDriver"]["Data"]["UpperDir"], new["GraphDriver"]["Data"]["UpperDir"])
        new_mounts = {m["Destination"]: m for m in new.get("Mounts") or []}
        for m in source.get("Mounts") or []:
            target = new_mounts.get(m["Destination"])
            if m.get("Type") == "volume" and target is not None and target.get("Name") != m.get("Name"):
                _copy_tree(m["Source"], target["Source"])
    except BaseException:
        remove_container(api, new_id)
        raise
    return new_id


def _remove_volume(api: docker.APIClient, name: str) -> None:
    try:
        api.remove_volume(name, force=True)
    except docker.errors.APIError:
        pass


def remove_container(api: docker.APIClient, container_id: str) -> None:
    """Remove a container and the volumes it was given as a fork (anonymous ones go with it)."""
    try:
        info = api.inspect_container(container_id)
    except docker.errors.NotFound:
        return
    volumes = [
        m["Name"] for m in info.get("Mounts") or [] if m.get("Type") == "volume" and ".fork-" in m["Name"]
    ]
    try:
        api.remove_container(container_id, force=True, v=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:  # someone else (a gc, another process) is removing it already
        if e.status_code != 409 or "already in progress" not in str(e.explanation):
            raise
    for vol in volumes:
        _remove_volume(api, vol)


def upper_dir(info: dict[str, Any]) -> Path | None:
    data = (info.get("GraphDriver") or {}).get("Data") or {}
    return Path(data["UpperDir"]) if data.get("UpperDir") else None
