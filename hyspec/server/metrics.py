"""Prometheus metrics of one server (its own registry, so several servers can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("hyspec_requests_running", "sequences inside the batch", registry=r)
        self.waiting = Gauge("hyspec_requests_waiting", "sequences queued for a batch slot", registry=r)
        self.requests = Counter("hyspec_requests", "finished sequences by finish reason", ["finish_reason"],
                                registry=r)
        self.http_errors = Counter("hyspec_request_errors", "requests answered with an error, by HTTP status",
                                   ["status"], registry=r)
        self.prompt_tokens = Counter("hyspec_prompt_tokens", "prompt tokens of admitted sequences", registry=r)
        self.generation_tokens = Counter("hyspec_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("hyspec_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("hyspec_inter_token_latency_seconds",
                             "time between token deliveries, spread over the tokens of each delivery",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("hyspec_e2e_request_latency_seconds", "request arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # per prompt, as usage counts a prompt once however many samples it has
        self.prefix_queries = Counter("hyspec_prefix_cache_queries", "prompts that looked up the prefix store",
                                      registry=r)
        self.prefix_hits = Counter("hyspec_prefix_cache_hits", "prompts that reused cached prefix tokens",
                                   registry=r)
        self.prefix_cached_tokens = Counter("hyspec_prefix_cache_cached_tokens",
                                            "prompt tokens served from the prefix store (a prompt's most over "
                                            "its samples, as usage's cached_tokens)", registry=r)
        self.spec_drafts = Counter("hyspec_spec_drafts", "speculative rounds (each verifies one draft)", registry=r)
        self.spec_draft_tokens = Counter("hyspec_spec_draft_tokens", "drafted tokens", registry=r)
        self.spec_accepted_tokens = Counter("hyspec_spec_accepted_tokens", "accepted draft tokens", registry=r)
        self.spec_accepted_per_pos = Counter("hyspec_spec_accepted_tokens_per_pos",
                                             "accepted draft tokens by 0-based position in the draft",
                                             ["position"], registry=r)
        self.spec_mean_len = Gauge("hyspec_spec_mean_acceptance_length",
                                   "tokens emitted per speculative round since start (accepted / drafts + 1)",
                                   registry=r)
        self.engine_seconds = Gauge("hyspec_engine_seconds",
                                    "engine-thread wall seconds since start, by part (warm_up; core: engine-core "
                                    "steps; graphs: batched-graph steps, split into graph_prefill and graph_rounds; "
                                    "graph_store lies inside those two, graph_capture inside graph_rounds)",
                                    ["part"], registry=r)
        self._rounds = 0
        self._accepted = 0
        self.prefix_store = True  # the server looks prompts up in a prefix store (--no-prefix-store: False)

    def observe_prefix(self, samples: list[dict]) -> None:
        """One prompt's prefix-store figures, from the stats of its finished samples: a query
        when any of them ran (not cancelled in the queue, not refused), its cached tokens the
        most any reused (the n samples of one prompt counted once, as in usage: per sample,
        cached tokens outgrew the prompt tokens counted)."""
        if self.prefix_store and any("prompt_tokens" in st for st in samples):
            self.prefix_queries.inc()
        cached = max((int(st.get("cached_tokens", 0) or 0) for st in samples), default=0)
        if cached > 0:
            self.prefix_hits.inc()
            self.prefix_cached_tokens.inc(cached)

    def observe_finish(self, reason: str, stats: dict) -> None:
        """A finished sequence (its prompt's prefix figures: observe_prefix)."""
        self.requests.labels(finish_reason=reason).inc()
        spec = stats.get("spec")
        if spec:
            rounds = int(spec.get("rounds", 0))
            drafted = int(spec.get("drafted", 0))
            accepted = int(spec.get("accepted", 0))
            self.spec_drafts.inc(rounds)
            self.spec_draft_tokens.inc(drafted)
            self.spec_accepted_tokens.inc(accepted)
            per = spec.get("accepted_at", spec.get("per_depth_accepted")) or []
            for d, c in enumerate(per):
                if c:
                    self.spec_accepted_per_pos.labels(position=str(d)).inc(int(c))
            self._rounds += rounds
            self._accepted += accepted
            if self._rounds:
                self.spec_mean_len.set(self._accepted / self._rounds + 1.0)

    def render(self, running: int, waiting: int, engine_seconds: dict | None = None) -> bytes:
        self.running.set(running)
        self.waiting.set(waiting)
        for part, v in (engine_seconds or {}).items():
            self.engine_seconds.labels(part=part).set(v)
        return generate_latest(self.registry)
