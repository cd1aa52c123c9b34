"""Prometheus metrics of the gateway, in a per-app registry (tests run several apps in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["GatewayMetrics"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_DUR_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("strata_gateway_requests", "Answered requests by endpoint, lane and HTTP status",
                                ["endpoint", "lane", "status"], registry=r)
        self.duration = Histogram("strata_gateway_request_seconds", "Arrival to the last byte of the answer",
                                  ["endpoint"], buckets=_DUR_BUCKETS, registry=r)
        self.ttft = Histogram("strata_gateway_time_to_first_token_seconds",
                              "Arrival to the first streamed token sent to the client", ["lane"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.in_flight = Gauge("strata_gateway_in_flight", "Requests being served by each lane", ["lane"],
                               registry=r)
        self.lane_ready = Gauge("strata_gateway_lane_ready", "1 when the lane's health poll says ready", ["lane"],
                                registry=r)
        self.lane_weight = Gauge("strata_gateway_lane_weight", "Routing weight (0 or draining: no new requests)",
                                 ["lane"], registry=r)
        self.lane_draining = Gauge("strata_gateway_lane_draining", "1 when the lane is drained by the admin",
                                   ["lane"], registry=r)
        self.clamped = Counter("strata_gateway_max_tokens_clamped", "max_tokens lowered: to fit the window or a cap",
                               ["reason"], registry=r)
        self.context_rejected = Counter("strata_gateway_context_length_exceeded",
                                        "Requests refused by the window precheck (never sent to a lane)", registry=r)
        self.retries = Counter("strata_gateway_retries", "Requests retried on another lane, by the lane that failed",
                               ["lane"], registry=r)
        self.upstream_failures = Counter("strata_gateway_upstream_failures",
                                         "Lane failures (connect, timeout, 5xx, broken stream)", ["lane", "kind"],
                                         registry=r)
        self.ejections = Counter("strata_gateway_lane_ejections", "Lanes ejected after consecutive failures",
                                 ["lane"], registry=r)
        self.rate_limited = Counter("strata_gateway_rate_limited", "Refusals by limit (rpm, tpm, concurrency, the "
                                    "endpoints' [limits] names): 429 answers, and summaries deferred at a key's limit",
                                    ["limit"], registry=r)
        self.auth_failures = Counter("strata_gateway_auth_failures",
                                     "Refused authentications: failed (401) and blocked (429, too many failures "
                                     "from one address)", ["result"], registry=r)
        self.summaries = Counter("strata_gateway_memory_summaries",
                                 "Session-memory summariser lane calls by result: done, failed, deferred (the "
                                 "session's key was at a limit; tried again when it has room)", ["result"],
                                 registry=r)
        self.summary_tokens = Counter("strata_gateway_memory_summary_tokens",
                                      "Tokens (prompt + completion) the summariser used, charged to the sessions' "
                                      "keys' tpm", registry=r)
        self.log_dropped = Counter("strata_gateway_request_log_dropped",
                                   "Request-log rows lost: the queue was full, or the database refused the row",
                                   ["reason"], registry=r)
        self.log_queued = Gauge("strata_gateway_request_log_queued", "Request-log rows waiting for the database",
                                registry=r)
        self.connections_open = Gauge("strata_gateway_connections_open", "Open client connections", registry=r)
        self.connections_refused = Counter("strata_gateway_connections_refused",
                                           "New connections answered 503 and closed: the address or the whole "
                                           "table was full of connections that may not be evicted",
                                           ["reason"], registry=r)
        self.connections_closed = Counter("strata_gateway_connections_closed",
                                          "Connections the gateway closed: header_timeout (no request headers in "
                                          "time), body_timeout, evicted (made room for a new connection), "
                                          "stream_stalled (a stream's client stopped reading), write_stalled (an answer that did not move "
                                          "for stream_write_timeout_s), bad_request (a "
                                          "request line or header the HTTP parser refused: 400)", ["reason"],
                                          registry=r)
        for reason in ("window", "cap"):
            self.clamped.labels(reason=reason)
        for result in ("failed", "blocked"):
            self.auth_failures.labels(result=result)
        for result in ("done", "failed", "deferred"):
            self.summaries.labels(result=result)
        for reason in ("queue_full", "rejected"):
            self.log_dropped.labels(reason=reason)
        for reason in ("per_address", "total"):
            self.connections_refused.labels(reason=reason)
        for reason in ("header_timeout", "body_timeout", "evicted", "stream_stalled", "write_stalled", "bad_request"):
            self.connections_closed.labels(reason=reason)
