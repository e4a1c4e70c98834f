"""The one function that runs a generation (`head.generation.generate`): a typed report on success, and on a
backend that gives out midway a `GenerationFailed` that keeps the tokens made so far, why, and the transport."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import trio
from support.models import hf_greedy
from transformers import AutoModelForCausalLM

from dsd.node.head.backend import BackendError, Capabilities
from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import NgramDrafter
from dsd.node.head.generation import generate
from dsd.node.head.local import LocalBackend
from dsd.node.head.report import GenerationFailed, GenerationReport
from dsd.shard_store import Store

PROMPT = [1, 17, 42, 99, 5, 17, 42]


@dataclass(frozen=True)
class Gone:
    """A failure as a backend reports it."""

    verdict: str
    message: str
    blamed: list[str]

    def as_dict(self) -> dict:
        return {"verdict": self.verdict, "message": self.message, "blamed": self.blamed}


@dataclass(frozen=True)
class Wire:
    bytes_sent: int
    bytes_received: int

    def as_dict(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}


class DyingBackend(LocalBackend):
    """The whole model, until its `collect` has answered `lives` times: then the target is gone for good."""

    capabilities = Capabilities()  # chains one at a time: the engine must not send trees or windows ahead

    def __init__(self, *args, lives: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lives = lives
        self.collected = 0

    async def submit(self, tokens, *, start, commit, epoch, parents=None, keep=None) -> None:
        assert parents is None and keep is None, "a backend without trees was sent one"
        await super().submit(tokens, start=start, commit=commit, epoch=epoch)

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        if self.collected == self.lives:
            raise BackendError(Gone("no_worker", "every worker left", ["peer-x"]))
        self.collected += 1
        return await super().collect(epoch=epoch, rows=rows)

    def transport(self) -> Wire:
        return Wire(10 * self.collected, 20 * self.collected)


@pytest.fixture(scope="module")
def reference(tiny_qwen2_root) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()
    return hf_greedy(model, PROMPT, 16)


def backend_of(root, lives: int) -> DyingBackend:
    store = Store(root / "store")
    return DyingBackend(store.load_head(), [store.load_span(0, 5)], lives=lives)


@pytest.mark.parametrize("mode", ["ar", "dsd"])
def test_a_generation_reports_the_engines_counters_and_the_transport(tiny_qwen2_root, reference, mode: str) -> None:
    backend = backend_of(tiny_qwen2_root, lives=10**6)
    cfg = GenerationConfig(mode=mode, max_new_tokens=16)
    report = trio.run(lambda: generate(backend, None if mode == "ar" else NgramDrafter(), cfg, PROMPT))
    assert isinstance(report, GenerationReport) and report.tokens == reference
    assert report.result.rounds == backend.collected and report.transport == Wire(10 * backend.collected,
                                                                                   20 * backend.collected)
    out = report.as_dict()
    assert out["tokens"] == reference and out["bytes_received"] == 20 * backend.collected
    assert out["mode"] == mode and out["rounds"] == report.result.rounds


@pytest.mark.parametrize("mode", ["ar", "sd", "dsd"])
def test_a_backend_that_gives_out_midway_leaves_the_tokens_so_far_and_says_why(tiny_qwen2_root, reference,
                                                                              mode: str) -> None:
    backend = backend_of(tiny_qwen2_root, lives=4)
    cfg = GenerationConfig(mode=mode, max_new_tokens=16, gamma=2)
    with pytest.raises(GenerationFailed) as info:
        trio.run(lambda: generate(backend, None if mode == "ar" else NgramDrafter(), cfg, PROMPT))
    failed = info.value
    assert 1 <= len(failed.tokens) < 16 and failed.tokens == reference[: len(failed.tokens)]
    assert failed.result.rounds == 4 and failed.result.elapsed_s > 0
    assert failed.failure.verdict == "no_worker" and failed.failure.blamed == ["peer-x"]
    assert failed.transport == Wire(40, 80)
    out = failed.as_dict()
    assert out["tokens"] == failed.tokens and out["failure"]["verdict"] == "no_worker"
    assert out["error"] == "every worker left"
