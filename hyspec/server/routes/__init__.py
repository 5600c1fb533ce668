"""The HTTP routes, one module per endpoint family; each has `register(app, state)`.

    completions.py   POST /v1/completions
    chat.py          POST /v1/chat/completions
    tokenize.py      POST /tokenize, /detokenize
    models.py        GET /v1/models, /v1/models/{name}
    monitoring.py    GET /health, /metrics
"""

from __future__ import annotations

from hyspec.server.routes import chat, completions, models, monitoring, tokenize


def register_routes(app, state) -> None:
    for module in (monitoring, models, tokenize, completions, chat):
        module.register(app, state)
