"""Open the disk tier's LMDB environment, or move a damaged one aside and start empty.

LMDB keeps no checksums of its own pages, and it trusts every byte of them: a damaged value
size or overflow page number in a leaf of `data` sends the first read of that value off the end
of data.mdb (SIGBUS) or off the map (SIGSEGV), and a damaged free-list record does the same to
the first write that allocates a page. A cache may lose pages, but it must neither serve wrong
KV, nor die on its own files, nor refuse to start (a sidecar that crash-loops on its own data dir
takes the engine's cache down with it). So at start, a child process:

1. verifies the file offline with py-lmdb's pure-Python structural verifier (`lmdb.verify`:
   plain reads, never the map, so hostile bytes cannot crash it): both meta pages, every page
   reachable from the roots stores its own number and flags and is reachable once, every node
   and every value lies inside its page or inside an overflow extent that lies inside the file
   and whose header agrees with the node, and the free list is well formed and disjoint from the
   live pages; this is what makes every later read and write of LMDB stay inside the file;
2. then opens the environment read-only through LMDB and walks both sub-databases (all of
   `meta` with values, the keys of `data`), as the engine itself would.

Any problem, or the child dying by a signal, marks the environment damaged: it is renamed to
`<path>.corrupt-<UTC timestamp>` (kept for a post-mortem, never read again) with an error log
line, and a fresh empty one is created. Damage inside record payloads is not this module's
business: the payload checksums catch it per record (tiers/disk_record.py). What the check costs
at start is in docs/reliability.md.
"""
from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import time

import lmdb
import lmdb.verify as lmdb_verify

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
    # The child imports the kvstore this process runs: put the folder that holds the `kvstore`
    # package first on its path (site-packages when installed, the checkout when editable), never
    # the package folder itself, whose modules would be found there as top-level modules and
    # shadow any of the same name (the standard library's, an installed package's).
    import kvstore

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvstore.__file__)))
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
    """Verify the environment's structure, then read every B-tree page through LMDB (in this
    process). None if all of it holds."""
    problem = verify_structure(path)
    if problem is not None:
        return problem
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


def verify_structure(path: str, shown: int = 3) -> str | None:
    """py-lmdb's offline verifier over `path`/data.mdb: None, or its first findings."""
    try:
        problems = lmdb_verify.verify(path, subdir=True)
    except lmdb_verify.VerifyError as exc:
        return f"lmdb.verify: {exc}"
    except (OSError, ValueError, struct.error, IndexError, MemoryError, OverflowError) as exc:
        # too short or too odd to walk
        return f"lmdb.verify: {type(exc).__name__}: {exc}"
    if not problems:
        return None
    more = f" (and {len(problems) - shown} more)" if len(problems) > shown else ""
    return "lmdb.verify: " + "; ".join(problems[:shown]) + more


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
