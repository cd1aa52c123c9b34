"""Token sampling: per-request parameters and a batched sampler over numpy logits.

The scheduler runs one forward step for many sequences and gets ``logits[B, V]``; each row is
sampled with its own :class:`SamplingParams` and its own random generator, so a seeded request
draws the same tokens whatever else shares its batch.

Per row the order is (vLLM / llama.cpp order):

0. (scheduler) a constrained row's disallowed tokens are set to -inf (engine.constraints);
1. ``logit_bias`` and penalties on a private copy of the row: repetition (prompt + output), then frequency and
   presence (output only);
2. ``temperature == 0``: argmax (ties: lowest token id), no random draw;
3. otherwise ``logits / temperature`` -> top-k -> top-p -> min-p, then ONE uniform draw
   ``u = rng.random()`` picks the token by inverse CDF over the surviving candidates.

Reported log-probabilities are those of the raw (unpenalised, untempered) distribution, as
vLLM reports them by default.

Speed: nothing sorts the whole vocabulary in the common cases. top-k uses ``argpartition``;
top-p sorts only the values of a partitioned candidate set (``TOP_P_CANDIDATES``) whose mass
is checked first (all values are sorted only when that set holds less than ``top_p`` of it);
only values are sorted, never indices (survivors are a mask walked in token-id order); plain
temperature sampling and min-p need no sort at all; greedy rows are one vectorised argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "MAX_LOGPROBS",
    "MAX_STOP",
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "SamplingParamsError",
    "sample_one",
]

MAX_STOP = 16  # stop strings per request (OpenAI allows 4; we are lenient but bounded)
MAX_LOGPROBS = 20  # top alternatives per token, OpenAI's limit
MAX_LOGIT_BIAS = 300  # entries of logit_bias per request (OpenAI's limit)
TOP_P_CANDIDATES = 1024  # candidate set partitioned out for top-p before any sort
_U64 = (1 << 64) - 1


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class SamplingParams(BaseModel):
    """How one request's tokens are chosen and when its generation stops.

    Build from untrusted input with :meth:`parse`, which raises :class:`SamplingParamsError`
    naming the bad parameter. Types are strict (``"0.5"`` or ``True`` is not a number).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    temperature: float = Field(1.0, ge=0.0, le=2.0)
    """Logits are divided by it before sampling; 0 means greedy (argmax, deterministic)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus: keep the most likely tokens whose cumulative probability first reaches top_p."""
    top_k: int = Field(0, ge=-1)
    """Keep only the k most likely tokens; 0 or -1 disables (normalised to 0)."""
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    """Drop tokens whose probability is below ``min_p * p(most likely token)``; 0 disables."""
    repetition_penalty: float = Field(1.0, gt=0.0)
    """For every token seen in prompt or output: positive logits are divided by it, negative
    ones multiplied (llama.cpp / HF); 1 disables, > 1 discourages repetition."""
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """OpenAI: subtracted once from the logit of every token that occurs in the output."""
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """OpenAI: ``frequency_penalty * count`` subtracted, count = occurrences in the output."""
    seed: int | None = Field(None, ge=-(1 << 63), le=_U64)
    """Seeds the request's own generator (see :meth:`make_rng`); None: unseeded."""
    max_tokens: int | None = Field(None, ge=1)
    """Most tokens to generate; None: up to the context window."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end generation; the match and anything after it are not returned.
    Accepts one string, a list, or None."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Extra token ids that end generation (the token itself is not rendered as text)."""
    ignore_eos: bool = False
    """Keep generating past end-of-generation tokens (benchmarks)."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Report the chosen token's log-prob and this many top alternatives; None: no report."""
    skip_special_tokens: bool = True
    """Leave control tokens out of the returned text."""
    logit_bias: dict[int, float] = Field(default_factory=dict)
    """Token id -> bias in [-100, 100] added to its logit before anything else (OpenAI)."""
    grammar: str | None = None
    """An llguidance grammar (see engine.constraints) every output must follow; None: free text."""

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _bias_entries(cls, v: dict[int, float]) -> dict[int, float]:
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries are allowed, got {len(v)}")
        for tid, b in v.items():
            if tid < 0:
                raise ValueError(f"token id {tid} must be >= 0")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"bias {b} of token {tid} must be in [-100, 100]")
        return v

    @field_validator("top_k", mode="after")
    @classmethod
    def _top_k_disabled(cls, v: int) -> int:
        return 0 if v == -1 else v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, tuple):
            return list(v)
        return v

    @field_validator("stop", mode="after")
    @classmethod
    def _stop_entries(cls, v: list[str]) -> list[str]:
        if len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(v)}")
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_list(cls, v: Any) -> Any:
        return list(v) if isinstance(v, tuple) else v

    @field_validator("stop_token_ids", mode="after")
    @classmethod
    def _ids_nonneg(cls, v: list[int]) -> list[int]:
        if any(i < 0 for i in v):
            raise ValueError("token ids must be >= 0")
        return v

    @classmethod
    def parse(cls, **kwargs: Any) -> SamplingParams:
        """Validate ``kwargs``; on failure raise :class:`SamplingParamsError` for the first bad field."""
        try:
            return cls.model_validate(kwargs)
        except ValidationError as e:
            err = e.errors()[0]
            loc = err.get("loc") or ()
            param = str(loc[0]) if loc else "sampling"
            if err.get("type") == "extra_forbidden":
                raise SamplingParamsError(param, f"unknown parameter {param!r}") from None
            msg = str(err.get("msg", "invalid value"))
            msg = msg.removeprefix("Value error, ")
            where = param + "".join(f"[{p}]" for p in loc[1:])
            raise SamplingParamsError(param, f"invalid {where}: {msg} (got {err.get('input')!r})") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def rewrites_row(self) -> bool:
        """The row is copied and changed before sampling (penalties or logit_bias)."""
        return self.has_penalties or bool(self.logit_bias)

    def make_rng(self) -> np.random.Generator:
        """The request's generator: seeded from ``seed`` (negative seeds taken mod 2**64)."""
        return np.random.default_rng(None if self.seed is None else self.seed & _U64)


