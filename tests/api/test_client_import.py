"""A sidecar's client is light: importing it loads no tier, no store, no LMDB and no redis-py,
so an engine process that only talks to a sidecar pays for none of them; nor any of the
sidecar's server (api/server/, api/admin/: aiohttp, the data plane) or the proxy. Each import
runs in a fresh interpreter, where nothing else has loaded them first."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("kvstore.tiers", "kvstore.store", "kvstore.tier_stack", "kvstore.placement", "lmdb", "redis", "hiredis",
         "kvstore.api.server", "kvstore.api.admin", "kvstore.api.proxy", "aiohttp", "prometheus_client")


def loaded_after(statement: str) -> list[str]:
    probe = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("statement", ["import kvstore.api.client", "from kvstore import KVStoreClient",
                                       "from kvstore.api import AsyncKVStoreClient"])
def test_importing_the_client_loads_no_tier_store_lmdb_redis_or_server(statement: str) -> None:
    modules = loaded_after(statement)
    assert "kvstore.api.client.sync_client" in modules  # the import did load the client
    heavy = [m for m in modules if m in HEAVY or m.startswith(tuple(f"{h}." for h in HEAVY))]
    assert not heavy, f"{statement!r} loads {heavy}"

