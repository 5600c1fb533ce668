"""GET (or HEAD) /health (engine kind, prefix-store counters) and GET /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi.responses import Response

PREFIX_STORE_FIELDS = ("entries", "hits", "misses", "tokens_saved", "bytes_device", "bytes_host")


def register(app, state) -> None:
    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: load balancers' probes)
    async def health():
        store = state.worker.store
        counts = None if store is None else store.stats()  # (once: six full scans per probe before)
        return {"status": "ok", "engine": "batched" if state.worker.batched else "sequential",
                "batch_graphs": state.worker.graph_path, "warming_up": state.worker.warming_up,
                "warm_up": None if state.worker.warm_up_ok is None else
                {"ok": state.worker.warm_up_ok, "seconds": state.worker.warm_s},
                "prefix_store": None if counts is None else {k: counts[k] for k in PREFIX_STORE_FIELDS}}

    @app.get("/metrics")
    async def metrics():
        running, waiting = state.worker.counts()
        return Response(state.metrics.render(running, waiting, state.worker.engine_seconds()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")
