"""The HTTP server: the only package that imports starlette, uvicorn and
prometheus_client."""
