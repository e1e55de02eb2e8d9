"""Measure pause and resume of a sandbox holding ~100 MiB (not a test: run it by hand).

    .venv/bin/python tests/agentenv/measure_pause_resume.py [--mib 100] [--runs 3]

A Python process allocates and touches a bytearray of --mib MiB, once in an AgentENV sandbox and once in
a plain container of the same image (the baseline: bare `docker checkpoint create` / `start
--checkpoint` through the API, no AgentENV). Runs alternate between the two, so both see the same load;
the table gives each run and the medians with the ratio AgentENV / baseline. A private $AGENTENV_HOME
is used and everything is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import tempfile
import time

HOG = ("import time; b = bytearray({mib} * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
       "open('/tmp/ready', 'w').close()\nwhile True: time.sleep(1)")


def _wait_ready(run) -> None:
    while run("test -e /tmp/ready") != 0:
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    home = tempfile.mkdtemp(prefix="agentenv-measure-")
    os.environ["AGENTENV_HOME"] = home
    from agentenv import Sandbox
    from agentenv.backend import docker_client
    from agentenv.backend.docker_criu import RESTORE_NONCE_FILE, remove_containerd_copies
    from agentenv.sandbox import runtime

    api = docker_client.api()
    backend = runtime().backend
    memory = f"{args.mib * 2 + 256}m"
    sb = Sandbox.create(memory=memory)
    base = api.create_container(sb.image, command=["python3", "-c", HOG.format(mib=args.mib)],
                                host_config=api.create_host_config(network_mode="none", mem_limit=memory,
                                                                   tmpfs={"/tmp": ""}))["Id"]
    try:
        api.start(base)
        sb.exec(f"nohup python3 -c \"{HOG.format(mib=args.mib)}\" >/dev/null 2>&1 &")
        _wait_ready(lambda c: sb.exec(c).exit_code)
        _wait_ready(lambda c: _exit_code(api, base, c))
        print(f"sandbox {sb.id} (user {sb.user}) holds {sb.stats().rss_bytes / 2**20:.1f} MiB RSS")
        rows = []
        for run in range(1, args.runs + 1):
            t0 = time.perf_counter()
            sb.pause()
            pause = time.perf_counter() - t0
            paused = sb.stats()
            t0 = time.perf_counter()
            sb.resume()
            resume = time.perf_counter() - t0
            name = f"base-{run}"
            t0 = time.perf_counter()
            api._raise_for_status(api._post_json(api._url("/containers/{0}/checkpoints", base),
                                                 data={"CheckpointID": name, "Exit": True}))
            b_pause = time.perf_counter() - t0
            # tag the folder so that the copy containerd leaves in its TMPDIR can be deleted afterwards
            nonce = secrets.token_hex(8)
            (backend.docker_root() / "containers" / base / "checkpoints" / name / RESTORE_NONCE_FILE) \
                .write_text(nonce)
            t0 = time.perf_counter()
            api._raise_for_status(api._post(api._url("/containers/{0}/start", base),
                                            params={"checkpoint": name}))
            b_resume = time.perf_counter() - t0
            remove_containerd_copies(nonce=nonce)
            rows.append((pause, resume, b_pause, b_resume))
            print(f"run {run}: AgentENV pause {pause:.2f} s resume {resume:.2f} s | baseline pause "
                  f"{b_pause:.2f} s resume {b_resume:.2f} s (paused RSS {paused.rss_bytes} B, checkpoint "
                  f"{paused.checkpoint_bytes / 2**20:.1f} MiB)")
        med = [statistics.median(col) for col in zip(*rows, strict=True)]
        print(f"median: AgentENV pause {med[0]:.2f} s resume {med[1]:.2f} s | baseline pause {med[2]:.2f} s "
              f"resume {med[3]:.2f} s | ratio pause {med[0] / med[2]:.2f}x resume {med[1] / med[3]:.2f}x")
    finally:
        sb.close()
        api.remove_container(base, force=True)
        shutil.rmtree(home, ignore_errors=True)


def _exit_code(api, container: str, cmd: str) -> int:
    exec_id = api.exec_create(container, ["sh", "-c", cmd])["Id"]
    api.exec_start(exec_id)
    return int(api.exec_inspect(exec_id)["ExitCode"])


if __name__ == "__main__":
    main()
