"""Open the disk tier's LMDB environment, or move a damaged one aside and start empty.

LMDB keeps no checksums of its own pages: a flipped byte in a meta or B-tree page makes
`lmdb.open` fail, or makes later reads raise `lmdb.Error` (MDB_CORRUPTED, MDB_PAGE_NOTFOUND),
and in the worst case a bogus node size could make a read run off the map and kill the process.
A cache may lose pages, but it must neither serve wrong KV nor refuse to start (a sidecar that
crash-loops on its own data dir takes the engine's cache down with it). So at start:

1. a child process opens the environment read-only and walks every B-tree page of both
   sub-databases (all of `meta` with values, the keys of `data`); LMDB raising, or the child
   dying by a signal, marks the environment damaged;
2. a damaged environment is renamed to `<path>.corrupt-<UTC timestamp>` (kept for a post-mortem,
   never read again) with an error log line, and a fresh empty one is created.

Damage inside record payloads is not this module's business: the payload checksums catch it
per record (tiers/disk_record.py). Running the walk in a child costs ~0.1 s per start plus the
walk itself (it reads only B-tree pages, not payload overflow pages).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import lmdb

log = logging.getLogger("kvstore.disk")

SUBDBS = (b"meta", b"data")
CHECK_TIMEOUT_S = 600.0
_OK = "lmdb-ok"


def open_environment(path: str, map_bytes: int, *, sync: bool, max_readers: int = 512) -> lmdb.Environment:
    """The environment under `path` (created if missing), checked; a damaged one is moved aside."""
    os.makedirs(path, exist_ok=True)
    if os.path.exists(os.path.join(path, "data.mdb")):
        problem = check_in_child(path)
        if problem is not None:
            quarantine(path, problem)
    # sync=False (write-back): a crash of the machine may lose the last commits, never consistency.
    return lmdb.open(path, map_size=map_bytes, max_dbs=len(SUBDBS), subdir=True, sync=sync, metasync=sync,
                     readahead=False, max_readers=max_readers, lock=True)


def check_in_child(path: str) -> str | None:
    """None if the environment opens and every B-tree page reads; else what went wrong."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run([sys.executable, "-m", "kvstore.tiers.disk_open", path], capture_output=True, text=True,
                              env=env, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"integrity walk did not finish in {CHECK_TIMEOUT_S:.0f} s"
    if proc.returncode == 0 and proc.stdout.strip() == _OK:
        return None
    if proc.returncode < 0:
        return f"integrity walk killed by signal {-proc.returncode}"
    return (proc.stdout.strip() or proc.stderr.strip()[-300:] or f"exit status {proc.returncode}")


def walk(path: str) -> str | None:
    """Read every B-tree page of the environment (in this process). None if all of it reads."""
    try:
        env = lmdb.open(path, readonly=True, lock=False, max_dbs=len(SUBDBS), subdir=True)
    except lmdb.Error as exc:
        return f"lmdb.open: {type(exc).__name__}: {exc}"
    try:
        with env.begin() as txn:
            names = {key for key, _ in txn.cursor()}  # the main db lists the sub-databases
            for name in SUBDBS:
                if name not in names:
                    continue  # never written yet (a fresh environment)
                db = env.open_db(name, txn=txn, create=False)
                with txn.cursor(db) as cursor:
                    for _ in (cursor.iternext(keys=True, values=True) if name == b"meta"
                              else cursor.iternext(keys=True, values=False)):
                        pass
        return None
    except lmdb.Error as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        env.close()


def quarantine(path: str, why: str) -> str:
    """Rename the damaged environment aside; returns where it went."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = f"{path.rstrip(os.sep)}.corrupt-{stamp}"
    n = 1
    while os.path.exists(target):
        n += 1
        target = f"{path.rstrip(os.sep)}.corrupt-{stamp}-{n}"
    os.rename(path, target)
    os.makedirs(path)
    log.error("disk tier: LMDB environment %s is damaged (%s); moved to %s, starting with an empty disk tier",
              path, why, target)
    return target


if __name__ == "__main__":
    problem = walk(sys.argv[1])
    print(_OK if problem is None else problem)
    sys.exit(0 if problem is None else 1)
