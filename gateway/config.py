"""Gateway configuration: a TOML file, then ``STRATA_GATEWAY_*`` environment overrides.

Precedence (lowest first): field defaults < TOML file < environment < explicit overrides
(command-line flags). Environment keys are the field names upper-cased; values are
JSON-decoded when they parse as JSON, else taken as strings::

    STRATA_GATEWAY_PORT=8080
    STRATA_GATEWAY_LANES='[{"name": "a", "url": "http://127.0.0.1:8101"}]'
    STRATA_GATEWAY_DB_URL=postgresql+psycopg://strata@db/strata

No secret lives here: API keys are in the database (hashed); the admin key comes from
``STRATA_ADMIN_KEY`` or the 0600 file named by ``admin_key_file``.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.config import ConfigError as _BaseConfigError
from common.config import decode_env, read_toml
from common.cpus import cpu_list_value
from gateway.documents.config import RagConfig
from memory.config import MemoryConfig

__all__ = ["ENV_PREFIX", "KEY_LIMITS", "REPO_ROOT", "ConfigError", "GatewayConfig", "LaneEntry", "LimitsConfig",
           "default_db_url", "load_config"]

ENV_PREFIX = "STRATA_GATEWAY_"
REPO_ROOT = Path(__file__).resolve().parent.parent


def default_db_url() -> str:
    return f"sqlite:///{REPO_ROOT / 'var' / 'gateway.db'}"


class ConfigError(_BaseConfigError):
    """A bad gateway configuration; the message is one line naming the key and value."""


class LaneEntry(BaseModel):
    """One upstream lane. ``weight`` is the starting weight; the admin API changes it at run time."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$")
    url: str = Field(pattern=r"^https?://[^/\s]+$", description="scheme://host:port, no path")
    weight: float = Field(1.0, ge=0)

    @field_validator("url", mode="before")
    @classmethod
    def _strip_slash(cls, v: Any) -> Any:
        return v.rstrip("/") if isinstance(v, str) else v


class LimitsConfig(BaseModel):
    """Per-key limits on everything that costs work, with defaults that protect a small box (docs/operations.md
    tells how to size them). A key's own value wins (``python -m gateway.keys create --limit NAME=VALUE``, the
    admin API's ``limits``; ``none``/null there: unlimited for that key); admin keys have none. The ``[limits]``
    table of the gateway config; None here: unlimited by default."""

    model_config = ConfigDict(extra="forbid")

    rpm: int | None = Field(600, ge=1, description="generation requests (chat, completions) per minute")
    tpm: int | None = Field(None, ge=1, description="generation tokens per minute (prompt + max_tokens reserved "
                            "per choice, the unused part refunded)")
    max_concurrent: int | None = Field(8, ge=1, description="requests in progress at once: generation (and "
                                       "the summaries of the key's sessions), embeddings, search, uploads, session "
                                       "requests")
    embedding_inputs_per_call: int = Field(256, ge=1, le=2048, description="inputs of one /v1/embeddings call "
                                           "(more: 400)")
    embedding_inputs_per_minute: int | None = Field(6000, ge=1, description="embedding inputs per minute")
    searches_per_minute: int | None = Field(300, ge=1, description="collection searches per minute")
    uploads_per_minute: int | None = Field(30, ge=1, description="document uploads per minute")
    session_requests_per_minute: int | None = Field(300, ge=1, description="session API requests (/v1/sessions: "
                                                    "create, list, read, rename, export, delete) per minute")
    documents_per_key: int | None = Field(2000, ge=1, description="documents a key may hold in all its collections")
    document_bytes_per_key: int | None = Field(2 << 30, ge=1, description="upload bytes a key may hold")
    queued_documents_per_key: int | None = Field(20, ge=1, description="a key's documents waiting for ingestion or "
                                                 "in it; ingestion serves the keys in turn")
    min_free_disk_bytes: int = Field(1 << 30, ge=0, description="an upload is refused (507) when the data "
                                     "directory's disk has less free space than this plus the upload")


KEY_LIMITS = tuple(n for n in LimitsConfig.model_fields if n not in ("embedding_inputs_per_call",
                                                                      "min_free_disk_bytes"))


