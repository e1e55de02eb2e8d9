"""Measure pause and resume of a sandbox holding ~100 MiB (not a test: run it by hand).

    .venv/bin/python tests/agentenv/measure_pause_resume.py [--mib 100] [--runs 3]

A Python process in the sandbox allocates and touches a bytearray of --mib MiB; the script then times
`Sandbox.pause()` and `Sandbox.resume()` --runs times and prints one row per run plus the checkpoint
size and the RSS before/after, using a private $AGENTENV_HOME that it removes at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("AGENTENV_HOME", tempfile.mkdtemp(prefix="agentenv-measure-"))
    from agentenv import Sandbox

    sb = Sandbox.create(memory=f"{args.mib * 2 + 256}m")
    try:
        sb.exec(f"nohup python3 -c 'import time; b = bytearray({args.mib} * 2**20)\n"
                "for i in range(0, len(b), 4096): b[i] = 1\nopen(\"/tmp/ready\", \"w\").close()\n"
                "while True: time.sleep(1)' >/dev/null 2>&1 &")
        while sb.exec("test -e /tmp/ready").exit_code != 0:
            time.sleep(0.1)
        print(f"sandbox {sb.id} (user {sb.user}) holds {sb.stats().rss_bytes / 2**20:.1f} MiB RSS")
        pauses, resumes = [], []
        for run in range(1, args.runs + 1):
            t0 = time.perf_counter()
            sb.pause()
            pauses.append(time.perf_counter() - t0)
            paused = sb.stats()
            t0 = time.perf_counter()
            sb.resume()
            resumes.append(time.perf_counter() - t0)
            print(f"run {run}: pause {pauses[-1]:.2f} s  resume {resumes[-1]:.2f} s  "
                  f"(paused RSS {paused.rss_bytes} B, checkpoint {paused.checkpoint_bytes / 2**20:.1f} MiB, "
                  f"RSS after resume {sb.stats().rss_bytes / 2**20:.1f} MiB)")
        print(f"median: pause {statistics.median(pauses):.2f} s, resume {statistics.median(resumes):.2f} s")
    finally:
        sb.close()


if __name__ == "__main__":
    main()
