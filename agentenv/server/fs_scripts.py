"""The Python programs `fsops` runs inside a sandbox (its image's python3) to describe and write files.

One exec per call: the shell prologue of `fsops` confines the path to the work dir first, then one of
these runs with the path as argv[1]. Entries are printed as one JSON document on stdout, so names with
any bytes (newlines, tabs) survive; file metadata is the `user.e2b.*` extended attributes, as envd keeps
it (E2B's `files.write(metadata=...)`, envd >= 0.6.2).
"""

from __future__ import annotations

from agentenv.files import EXIT_MISSING, EXIT_NOT_DIR

# Shared by both programs: the entry of one path, as envd's EntryInfo.
_ENTRY = r"""
import grp, json, os, pwd, stat, sys
XATTR = "user.e2b."

def meta(p):
    out = {}
    try:
        for k in os.listxattr(p, follow_symlinks=False):
            if k.startswith(XATTR):
                out[k[len(XATTR):]] = os.getxattr(p, k, follow_symlinks=False).decode("utf-8", "replace")
    except OSError:
        pass
    return out

def name_of(table, n):
    try:
        return table(n)[0]
    except KeyError:
        return str(n)

def entry(p):
    st = os.lstat(p)
    link = stat.S_ISLNK(st.st_mode)
    t = st
    if link:
        try:
            t = os.stat(p)
        except OSError:
            t = None
    kind = "other" if t is None else "dir" if stat.S_ISDIR(t.st_mode) else (
        "file" if stat.S_ISREG(t.st_mode) else "other")
    return {"name": os.path.basename(p.rstrip("/")) or p, "type": kind, "is_symlink": link, "path": p,
            "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "permissions": stat.filemode(st.st_mode),
            "owner": name_of(pwd.getpwuid, st.st_uid), "group": name_of(grp.getgrgid, st.st_gid),
            "mtime": st.st_mtime, "symlink_target": os.path.realpath(p) if link else None,
            "metadata": meta(p)}
"""

# argv: path, depth (0: the path itself). Exit EXIT_MISSING / EXIT_NOT_DIR as the shell checks did.
DESCRIBE = _ENTRY + rf"""
p, depth = sys.argv[1], int(sys.argv[2])
if not os.path.lexists(p):
    sys.exit({EXIT_MISSING})
if depth == 0:
    out = [entry(p)]
else:
    if not os.path.isdir(p):
        sys.exit({EXIT_NOT_DIR})
    out = []
    def walk(d, left):
        for e in sorted(os.scandir(d), key=lambda e: e.name):
            out.append(entry(e.path))
            if left > 1 and e.is_dir(follow_symlinks=False):
                walk(e.path, left - 1)
    walk(p, depth)
json.dump(out, sys.stdout)
"""

# argv: path, metadata as JSON; the file's bytes on stdin. Parents are made; an existing file is
# overwritten in place (a symlink is written through) and loses the metadata it had, as envd's upload.
WRITE = _ENTRY + r"""
p, new = sys.argv[1], json.loads(sys.argv[2])
os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
with open(p, "wb") as f:
    while True:
        chunk = sys.stdin.buffer.read(1 << 20)
        if not chunk:
            break
        f.write(chunk)
os.chown(p, os.getuid(), os.getgid())  # the file is the user's, as envd hands it over (an attrib event)
for k in os.listxattr(p):
    if k.startswith(XATTR):
        os.removexattr(p, k)
for k, v in new.items():
    os.setxattr(p, XATTR + k, v.encode())
json.dump([entry(p)], sys.stdout)
"""