@dataclass(slots=True)
class SampleResult:
    """One step's choices for a batch of B rows."""

    tokens: np.ndarray  # int32 [B]
    logprobs: np.ndarray  # float32 [B]: log_softmax(raw logits)[token] where the row asked for logprobs, else NaN
    top_logprobs: list[list[tuple[int, float]] | None]  # per row: top-N (id, logprob) desc, or None


def _as_ids(x: Sequence[int] | np.ndarray | None) -> np.ndarray:
    if x is None:
        return np.empty(0, dtype=np.int64)
    a = np.asarray(x, dtype=np.int64)
    return a.reshape(-1)


def _apply_penalties(row: np.ndarray, p: SamplingParams, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """Biased and penalised float32 copy of ``row`` (the caller's logits are never modified)."""
    z = row.astype(np.float32, copy=True)
    v = z.size
    if p.logit_bias:
        ids_b = np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias))
        ok = ids_b < v
        z[ids_b[ok]] += np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias))[ok]
    if p.repetition_penalty != 1.0 and (prompt.size or output.size):
        seen = np.zeros(v, dtype=bool)  # O(len + V) mask beats np.unique's sort on long prompts
        seen[prompt] = True
        seen[output] = True
        ids = np.flatnonzero(seen)
        vals = z[ids]
        r = np.float32(p.repetition_penalty)
        z[ids] = np.where(vals > 0, vals / r, vals * r)
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and output.size:
        ids, counts = np.unique(output, return_counts=True)  # outputs are short: sort is cheap
        z[ids] -= np.float32(p.frequency_penalty) * counts.astype(np.float32) + np.float32(p.presence_penalty)
    return z


def _pick(cum: np.ndarray, u: float) -> int:
    """Index i with cum[i-1] <= u * total < cum[i] (inverse CDF); never past the end."""
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return min(i, cum.size - 1)


def _nucleus(w: np.ndarray, top_p: float) -> tuple[float, int]:
    """``(tau, n)``: the top-p nucleus is the n largest weights, tau the smallest of them.

    Only values are sorted (SIMD np.sort, no argsort), and only the TOP_P_CANDIDATES largest
    unless they hold less than top_p of the mass.
    """
    n = w.size
    target = top_p * float(w.sum())
    vals = w
    if n > TOP_P_CANDIDATES:
        part = np.partition(w, n - TOP_P_CANDIDATES)[n - TOP_P_CANDIDATES:]
        # The nucleus lies inside the top candidates iff they already hold top_p of the mass.
        if float(part.sum()) >= target:
            vals = part
    desc = np.sort(vals)[::-1]
    keep = min(int(np.searchsorted(np.cumsum(desc), target, side="left")) + 1, desc.size)
    return float(desc[keep - 1]), keep


def _sample_row(z: np.ndarray, p: SamplingParams, u: float) -> int:
    """One token from a (penalised) logits row: temperature -> top_k -> top_p -> min_p -> draw.

    Survivors are kept as a mask in token-id order and ``u`` walks their CDF in that order, so
    no argsort over the vocabulary is ever needed.
    """
    v = z.size
    k = p.top_k if 0 < p.top_k < v else v
    if k < v:
        ids: np.ndarray | None = np.sort(np.argpartition(z, v - k)[v - k:])  # top-k ids, id order
        zp = z[ids]
    else:
        ids = None
        zp = z
    # float64 weights relative to the max (the most likely token has weight exactly 1).
    w = np.exp((zp.astype(np.float64) - float(zp.max())) / p.temperature)

    if p.top_p >= 1.0 and p.min_p <= 0.0:
        i = _pick(np.cumsum(w), u)  # plain sampling over the whole pool
        return int(ids[i]) if ids is not None else i

    if p.top_p < 1.0:
        tau, n_keep = _nucleus(w, p.top_p)
        keep = w > tau
        short = n_keep - int(np.count_nonzero(keep))
        if short > 0:  # ties at the boundary: lowest token ids first (deterministic)
            keep[np.flatnonzero(w == tau)[:short]] = True
        if p.min_p > 0.0:
            keep &= w >= p.min_p  # min-p relative to the max weight, which is 1
    else:
        keep = w >= p.min_p
    sel = np.flatnonzero(keep)  # never empty: the max (weight 1) survives every filter
    i = int(sel[_pick(np.cumsum(w[sel]), u)])
    return int(ids[i]) if ids is not None else i


