"""KVLookup: a multi-turn task whose sandbox holds heavy state, a key-value service with ``data_mib`` MiB
of data loaded in memory, so that pausing (CRIU to disk) and forking sandboxes pay off.

The sandbox (built once per sandbox, or once per pool template with warm starts):

- ``install()`` generates the data set under ``/workspace/kv/data``: ``data_mib`` MiB of records of
  16 bytes in 16 MiB shards, drawn deterministically from ``data_seed``, and an ``index.json`` with the
  SHA-256 of every shard (seconds for 200 MiB);
- then it starts the KV service, a detached Python process (``setsid``, stdio to ``/dev/null``, no pipe
  to Docker) that reads every shard into one in-memory table (``data_mib`` MiB of resident memory),
  checks the hashes against the index, and answers requests on two FIFOs, ``/workspace/kv/req`` (held
  open by the service: a request is one line) and ``/workspace/kv/resp`` (opened per answer). A request
  is a ``printf`` and a ``cat`` in the task's shell session, a few ms, with no interpreter to start and
  no socket: CRIU dumps the FIFOs with the process, a fork gets them with its copy of /workspace, and
  every fork serves the same table. The service draws no random number after loading, so forks answer
  alike.

An episode: ``reset(seed)`` picks a key of the table from the seed (cheap: the data is already loaded)
and shows it, ``key 5820431: 0-5``. The hidden number is the value stored under that key modulo
``num_values``; only the service in the sandbox knows it. Each action is a guess (the first run of digits
in the action text), answered as GuessNumber does: ``higher LOW-HIGH``, ``lower LOW-HIGH`` (the numbers
every answer so far still allows) or ``correct``; an action without a number is ``invalid``.

Why the agent must read the sandbox: the stored values are uniform random bytes, so the hidden number is
uniform over ``0..num_values-1`` whatever the key; a policy that ignores the observations plays a fixed
list of at most ``max_turns`` distinct guesses and wins **at most max_turns / num_values = 0.5** of the
games with the defaults (``num_values = 6``, ``max_turns = 3``). Binary search on the answers always wins
(3 answers single out one of up to 7 values). Actions are one digit and the end-of-turn token.
"""

from __future__ import annotations

import random
import re
import shlex

from agentenv.tasks.base import Outcome, SandboxTask

KV_DIR = "/workspace/kv"
RECORD_BYTES = 16

GENERATE_SCRIPT = r'''"""gen.py SEED MIB DIR: the data set, MIB MiB of 16-byte records in 16 MiB shards, and
DIR/index.json (record count, the SHA-256 of every shard)."""
import hashlib
import json
import os
import random
import sys

seed, mib, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
shard_bytes, total = 16 << 20, mib << 20
os.makedirs(out, exist_ok=True)
shards = []
for i, start in enumerate(range(0, total, shard_bytes)):
    data = random.Random(f"kvlookup:{seed}:{i}").randbytes(min(shard_bytes, total - start))
    name = f"shard-{i:04d}.bin"
    with open(os.path.join(out, name), "wb") as f:
        f.write(data)
    shards.append({"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
index = {"seed": seed, "mib": mib, "record_bytes": 16, "records": total // 16, "shards": shards}
with open(os.path.join(out, "index.json"), "w") as f:
    json.dump(index, f)
print(f"generated {len(shards)} shards, {total} bytes")
'''

