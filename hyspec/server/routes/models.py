"""GET /v1/models and /v1/models/{name}: the one served model."""

from __future__ import annotations


def model_card(state) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "hyspec",
            "max_model_len": state.limits.max_model_len}


def register(app, state) -> None:
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(state)]}

    @app.get("/v1/models/{name:path}")
    async def model_get(name: str):
        state.check_model(name)
        return model_card(state)
