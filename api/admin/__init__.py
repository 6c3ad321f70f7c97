"""The sidecar's admin routes, as aiohttp serves them: the app that holds the data plane and
answers models, stats, metrics, OpenAPI and health (app.py, routes.py, handlers.py), its
middleware chain, how admin bodies are read and answered (body.py, wire.py), what a handler
reaches through its request (context.py), and the listening site every connection enters by
(connection_limit.py). Nothing here imports the client (api/client/).
"""