SERVER_SCRIPT = r'''"""server.py DIR: loads DIR/data in memory, answers on the FIFOs DIR/req and DIR/resp.

A request is one line "ID WORDS" written to DIR/req; the answer "ID TEXT" is written to DIR/resp for the
client that opened it for reading. "info" -> "records R seed S mib M boot B"; "cmp KEY N GUESS" ->
"higher", "lower" or "correct" (GUESS against the value under KEY modulo N). DIR/status says "ready PID"
once serving, or "error: ..." when loading failed.
"""
import errno
import hashlib
import json
import os
import sys
import time

base = sys.argv[1]


def status(text):
    tmp = os.path.join(base, "status.tmp")
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, os.path.join(base, "status"))


try:
    with open(os.path.join(base, "data", "index.json")) as f:
        index = json.load(f)
    table = bytearray(index["records"] * index["record_bytes"])
    view, pos = memoryview(table), 0
    for shard in index["shards"]:
        part = view[pos:pos + shard["bytes"]]
        with open(os.path.join(base, "data", shard["file"]), "rb") as f:
            if f.readinto(part) != shard["bytes"]:
                raise ValueError(f"{shard['file']} is shorter than the index says")
        if hashlib.sha256(part).hexdigest() != shard["sha256"]:
            raise ValueError(f"{shard['file']} does not match its SHA-256 in index.json")
        pos += shard["bytes"]
    del view, part
    records, width = index["records"], index["record_bytes"]
    boot = os.urandom(8).hex()  # drawn once, before any fork: every fork of this service reports it
    info = f"records {records} seed {index['seed']} mib {index['mib']} boot {boot}"
    req, resp = os.path.join(base, "req"), os.path.join(base, "resp")
    for path in (req, resp):
        if os.path.exists(path):
            os.unlink(path)
        os.mkfifo(path, 0o600)
    requests = os.open(req, os.O_RDWR)  # held open: a read waits for the next request, never sees EOF
except Exception as e:
    status(f"error: {type(e).__name__}: {e}")
    sys.exit(1)


def answer(words):
    if words == ["info"]:
        return info
    if len(words) == 4 and words[0] == "cmp" and all(w.isdigit() for w in words[1:]):
        key, n, guess = int(words[1]), int(words[2]), int(words[3])
        if key >= records or n < 1:
            return f"error: key {key} not in 0..{records - 1} or modulus {n} < 1"
        value = int.from_bytes(table[key * width:key * width + 4], "little") % n
        return "correct" if guess == value else ("higher" if guess < value else "lower")
    return f"error: bad request {' '.join(words)[:60]!r}"


def reply(text):
    """Write text to the client reading resp (waits up to 5 s for it to open; else drops the answer)."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            fd = os.open(resp, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() > deadline:
                return
            time.sleep(0.001)
    try:
        os.write(fd, text.encode())
    except OSError:
        pass
    finally:
        os.close(fd)


status(f"ready {os.getpid()}")
pending = b""
while True:
    pending += os.read(requests, 4096)
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        request_id, *words = line.decode(errors="replace").split() or [""]
        reply(f"{request_id} {answer(words)}\n")
'''

_NUMBER = re.compile(r"\d+")
_INFO = re.compile(r"^records (\d+) seed (\d+) mib (\d+) boot ([0-9a-f]+)$")


