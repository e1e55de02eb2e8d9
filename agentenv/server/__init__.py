"""`agentenv serve`: AgentENV sandboxes behind E2B's API, so the official E2B SDKs (and agent frameworks
with an E2B backend) drive them unchanged: control plane (`control.py`), envd's data plane
(`envd_process.py`, `envd_fs.py`), both in one ASGI app (`app.py`) that uvicorn serves (`serve.py`)."""
