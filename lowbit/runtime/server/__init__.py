"""`lowbit serve`: an OpenAI-compatible HTTP server over the engine (docs/serve.md).

app.py (Starlette app, uvicorn runner), engine_loop.py (the one thread that owns the Engine),
protocol.py (request validation, response shapes, OpenAI error objects), metrics.py (Prometheus
text), launch.py (CLI values -> ServerConfig and the engine factory). Nothing here touches tensors.
"""
