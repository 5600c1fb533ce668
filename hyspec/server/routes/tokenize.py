"""POST /tokenize (a prompt or chat messages -> ids) and POST /detokenize (ids -> text)."""

from __future__ import annotations

import asyncio

from fastapi import Request

from hyspec.server import schemas
from hyspec.server.errors import parse_body
from hyspec.server.params import UNSUPPORTED_CHAT, bad, refuse_unsupported
from hyspec.tools import ToolError, check_tools


def register(app, state) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await parse_body(request, schemas.TokenizeRequest)
        state.check_model(req.model)
        refuse_unsupported(req, [f for f in UNSUPPORTED_CHAT if f[0] in ("chat_template", "continue_final_message")])
        if (req.prompt is None) == (req.messages is None):
            raise bad("give exactly one of prompt or messages", "prompt")
        if req.prompt is not None and (req.tools is not None or req.chat_template_kwargs is not None):
            raise bad("tools and chat_template_kwargs go with messages, not with a prompt", "prompt")
        if req.tools is not None:  # the same checks as the chat route's
            try:
                check_tools(req.tools)
            except ToolError as e:
                raise bad(str(e), e.param) from None
        text = req.prompt if req.prompt is not None else await asyncio.to_thread(  # (off the event loop)
            state.render_chat, req.messages, bool(req.add_generation_prompt), req.tools, req.chat_template_kwargs)
        ids = await asyncio.to_thread(state.tokenizer.encode, text)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.limits.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await parse_body(request, schemas.DetokenizeRequest)
        state.check_model(req.model)
        vocab_size = state.limits.vocab_size
        out_of_range = [t for t in req.tokens if not 0 <= t < vocab_size]
        if out_of_range:
            raise bad(f"token id(s) {out_of_range[:5]} out of range for vocabulary size {vocab_size}", "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}
