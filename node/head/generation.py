"""One generation over any opened target backend: the only place the head engine is built and run.

Route and federated code open their backend and hand it here; what comes back is a typed
`GenerationReport` (the engine's counters and the backend's transport record), or a `GenerationFailed`
carrying the tokens made so far, why the backend gave out, and what its transport did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .backend import BackendError, TargetBackend
from .config import Drafter, GenerationConfig
from .engine import HeadEngine
from .report import GenerationFailed, GenerationReport
from .verify import Decoder


async def generate(
    backend: TargetBackend,
    drafter: Drafter | None,
    cfg: GenerationConfig,
    prompt: Sequence[int],
    *,
    tokenizer: Decoder | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationReport:
    """Generate after `prompt` over `backend` (drafting with `drafter`, None for `ar`) until EOS, a stop string
    or `cfg.max_new_tokens`; `on_tokens` sees the tokens as they are accepted. Raises `GenerationFailed` when
    the backend gives out (ValueError for settings that cannot run, before anything is sent)."""
    engine = HeadEngine(backend, drafter, cfg, tokenizer)
    try:
        result = await engine.run(prompt, on_tokens=on_tokens)
        await backend.settle()
    except BackendError as exc:
        raise GenerationFailed(exc.failure, engine.result, backend.transport()) from exc
    return GenerationReport(result, backend.transport())
