"""The sidecar's server: the data plane (every connection read, the data routes answered:
fast_path.py, connection.py, answering.py, handlers.py, wire.py, shared_memory.py), what one
app's requests share (state.py, config.py, auth.py, metrics.py, loop_store.py, catch_up.py),
and how it is served (serve.py: `kvstore serve`; in_process.py: a sidecar on a thread).

Nothing here imports the client (api/client/); the data plane loads no aiohttp (the admin
routes' aiohttp app is api/admin/, which serve.py alone brings in). Empty on purpose: importing
one module of the data plane loads only what it needs.
"""
