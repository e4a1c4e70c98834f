"""The model the service keeps loaded as its head: the target's ends, its tokenizer, the draft model, end-of-sequence ids.

Loaded once at start-up; every request gets its own drafter (its sampling settings, seed and
draft cache, the draft model's weights shared: `request_drafter`) and its own generation
settings from the request (`generation_config`). The context limit is the model's positions,
capped by what block peers accept per session by default (`--max-len`), or `--max-context`.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsd.node.head.config import GenerationConfig
from dsd.node.head.draft_batch import JointDrafts
from dsd.node.head.joint import JoinStats, JointHead, JointSpan
from dsd.node.head.sampling import SamplingParams
from dsd.node.head.setup import (
    HeadSetup,
    PromptError,
    chat_ids,
    draft_model,
    eos_ids,
    load_head_setup,
    request_drafter,
)
from dsd.node.peer.generation import load_head_span
from dsd.node.route.audit import AuditOptions
from dsd.node.server.limits import ServerLimits
from dsd.protocol.deadlines import DeadlineRule
from dsd.shard_store import SpanModule, Store
from dsd.shard_store.devices import Placement
from dsd.shard_store.dtypes import dtype_name

from .defaults import DEFAULT_MAX_TOKENS
from .openai_wire import CompletionRequest, context_error
from .tool_calls import TAG_OPEN
from .wire_errors import WireError, bad_param

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadOptions:
    """How the service's head drafts and verifies (the `generate` options that are not per request)."""

    store: Path
    draft: str = "ngram"
    blocks: str | None = None  # layers the head serves itself (`--blocks A:B`: the model's first or last ones)
    placement: Placement | None = None  # device and compute dtype (None: the CPU, the stores' dtypes)
    draft_quant: str = "none"
    mode: str = "dsd"
    overlap: dict[str, Any] = field(default_factory=dict)  # dsd's branches, pipeline and levers (`overlap_options`)
    tree_nodes: int | None = None
    gamma_max: int = 16
    tau_max: float = 0.0  # dsd-adaptive only
    deadline: DeadlineRule = field(default_factory=DeadlineRule)
    max_context: int | None = None  # None: the model's positions, at most the peers' default --max-len
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    audit: AuditOptions | None = None  # how routes' windows are audited (None: not at all)
    head_batching: bool = True  # every request's draft forwards, lm_head rows and own span joined (`node/head/joint.py`)


@dataclass(frozen=True)
class Plan:
    """One request made concrete: its prompt ids and generation settings, and the start of the answer the server
    wrote for the model (`prefill`: a required tool call's markup; its tokens end the prompt)."""

    prompt: list[int]
    cfg: GenerationConfig
    max_tokens: int
    prefill: str = ""


