"""KV events: the store's pages as vLLM's `BlockStored`/`BlockRemoved`/`AllBlocksCleared`
(docs/kv_events.md), one feature in one package, from the store's report to a subscriber.

    recorder.py    the store reports every ready page entering or leaving a tier (under its lock)
    wire.py        the events on vLLM's wire: the structs, their msgpack encoding, `decode_batch`
    packing.py     the recorder's records packed straight into a `KVEventBatch` payload
    log.py         an in-process sink that keeps the events (the vLLM connector's in-process source)
    publisher.py   the sidecar's ZeroMQ PUB and replay ROUTER (`kvstore serve --kv-events-endpoint`)
    subscriber.py  a reader of a sidecar's stream, with replays to fill gaps (the connector's)

The store imports only the recorder; nothing here imports the sidecar, so an embedder can
publish its store's events without it.
"""
