"""`criu_log.error_lines`: a failed dump or restore is quoted by its first error (the cause), then its last
ones; lines every run logs as errors are skipped; an unreadable log says nothing."""

from __future__ import annotations

from agentenv.backend import criu_log

LOG = """(00.001) Warn  (criu/kerndat.c:1): Unable to create tun: Operation not permitted
(00.010) Error (criu/files-reg.c:2132): Can't open file tmp/x on restore: No such file or directory
(00.011) Error (criu/files.c:1207): Unable to open fd=3 id=0x7
(00.012) Error (criu/cr-restore.c:2412): Restoring FAILED.
(00.013) Error (criu/cgroup.c:1970): cgroupd: recv req error: No such file or directory
"""


def test_the_first_error_is_quoted_with_the_last_ones(tmp_path):
    log = tmp_path / "restore.log"
    log.write_text(LOG)
    assert criu_log.error_lines(log, limit=3) == [
        "Can't open file tmp/x on restore: No such file or directory",
        "Restoring FAILED.",
        "cgroupd: recv req error: No such file or directory",
    ]
    first = "Can't open file tmp/x on restore: No such file or directory"
    assert criu_log.error_lines(log, limit=1) == [first]
    assert len(criu_log.error_lines(log, limit=10)) == 4  # all, in order
    skipped = criu_log.error_lines(log, limit=10, skip=("cgroupd",))
    assert skipped[-1] == "Restoring FAILED." and len(skipped) == 3
    assert criu_log.explain(log, limit=2).startswith("; CRIU says: Can't open file tmp/x")
    assert criu_log.error_lines(tmp_path / "missing.log") == [] and criu_log.explain(None) == ""