class ServedModel:
    """The head, the tokenizer and the drafter, loaded once and shared by every request."""

    def __init__(self, setup: HeadSetup, tokenizer: Any, store: Store, options: HeadOptions,
                 local_span: SpanModule | None = None) -> None:
        self.setup = setup
        self.local_span = local_span
        self.tokenizer = tokenizer
        self.options = options
        self.model_id = setup.model_id
        self.num_layers = setup.num_layers
        self.eos_ids = eos_ids(tokenizer, store.manifest) if tokenizer is not None else frozenset()
        positions = store.manifest.config.get("max_position_embeddings")
        limit = int(positions) if isinstance(positions, int) and positions > 0 else ServerLimits().max_len
        self.context_limit = options.max_context or min(limit, ServerLimits().max_len)
        self.created = int(time.time())
        # The head's own layers (`--blocks`): every route covers the others.
        self.local_blocks = None if local_span is None else (local_span.start, local_span.end)
        self.device = str(setup.head.device)
        self.dtype = dtype_name(setup.head.dtype)
        model = draft_model(setup.drafter)
        self.joint = JointDrafts(model) if options.head_batching and model is not None else None
        if options.head_batching and setup.head is not None:
            self.setup = dataclasses.replace(setup, head=JointHead(setup.head))
        if options.head_batching and local_span is not None:
            self.local_span = JointSpan(local_span)  # type: ignore[assignment]

    @classmethod
    def load(cls, options: HeadOptions) -> ServedModel:
        """Load the target's ends, tokenizer, draft and `--blocks` span onto the device (slow: run it in a worker
        thread). ValueError or StoreError saying what is wrong."""
        if options.tree_nodes and options.mode != "ar" and "ngram" in options.draft.split("+"):
            raise ValueError("--tree-nodes N needs a draft model store without ngram; use auto or 0")
        store = Store(options.store)
        place = options.placement
        device, dtype = (place.device, place.dtype) if place is not None else (None, None)
        local_span = load_head_span(store, options.blocks, place) if options.blocks else None
        setup, tokenizer = load_head_setup(options.store, options.draft, SamplingParams(), 0, quant=options.draft_quant,
                                           device=device, dtype=dtype)
        return cls(setup, tokenizer, store, options, local_span)

    @property
    def chat_ready(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_ids(self, req: CompletionRequest, prefill: str = "") -> list[int]:
        """The request's prompt as token ids (the chat template for chat, with its tools and the `prefill` after
        it); 400 when it cannot be encoded."""
        if isinstance(req.prompt, list):
            bad = [t for t in req.prompt if not 0 <= t < self.setup.vocab_size]
            if bad:
                raise bad_param("prompt", f"token ids {bad[:5]} are outside the vocabulary [0, {self.setup.vocab_size})")
            return list(req.prompt)
        if self.tokenizer is None:
            raise bad_param("messages" if req.chat else "prompt",
                            "this model's store has no tokenizer: send the prompt as token ids to /v1/completions")
        try:
            if req.chat:
                tools = req.tools.shown if req.tools.active else ()
                ids = chat_ids(self.tokenizer, list(req.messages), tools)
                ids += self.tokenizer(prefill, add_special_tokens=False)["input_ids"] if prefill else []
            else:
                ids = list(self.tokenizer(req.prompt)["input_ids"])
        except PromptError as exc:
            if req.tools.active:
                raise bad_param("tools", f"{exc}: this model cannot take tools", "unsupported") from None
            raise bad_param("messages", f"{exc}: use /v1/completions", "unsupported") from None
        except Exception as exc:  # a template can refuse a conversation (roles out of order, say)
            raise bad_param("messages", f"the chat template refused these messages: {exc}") from None
        if not ids:
            raise bad_param("messages" if req.chat else "prompt", "the prompt is empty")
        return ids

    def plan(self, req: CompletionRequest) -> Plan:
        """Prompt ids and generation settings of a request; 400 when they do not fit the context."""
        prefill = self._prefill(req)
        prompt = self.prompt_ids(req, prefill)
        opts = self.options
        slack = self._slack()
        room = self.context_limit - len(prompt) - slack
        if req.max_tokens is not None and req.max_tokens > self.context_limit:
            raise bad_param("max_tokens", f"max_tokens must be at most {self.context_limit} (this model's context "
                                          f"length), got {req.max_tokens}")
        max_tokens = req.max_tokens if req.max_tokens is not None else min(opts.default_max_tokens, room)
        if max_tokens < 1 or max_tokens > room:
            raise context_error(req, len(prompt), max(1, max_tokens), self.context_limit, slack)
        seed = req.seed if req.seed is not None else secrets.randbits(62)
        params = SamplingParams(temperature=req.temperature, top_p=req.top_p)
        cfg = GenerationConfig(
            mode=opts.mode, max_new_tokens=max_tokens, params=params, gamma_max=opts.gamma_max,
            tau_max=opts.tau_max if opts.mode == "dsd-adaptive" else 0.0, seed=seed, eos_ids=self.eos_ids,
            stop_strings=req.stop, **opts.overlap, deadline=opts.deadline, tree_nodes=opts.tree_nodes,
            logprobs=req.logprobs,
        )
        if req.stop and self.tokenizer is None:
            raise bad_param("stop", "stop strings need the model's tokenizer, and its store has none")
        return Plan(prompt, cfg, max_tokens, prefill)

    def _prefill(self, req: CompletionRequest) -> str:
        """A required call's start when the template asks for tagged calls (`Tools.prefill`); 400 when a call is
        required of a model whose template shows no call markup the server could start."""
        if not req.tools.forced:
            return ""
        template = str(getattr(self.tokenizer, "chat_template", None) or "")
        if TAG_OPEN not in template:
            raise bad_param("tool_choice", f"tool_choice {req.tools.choice!r} needs a chat template that asks for "
                            f"{TAG_OPEN} calls, and this model's does not: use \"auto\"")
        return req.tools.prefill()

    def token_text(self, token: int) -> str:
        """One token's text, as logprobs show it (special tokens included)."""
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def _slack(self) -> int:
        """KV rows a session needs beyond prompt + completion: the widest window (`GenerationConfig.session_slack`)."""
        return GenerationConfig(gamma_max=self.options.gamma_max, tree_nodes=self.options.tree_nodes).session_slack

    def batching_stats(self) -> dict[str, JoinStats]:
        """What the head's joint calls did, by part: its draft forwards and its lm_head (head batching on)."""
        out = {} if self.joint is None else {"draft": self.joint.joiner.stats}
        head = self.setup.head
        if isinstance(head, JointHead):
            out["lm_head"] = head.joiner.stats
        if isinstance(self.local_span, JointSpan):
            out["span"] = self.local_span.joiner.stats
        return out

    def setup_for(self, cfg: GenerationConfig) -> HeadSetup:
        """The head setup of one generation: a drafter of its own with the request's sampling settings."""
        return dataclasses.replace(self.setup, drafter=request_drafter(self.setup.drafter, cfg.params, cfg.seed,
                                                                      self.joint))

    def decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise WireError(404, f"the model {model!r} does not exist here; this server serves {self.model_id!r}",
                            code="model_not_found", param="model")
