"""`KVStoreConnector` whose tensor-parallel ranks but the first fail every store of requests
salted "rank-fault": a rank that fails mid-prompt, for tests/integrations/test_vllm_tensor_parallel.py
and bench/vllm_tp.py. vLLM loads it by module path in every worker process
(kv_connector_module_path="bench.reliability.rank_fault_connector", the repository on PYTHONPATH).
The failure takes the link's own path (StoreLink._call: a warning, no store), as a sidecar that
resets the rank's connection would."""
from __future__ import annotations

from typing import Any

from kvstore.integrations import vllm as connector

FAULT_SALT = "rank-fault"


class KVStoreConnector(connector.KVStoreConnector):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.worker is not None and self.rank.heads is not None and self.rank.heads[0] > 0:
            worker = self.worker
            store = worker._store

            def fail(backend: Any) -> None:
                raise ConnectionResetError("injected: this rank's store failed mid-prompt")

            def failing_store(save: Any) -> None:
                if save.spec.salt != FAULT_SALT:
                    return store(save)
                assert worker.link is not None
                assert worker.link._call("store", save.spec.salt, fail) is None  # the link's own failure path

            worker._store = failing_store
