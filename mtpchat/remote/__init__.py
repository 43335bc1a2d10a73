"""mtpchat as a client of an OpenAI-compatible server (vLLM, SGLang, `mtpchat serve`, others).

client.py speaks HTTP and server-sent events; metrics.py reads the server's speculative decoding
figures (per request where the response carries them, else its Prometheus /metrics before and after
the request); engine.py puts both behind the Engine API, so the app and `run` drive a server as
they drive the in-process engine. Nothing here imports httpx at module import time.
"""
