"""kvstore: a tiered KV-cache store for LLM inference.

    from kvstore import KVStore, StoreConfig, ModelSpec               # in-process
    from kvstore import KVStoreClient, AsyncKVStoreClient             # a running sidecar
"""
from kvstore.config import ModelSpec, StoreConfig
from kvstore.errors import KVStoreError

__all__ = ["KVStore", "StoreConfig", "ModelSpec", "KVStoreError", "KVStoreClient", "AsyncKVStoreClient"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # KVStore pulls in torch and lmdb; import it lazily so `kvstore.keys` and friends stay light.
    if name == "KVStore":
        from kvstore.store import KVStore

        return KVStore
    if name in ("KVStoreClient", "AsyncKVStoreClient"):
        from kvstore.api import client

        return getattr(client, name)
    if name in ("StoreResult", "LookupResult", "FetchResult", "BlendResult"):
        from kvstore import results

        return getattr(results, name)
    raise AttributeError(name)
