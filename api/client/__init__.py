"""Python clients of the sidecar: `KVStoreClient` (sync: sync_client.py) and
`AsyncKVStoreClient` (asyncio: async_client.py), with what they put on the wire (codec.py), their
HTTP/1.1 connection (http1.py) and their half of same-host shared memory (arena.py).

Nothing here imports the server (api/server/, api/admin/): what both sides agree on is
api/protocol.py, and how bodies are framed api/framing.py. Importing the client loads no
aiohttp, no tier and no store (tests/api/test_client_import.py).
"""
from kvstore.api.client.async_client import AsyncKVStoreClient
from kvstore.api.client.sync_client import KVStoreClient

__all__ = ["KVStoreClient", "AsyncKVStoreClient"]
