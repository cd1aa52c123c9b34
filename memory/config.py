"""Settings of session memory (the ``[memory]`` table of the gateway config)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["MemoryConfig"]


class MemoryConfig(BaseModel):
    """Composition budget, retrieval and summarisation. Sessions live in the gateway's database."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    enabled: bool = True
    retrieve_top_k: int = Field(4, ge=0, le=64, description="older turns retrieved by similarity per request")
    retrieve_min_score: float = Field(0.25, ge=-1, le=1, description="cosine below which a turn is not retrieved")
    retrieve_share: float = Field(0.25, ge=0, le=0.9, description="share of the memory budget kept for "
                                  "retrieved turns when any are found")
    recent_turns_max: int = Field(200, ge=2, le=10_000, description="newest unsummarised turns loaded per request")
    generation_reserve: int = Field(256, ge=16, description="tokens kept for the reply when the request names no "
                                    "max_tokens (at most a quarter of the window)")
    summarize: bool = True
    summarize_after_tokens: int = Field(768, ge=64, description="unsummarised history (estimated tokens) that "
                                        "starts a summarisation, once a composition has left turns out")
    summary_keep_turns: int = Field(6, ge=0, description="newest turns never folded into the summary")
    summary_input_tokens: int = Field(768, ge=64, description="turns folded by one summarisation call, at most")
    summary_max_tokens: int = Field(160, ge=16, le=4096, description="the summary's length limit (the lane's "
                                    "max_tokens)")
    summary_temperature: float = Field(0.1, ge=0, le=2)
    summary_retry_s: float = Field(30.0, gt=0, description="first pause before a failed summarisation is retried "
                                   "(doubles up to 16x)")
    summary_timeout_s: float = Field(120.0, gt=0)
    vector_cache_mb: float = Field(256.0, ge=0, description="memory for the turn vectors of recently used "
                                   "sessions (MiB); the least recently used are dropped past it and reloaded from "
                                   "the database on their next request (0: reload every time)")
    session_state_max: int = Field(20_000, ge=1, description="sessions whose small per-session state (what is "
                                   "embedded, what a composition left out, summary retries) this process keeps; "
                                   "the least recently used past it are forgotten and re-read from the database "
                                   "on their next request")
    max_sessions_per_key: int = Field(10_000, ge=1)
    max_turn_chars: int = Field(200_000, ge=100, description="longest message stored as a turn")

    @model_validator(mode="after")
    def _keep(self) -> MemoryConfig:
        if self.summary_input_tokens < 64:
            raise ValueError("summary_input_tokens must be at least 64")
        return self
