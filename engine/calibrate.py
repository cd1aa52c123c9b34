"""`strata plan calibrate`: routing statistics from running the CPU engine over a prompt file.

Every prompt is served through the scheduler (the lane's path: chunked prefill, batched decode, greedy) for
a few generated tokens, and each step's expert histogram (``StepReport.expert_hist``, filled by the C step)
is added to a :class:`~engine.placement.RoutingStats`; the result is written as a placement file. Without a
prompt file the built-in corpus (``engine/data/calibration_prompts.jsonl``: code, prose, chat, multilingual
text and mathematics) gives the default placement.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.placement import PlacementError, PlacementFile, RoutingStats

if TYPE_CHECKING:
    from engine.engine import Engine

__all__ = ["Prompt", "PromptFileError", "builtin_corpus", "read_prompts", "calibrate", "BUILTIN_CORPUS"]

BUILTIN_CORPUS = "engine/data/calibration_prompts.jsonl"
MAX_PROMPT_FILE = 64 << 20
MAX_PROMPTS = 100_000


class PromptFileError(PlacementError):
    """A prompt file that cannot be read; the message names the file and line."""


class Prompt(BaseModel):
    """One calibration prompt: plain text, or chat messages rendered with the model's template."""

    model_config = ConfigDict(extra="ignore")

    prompt: str | None = Field(None, min_length=1)
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    kind: str = ""  # what the corpus line stands for (code, prose, chat, ...); informational

    def ids(self, engine: Engine) -> list[int]:
        if self.messages is not None:
            return engine.render_chat(self.messages)
        return engine.tokenizer.encode(self.prompt or "", add_special=True, parse_special=False)


def _parse(text: str, where: str) -> list[Prompt]:
    out: list[Prompt] = []
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s:
            continue
        if s[0] in "{\"":  # a JSONL line: {"prompt": ...}, {"messages": [...]} or a JSON string
            try:
                raw = json.loads(s)
                p = Prompt(prompt=raw) if isinstance(raw, str) else Prompt.model_validate(raw)
            except (ValueError, ValidationError) as exc:
                msg = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
                raise PromptFileError(f"{where}:{n}: not a prompt ({msg})") from None
            if p.prompt is None and p.messages is None:
                raise PromptFileError(f"{where}:{n}: a JSON line needs 'prompt' or 'messages'")
        else:
            p = Prompt(prompt=s)
        out.append(p)
        if len(out) > MAX_PROMPTS:
            raise PromptFileError(f"{where}: more than {MAX_PROMPTS} prompts")
    if not out:
        raise PromptFileError(f"{where}: no prompts")
    return out


def read_prompts(path: str | os.PathLike[str]) -> list[Prompt]:
    """Prompts from a file: one per line, plain text or JSONL (``{"prompt": ...}``, ``{"messages": [...]}``)."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_PROMPT_FILE:
            raise PromptFileError(f"{p}: larger than {MAX_PROMPT_FILE >> 20} MiB")
        text = p.read_bytes().decode("utf-8")
    except PromptFileError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"{p}: cannot read the prompt file ({exc})") from None
    return _parse(text, str(p))


def builtin_corpus() -> list[Prompt]:
    text = resources.files("engine").joinpath("data", "calibration_prompts.jsonl").read_text("utf-8")
    return _parse(text, BUILTIN_CORPUS)


def calibrate(engine: Engine, prompts: list[Prompt], max_tokens: int = 32, batch: int = 64,
              progress: Callable[[int, int], None] | None = None) -> tuple[RoutingStats, int]:
    """Serve every prompt greedily for up to ``max_tokens`` tokens (``batch`` at a time) and sum the steps'
    expert histograms: (the statistics, tokens computed). A prompt longer than the context keeps its tail."""
    from engine.sampling import SamplingParams
    from engine.scheduler import Scheduler

    if max_tokens < 1 or batch < 1:
        raise ValueError("max_tokens and batch must be >= 1")
    stats = RoutingStats.for_model(engine.model_file)
    params = SamplingParams.parse(max_tokens=max_tokens, temperature=0.0)
    sched = Scheduler(engine)
    room = max(1, engine.n_ctx - max_tokens)
    computed = 0
    for i in range(0, len(prompts), batch):
        for p in prompts[i : i + batch]:
            sched.add(p.ids(engine)[-room:], params)
        while sched.num_running or sched.num_waiting:
            sched.step()
            rep = sched.last_report
            if rep is not None and rep.expert_hist is not None:
                stats.update(rep.expert_hist)
                if rep.stats is not None:
                    computed += rep.stats.n_tokens
        if progress:
            progress(min(i + batch, len(prompts)), len(prompts))
    return stats, computed


def calibrate_file(engine: Engine, prompts_path: str | os.PathLike[str] | None, out: str | os.PathLike[str],
                   max_tokens: int = 32) -> PlacementFile:
    """calibrate() over a prompt file (None: the built-in corpus), written to ``out`` as a placement file."""
    prompts = read_prompts(prompts_path) if prompts_path is not None else builtin_corpus()
    stats, computed = calibrate(engine, prompts, max_tokens)
    what = str(prompts_path) if prompts_path is not None else f"the built-in corpus ({BUILTIN_CORPUS})"
    pf = PlacementFile.for_model(engine.model_file, stats, source=(
        f"calibration: {len(prompts)} prompts from {what}, up to {max_tokens} greedy tokens each, "
        f"{computed} tokens computed on the CPU engine"))
    pf.save(out)
    return pf