class KVLookup(SandboxTask):
    """Find the value stored under a key of the sandbox's in-memory KV service with higher/lower answers
    (see the module docstring).

    Task kwargs: ``data_mib`` (size of the loaded table; conf/env/kv_lookup.yaml sets 200, the small code
    default keeps a bare ``gymnasium.make`` quick), ``data_seed`` (which data: the template's
    seed), ``num_values``/``max_turns`` (the game), ``invalid_penalty``/``ruled_out_penalty`` (shaping,
    as in GuessNumber), ``install_timeout_s`` (generation plus loading)."""

    in_place_reset = (
        "an action reaches the sandbox only as a `cmp KEY N GUESS` request of three integers to the KV "
        "service, which answers without changing anything, and setup only picks the key: no episode can "
        "leave a file, a process or a variable (a restore would reload data_mib MiB for nothing)"
    )

    def __init__(self, data_mib: int = 16, data_seed: int = 0, num_values: int = 6, max_turns: int = 3,
                 invalid_penalty: float = 0.1, ruled_out_penalty: float = 0.0,
                 install_timeout_s: float = 600.0, **kwargs):
        if not isinstance(data_mib, int) or not 1 <= data_mib <= 4096:
            raise ValueError(f"data_mib must be an integer in 1..4096 (MiB of data in the service), "
                             f"got {data_mib!r}")
        if not isinstance(data_seed, int) or data_seed < 0:
            raise ValueError(f"data_seed must be a non-negative integer, got {data_seed!r}")
        if not 2 <= num_values <= 1000:
            raise ValueError(f"num_values must be in 2..1000, got {num_values}")
        if install_timeout_s <= 0:
            raise ValueError(f"install_timeout_s must be > 0, got {install_timeout_s}")
        super().__init__(max_turns=max_turns, **kwargs)
        self.data_mib, self.data_seed = data_mib, data_seed
        self.num_records = (data_mib << 20) // RECORD_BYTES
        self.num_values = num_values
        self.invalid_penalty = invalid_penalty
        self.ruled_out_penalty = ruled_out_penalty
        self.install_timeout_s = install_timeout_s
        self.key = 0
        self._requests = 0
        self.service_boot = ""  # the loaded service's boot id: equal in a template and all its forks
        self._low, self._high = 0, num_values - 1

    # ------------------------------------------------------------------------------ the sandbox
    def install(self) -> None:
        """Generate the data set (seconds), then start the KV service and wait until it has loaded it."""
        for name, text in (("gen.py", GENERATE_SCRIPT), ("server.py", SERVER_SCRIPT)):
            self.sandbox.write_file(f"{KV_DIR}/{name}", text)
        generated = self.run(f"python3 -S {KV_DIR}/gen.py {self.data_seed} {self.data_mib} {KV_DIR}/data",
                             timeout=self.install_timeout_s)
        if generated.exit_code != 0:
            raise RuntimeError(f"KVLookup: generating the data set failed: "
                               f"{generated.output.strip()[-500:]!r}")
        polls = max(1, int(self.install_timeout_s / 0.1))
        started = self.run(
            f"rm -f {KV_DIR}/status; "
            f"setsid python3 -S {KV_DIR}/server.py {KV_DIR} </dev/null >/dev/null 2>&1 & "
            f"for _ in $(seq {polls}); do [ -s {KV_DIR}/status ] && break; sleep 0.1; done; "
            f"cat {KV_DIR}/status 2>/dev/null || echo 'error: the service wrote no status'",
            timeout=self.install_timeout_s + 10,
        )
        if not started.output.startswith("ready "):
            raise RuntimeError(f"KVLookup: the KV service did not start: {started.output.strip()[-500:]!r}")

    def ask(self, *words: object) -> str:
        """One request to the sandbox's KV service; its one-line answer. The shell writes the request to
        the service's FIFO and reads the answer (a few ms: no interpreter starts per request); the answer
        carries the request's id, so a late answer to an earlier, timed-out request is never taken."""
        self._requests += 1
        request_id = f"r{self._requests}"
        line = shlex.quote(" ".join([request_id, *(str(w) for w in words)]))
        alive = f'read -r _ pid < {KV_DIR}/status && kill -0 "$pid" 2>/dev/null'
        result = self.run(f"{{ {alive}; }} || {{ echo 'the KV service is not running'; exit 3; }}; "
                          f"timeout 10 sh -c 'printf \"%s\\n\" \"$1\" > {KV_DIR}/req && cat {KV_DIR}/resp' "
                          f"sh {line}")
        reply = result.output.strip()
        if result.exit_code != 0 or not reply.startswith(f"{request_id} "):
            request = " ".join(map(str, words))
            try:  # which way it failed: the service died, or it runs and dropped the answer
                state = "is gone" if self.run(f"{alive} || echo gone").output.strip() == "gone" else "runs"
            except Exception as exc:  # noqa: BLE001 - the first failure is the one to report
                state = f"could not be checked ({type(exc).__name__})"
            raise RuntimeError(f"KVLookup: the sandbox's KV service did not answer {request!r} "
                               f"(exit {result.exit_code}: {reply[-200:]!r}); its process {state}")
        reply = reply[len(request_id) + 1:]
        if reply.startswith("error"):
            raise RuntimeError(f"KVLookup: the sandbox's KV service answered {reply!r}")
        return reply

    # ------------------------------------------------------------------------------ the game
    def setup(self, seed: int) -> str:
        match = _INFO.match(self.ask("info"))
        if match is None:
            raise RuntimeError("KVLookup: the sandbox's KV service answered 'info' with an unknown format")
        records, data_seed, mib = (int(g) for g in match.groups()[:3])
        if (records, data_seed, mib) != (self.num_records, self.data_seed, self.data_mib):
            raise RuntimeError(
                f"KVLookup: the sandbox's KV service holds data_seed={data_seed} data_mib={mib}, this env "
                f"wants data_seed={self.data_seed} data_mib={self.data_mib} (a pool template built by "
                f"another KVLookup config?); use one config per pool"
            )
        self.service_boot = match.group(4)
        self.key = random.Random(seed).randrange(self.num_records)
        self._low, self._high = 0, self.num_values - 1
        return f"key {self.key}: 0-{self.num_values - 1}"

    def act(self, action: str) -> Outcome:
        match = _NUMBER.search(action)
        if match is None:
            return Outcome(observation="invalid", info={"valid": False, "ruled_out": False})
        guess = int(match.group(0)[:6])
        word = self.ask("cmp", self.key, self.num_values, guess)
        if word not in ("higher", "lower", "correct"):
            raise RuntimeError(f"KVLookup: the KV service answered {word!r} to a comparison")
        ruled_out = not self._low <= guess <= self._high
        if word == "higher":
            self._low = max(self._low, guess + 1)
        elif word == "lower":
            self._high = min(self._high, guess - 1)
        reply = word if word == "correct" else f"{word} {self._low}-{self._high}"
        info = {"valid": True, "ruled_out": ruled_out}
        return Outcome(observation=reply, success=word == "correct", info=info)

    def reward(self, outcome: Outcome) -> float:
        """1 for the winning guess; penalties for a non-number and for a guess earlier answers ruled out."""
        if outcome.success:
            return 1.0
        if not outcome.info["valid"]:
            return 0.0 - self.invalid_penalty  # 0.0 - x: no -0.0 when a penalty is off
        return 0.0 - self.ruled_out_penalty if outcome.info["ruled_out"] else 0.0
