"""What the sidecar and its clients agree on, in one place: the data routes' paths, the body
types, the shared-memory handshake's layout and fields, and which hosts count as this one.

Both sides import this module and neither side's code: the client (api/client/) must load
without the server (api/server/, api/admin/), and the server must not depend on the client, so
a change to the contract is made here once and both sides see it. tests/test_layers.py keeps
it importing neither. How bodies are framed (msgpack maps with a kv written after a hand-built
prefix) is api/framing.py, which both sides use too.
"""
from __future__ import annotations

import ipaddress
import socket

# The data routes (the data plane's table: api/server/handlers.py `DATA_ROUTES`).
LOOKUP_PATH = "/v1/lookup"
STORE_PATH = "/v1/store"
FETCH_PATH = "/v1/fetch"
STORE_CHUNK_PATH = "/v1/chunks/store"
BLEND_PATH = "/v1/blend"
SHM_PATH = "/v1/shm"  # registers a client's shared-memory arena on the connection

MSGPACK = "application/msgpack"  # every body, unless a request says JSON
JSON = "application/json"

# Same-host shared memory (api/server/shared_memory.py has why each check): the client's memfd
# starts with a secret of SECRET_BYTES, on a page of its own that never holds KV.
SECRET_BYTES = 32
HEADER_BYTES = 4096
SHM_REGISTRATION_FIELDS = ("pid", "fd", "nbytes", "secret")  # POST /v1/shm's body
SHM_REGION_FIELDS = ("offset", "nbytes")  # a request's or answer's "shm": the region the KV is in


def is_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback address: the sidecar then needs
    no auth file to listen there, and a client uses shared memory with it by default."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)