class Sampler:
    """Samples a batch of logits rows, each with its own parameters and generator.

    Stateless and thread-compatible; one instance can serve every step.
    """

    def sample(
        self,
        logits: np.ndarray,
        params: Sequence[SamplingParams],
        rngs: Sequence[np.random.Generator | None],
        prompt_ids: Sequence[Sequence[int] | np.ndarray] | None = None,
        output_ids: Sequence[Sequence[int] | np.ndarray] | None = None,
    ) -> SampleResult:
        """Choose one token per row of ``logits[B, V]``.

        ``prompt_ids`` / ``output_ids`` (per row) are read only by rows with penalties; pass
        numpy int arrays for long histories to avoid a list conversion each step. Non-greedy
        rows consume exactly one ``rng.random()``; a None generator means a fresh unseeded one.
        """
        if logits.ndim != 2:
            raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
        b, v = logits.shape
        if len(params) != b or len(rngs) != b:
            raise ValueError(f"{b} logits rows but {len(params)} params and {len(rngs)} generators")
        if prompt_ids is not None and len(prompt_ids) != b:
            raise ValueError(f"{b} logits rows but {len(prompt_ids)} prompt_ids")
        if output_ids is not None and len(output_ids) != b:
            raise ValueError(f"{b} logits rows but {len(output_ids)} output_ids")

        tokens = np.empty(b, dtype=np.int32)
        rows: list[np.ndarray] = [logits[i] for i in range(b)]  # views; replaced where penalised
        for i, p in enumerate(params):
            if p.rewrites_row:
                rows[i] = _apply_penalties(
                    logits[i], p,
                    _as_ids(prompt_ids[i] if prompt_ids is not None else None),
                    _as_ids(output_ids[i] if output_ids is not None else None),
                )

        # Greedy (and top_k == 1) rows: one vectorised argmax; np.argmax returns the first
        # maximum, i.e. the lowest token id among ties.
        # top_k == 1 is greedy too, and takes no random draw.
        greedy = [i for i, p in enumerate(params) if p.greedy or p.top_k == 1]
        plain = [i for i in greedy if not params[i].rewrites_row]
        if len(plain) == b:  # all rows greedy and plain: no gathered copy of the logits
            tokens[:] = np.argmax(logits, axis=1)
        elif plain:
            tokens[plain] = np.argmax(logits[plain], axis=1)
        for i in greedy:
            if params[i].rewrites_row:
                tokens[i] = int(np.argmax(rows[i]))

        greedy_set = set(greedy)
        for i, p in enumerate(params):
            if i in greedy_set:
                continue
            rng = rngs[i] if rngs[i] is not None else np.random.default_rng()
            tokens[i] = _sample_row(rows[i], p, float(rng.random()))

        # Raw-distribution log-probs of the rows that asked for them (a full-vocabulary exp per row is
        # most of a step's Python time at 16 rows), vectorised: log_softmax(x)[t] = x[t] - logsumexp(x).
        logprobs = np.full(b, np.nan, dtype=np.float32)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        lse = np.full(b, np.nan, dtype=np.float64)
        if want:
            sub = logits[want]  # [W, V]
            m = sub.max(axis=1, keepdims=True).astype(np.float64)
            lse[want] = m[:, 0] + np.log(np.exp(sub - m.astype(sub.dtype)).sum(axis=1, dtype=np.float64))
            chosen = logits[want, tokens[want]].astype(np.float64)
            logprobs[want] = (chosen - lse[want]).astype(np.float32)

        top: list[list[tuple[int, float]] | None] = [None] * b
        for i in want:
            n = min(params[i].logprobs or 0, v)
            if n == 0:
                top[i] = []
                continue
            row = logits[i]
            idx = np.argpartition(row, v - n)[v - n:] if n < v else np.arange(v)
            idx = idx[np.lexsort((idx, -row[idx]))]  # desc, ties by lowest id
            top[i] = [(int(t), float(row[t]) - float(lse[i])) for t in idx]
        return SampleResult(tokens=tokens, logprobs=logprobs, top_logprobs=top)


_DEFAULT_SAMPLER = Sampler()


def sample_one(logits: np.ndarray, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               rng: np.random.Generator | None = None) -> int:
    """Greedy when temperature == 0, else temperature / top-k / top-p sampling of one row.

    A one-row convenience (no penalties, no seed bookkeeping); temperatures above 2 are still
    accepted here.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    # model_construct skips validation: this internal path allows temperature > 2.
    params = SamplingParams.model_construct(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
    row = np.asarray(logits).reshape(1, -1)
    return int(_DEFAULT_SAMPLER.sample(row, [params], [rng]).tokens[0])