class GatewayConfig(BaseModel):
    """The public gateway: where it listens, which lanes it fronts, its limits and its database."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535, description="0: any free port (tests)")
    lanes: list[LaneEntry] = Field(default_factory=lambda: [
        LaneEntry(name="a", url="http://127.0.0.1:8101"), LaneEntry(name="b", url="http://127.0.0.1:8102")])
    db_url: str = Field(default_factory=default_db_url, description="any SQLAlchemy URL")
    health_interval_s: float = Field(1.0, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    health_timeouts_to_unready: int = Field(3, ge=1, description="a ready lane leaves the rotation after this many "
                                            "health polls in a row time out (a refused connection or an error "
                                            "status takes it out at once): a busy host delays a poll, not a lane")
    request_timeout_s: float = Field(900.0, gt=0, description="a whole non-streaming upstream request")
    first_token_timeout_s: float = Field(120.0, gt=0, description="a stream's first token (and /tokenize)")
    stream_idle_timeout_s: float = Field(60.0, gt=0, description="a stream whose lane sends nothing this long")
    ping_interval_s: float = Field(3.0, gt=0, description="SSE ': ping' while a stream waits")
    max_body_bytes: int = Field(1024 * 1024, ge=1024)
    header_timeout_s: float = Field(10.0, gt=0, description="a new connection's first request headers must arrive "
                                    "within this (else 408 and closed: slowloris)")
    body_timeout_s: float = Field(30.0, gt=0, description="a JSON body must arrive within this after its headers "
                                  "(else 408 and closed); uploads have upload_timeout_s")
    upload_timeout_s: float = Field(300.0, gt=0, description="a document upload's whole body must arrive within this")
    keepalive_timeout_s: float = Field(15.0, gt=0, description="an idle keep-alive connection is closed after this")
    stream_write_timeout_s: float = Field(30.0, gt=0, description="a stream's client must take each chunk within "
                                          "this, else it is disconnected and its lane request aborted")
    max_connections: int = Field(4096, ge=16, description="open client connections in all; when full, a new one "
                                 "takes the place of the oldest connection that never authenticated and is idle, "
                                 "else it gets 503")
    max_connections_per_address: int = Field(256, ge=1, description="open connections per client address (the "
                                             "peer; trusted_proxies are exempt), with the same eviction")
    send_buffer_bytes: int | None = Field(None, ge=4096, description="SO_SNDBUF of client connections (None: the "
                                          "kernel's autotuning); smaller bounds what a client that stops reading "
                                          "holds and finds it sooner")
    max_open_files: int | None = Field(None, ge=256, description="RLIMIT_NOFILE the gateway sets at start (None: "
                                       "the hard limit); max_connections is lowered to fit it")
    max_tokens_cap: int | None = Field(None, ge=1, description="global cap on max_tokens (clamped)")
    default_max_tokens: int | None = Field(
        1024, ge=1, description="max_tokens of a request that names none (a key's own default wins); "
        "None: the rest of the window")
    min_clamp_tokens: int = Field(16, ge=1)
    trace_stages: bool = Field(False, description="diagnosis: each generation request's access-log line gets the "
                               "times of its stages (stages=name:ms since arrival,...)")
    count_locally: bool = Field(True, description="the window precheck counts prompts with the lane's tokenizer "
                                "loaded in the gateway (no /tokenize round trip; /tokenize when it cannot)")
    eject_after_failures: int = Field(3, ge=1)
    eject_cooldown_s: float = Field(10.0, ge=0)
    log_prompts_default: bool = False
    retention_days: float = Field(30.0, gt=0)
    responses_retention_days: float = Field(30.0, gt=0, description="stored /v1/responses answers (for "
                                            "previous_response_id) are deleted this long after they were made")
    admin_key_file: Path | None = Field(None, description="a 0600 file holding the admin key")
    key_cache_s: float = Field(10.0, ge=0, description="how long a verified key stays cached")
    negative_cache_size: int = Field(10_000, ge=0, description="unknown keys remembered (0: none)")
    negative_cache_s: float = Field(60.0, ge=0, description="how long an unknown key is answered 401 from memory")
    auth_fail_limit: int = Field(30, ge=1, description="failed authentications per client address and window "
                                 "before that address's unknown keys get 429 (keys that verified before still pass)")
    auth_fail_window_s: float = Field(60.0, gt=0, description="the window of auth_fail_limit (also the block time)")
    auth_fail_global_limit: int = Field(1000, ge=1, description="failed authentications of all addresses together "
                                        "per auth_fail_window_s before unknown keys get 429 (keys that verified "
                                        "before still pass)")
    trusted_proxies: list[str] = Field(default_factory=list, description="addresses or networks (CIDR) whose "
                                       "X-Forwarded-For names the client; empty: the peer address is the client")
    log_queue_max: int = Field(10_000, ge=1, description="request-log rows waiting for the database; more are "
                               "dropped (counted)")
    log_journal_dir: Path | None = Field(None, description="the request log's local journal (rows on disk before "
                                         "their answer completes; replayed at start); None: beside a SQLite "
                                         "database, else var/ in the repository, named after the port")
    log_retry_max_s: float = Field(30.0, gt=0, description="longest pause between writes while the database fails")
    log_batch_s: float = Field(0.2, ge=0, le=5.0, description="the request log's writer collects rows this long "
                               "after the first of a batch, then commits them in one transaction (0: a commit per "
                               "wake-up); rows are in the journal before then, so a crash loses none")
    metrics_public: bool = Field(False, description="True: /metrics answers without a key (else the admin key: "
                                 "its labels name lanes and keys' limits, its counters what clients did)")
    shutdown_timeout_s: float = Field(30.0, ge=0, description="SIGTERM: in-flight requests get this long")
    nice: int | None = Field(
        None, ge=-20, le=19, description="python -m gateway's scheduling priority (os.setpriority at start, every "
        "thread; the embedding model's process stays at 0 or above); below 0 needs CAP_SYS_NICE (else a warning). "
        "None: inherited. A gateway above its lanes' priority waits less for a core on a busy box at each hop to the "
        "first token")
    cores: list[int] | None = Field(
        None, description="CPU ids python -m gateway pins itself to at start, every thread (e.g. \"7,15\"); None: "
        "unpinned. Cores the lanes' engine threads do not use keep the gateway's work on the path to the first token "
        "from pre-empting an engine thread that the rest of its step waits for")
    switch_interval_ms: float = Field(
        0.5, gt=0, le=100, description="python -m gateway's sys.setswitchinterval: how long another thread of the "
        "process (the request-log writer, a worker) keeps the GIL while the event loop waits for it (Python's "
        "default: 5)")
    event_loop: Literal["uvloop", "asyncio"] = Field(
        "uvloop", description="python -m gateway's event loop: uvloop (libuv; less CPU per request and per hop on "
        "the path to the first token), else the standard library's (also when uvloop is not installed)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="per-key limits and their defaults")
    rag: RagConfig = Field(default_factory=RagConfig, description="documents and retrieval (docs/rag.md)")
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description="session memory (docs/memory.md)")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @field_validator("cores", mode="before")
    @classmethod
    def _cores_text(cls, v: Any) -> Any:
        return cpu_list_value(v)

    @field_validator("cores", mode="after")
    @classmethod
    def _cores_valid(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if not v:
                raise ValueError("empty core list (use null for no pinning)")
            if any(c < 0 for c in v) or len(set(v)) != len(v):
                raise ValueError("CPU ids must be distinct and >= 0")
            outside = sorted(set(v) - set(range(os.cpu_count() or 1)))
            if outside:
                raise ValueError(f"CPU ids {outside} are outside this machine's CPUs 0-{(os.cpu_count() or 1) - 1}")
        return v

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        for item in v:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or network (e.g. 10.0.0.0/8)") from None
        return v

    @model_validator(mode="after")
    def _unique_lanes(self) -> GatewayConfig:
        names = [lane.name for lane in self.lanes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate lane name(s) {dup}")
        return self


def load_config(path: Path | str | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> GatewayConfig:
    """Build a GatewayConfig from an optional TOML file, ``STRATA_GATEWAY_*`` variables and overrides."""
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        p = Path(path)
        data = read_toml(p, ConfigError)
        for key, value in data.items():
            merged[key] = value
            sources[key] = f"file {p}"
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var == ENV_PREFIX:
            continue
        key = var[len(ENV_PREFIX):].lower()
        merged[key] = decode_env(env[var])
        sources[key] = f"environment {var}"
    for key, value in (overrides or {}).items():
        if value is not None:
            merged[key] = value
            sources[key] = f"override {key}"
    try:
        return GatewayConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_describe(e, merged, sources)) from None


def _describe(err: ValidationError, merged: Mapping[str, Any], sources: Mapping[str, str]) -> str:
    parts: list[str] = []
    for e in err.errors():
        loc = [str(x) for x in e.get("loc", ())]
        key = loc[0] if loc else "config"
        where = ".".join(loc) or "config"
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            known = GatewayConfig.model_fields
            if len(loc) > 1:  # a key inside a table: that table's own fields ([rag], [memory], [[lanes]])
                table = GatewayConfig.model_fields.get(loc[0])
                sub = table.annotation if table is not None else None
                known = sub.model_fields if isinstance(sub, type) and issubclass(sub, BaseModel) \
                    else LaneEntry.model_fields
            msg = f"unknown key (known: {', '.join(known)})"
        value = merged.get(key, "<default>") if len(loc) <= 1 else e.get("input")
        part = f"{where}={value!r} (from {sources.get(key, 'defaults')}): {msg}"
        if part not in parts:
            parts.append(part)
    return "invalid gateway config: " + "; ".join(parts)
