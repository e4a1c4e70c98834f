"""Fixtures every room of the tests uses: tiny random Llama / Qwen2 models saved with save_pretrained and converted to
stores once per session, the transformers reference of the tiny Qwen2 and a noisy draft of it, and the tiny models
of the sampling tests. Helpers live in `support/` by what they serve. Torch is limited to one thread: the test
machine is small and shared.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.models import make_tiny_model, noisy_copy, save_tiny_model
from support.processes import ForkServer
from support.sampling import SAMPLING_PROMPT, SAMPLING_VOCAB

torch.set_num_threads(1)


def _store_factory(tmp_path_factory: pytest.TempPathFactory, family: str, **kwargs: object) -> Path:
    from dsd.shard_store import convert

    root = tmp_path_factory.mktemp(f"tiny_{family}")
    hf = save_tiny_model(family, root / "hf", **kwargs)
    convert(hf, root / "store", model_id=f"tiny-{family}")
    return root


@pytest.fixture(scope="session")
def tiny_llama_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder holding `hf/` (tiny Llama, save_pretrained, with tokenizer) and `store/` (converted)."""
    return _store_factory(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder holding `hf/` (tiny Qwen2, save_pretrained, with tokenizer) and `store/` (converted)."""
    return _store_factory(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_llama_root: Path) -> Path:
    """HF folder of the tiny Llama (read-only: tests share it)."""
    return tiny_llama_root / "hf"


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_qwen2_root: Path) -> Path:
    """HF folder of the tiny Qwen2 (read-only: tests share it)."""
    return tiny_qwen2_root / "hf"


@pytest.fixture(scope="session")
def tiny_llama_store(tiny_llama_root: Path) -> Path:
    """Store of the tiny Llama (read-only: copy it before tampering)."""
    return tiny_llama_root / "store"


@pytest.fixture(scope="session")
def tiny_qwen2_store(tiny_qwen2_root: Path) -> Path:
    """Store of the tiny Qwen2 (read-only: copy it before tampering)."""
    return tiny_qwen2_root / "store"


@pytest.fixture(scope="session")
def tiny_qwen2_draft_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Store of a 2-layer tiny Qwen2 with the same vocabulary/tokenizer as tiny_qwen2 (a draft model)."""
    return _store_factory(tmp_path_factory, "qwen2", seed=1, layers=2) / "store"


@pytest.fixture(scope="session")
def tiny_store(request: pytest.FixtureRequest) -> Callable[[str], Path]:
    """tiny_store(family) -> the session store of "llama" or "qwen2" (for parametrised tests)."""

    def get(family: str) -> Path:
        return request.getfixturevalue(f"tiny_{family}_store")

    return get


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest modules first (tests/module_seconds.json; new modules count as short), each module's tests in their
    own order: with `--no-loadscope-reorder` the two workers take modules in this order, and the short ones fill the
    end instead of a long one running alone (refresh the file with tests/support/module_seconds.py)."""
    weights = json.loads((Path(__file__).parent / "module_seconds.json").read_text())
    items.sort(key=lambda item: -weights.get(item.nodeid.split("::")[0], 0.0))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if ForkServer._session is not None:
        ForkServer._session.close()


@pytest.fixture(scope="session")
def tiny_qwen2_hf(tiny_qwen2_root: Path) -> torch.nn.Module:
    """The tiny Qwen2 loaded by transformers in float32, eval mode: the reference (read-only: tests share it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def noisy_draft(tiny_qwen2_hf: torch.nn.Module) -> torch.nn.Module:
    """The tiny Qwen2 with 10 % noise on its decoder layers: it agrees with the target about 60 % of the
    time, and where not, the target's token is often its 2nd or 3rd choice (read-only)."""
    return noisy_copy(tiny_qwen2_hf, 0.1)


@pytest.fixture(scope="session")
def noisy_draft_store(noisy_draft: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`noisy_draft` as a store (model id tiny-qwen2-noisy), for `--draft`."""
    from dsd.shard_store.writer import write_store

    folder = tmp_path_factory.mktemp("noisy") / "store"
    write_store(noisy_draft, folder, model_id="tiny-qwen2-noisy")
    return folder


@pytest.fixture(scope="module")
def sampling_models(tmp_path_factory: pytest.TempPathFactory):
    """(target head, target span, draft model, exact joint distribution of the first two tokens after
    SAMPLING_PROMPT [V, V]) for a 1-layer target and a different 1-layer draft of SAMPLING_VOCAB tokens."""
    from dsd.shard_store import Store
    from dsd.shard_store.writer import write_store

    tiny = dict(layers=1, hidden_size=16, intermediate_size=32, vocab_size=SAMPLING_VOCAB)
    target = make_tiny_model("llama", seed=11, **tiny)
    draft = make_tiny_model("llama", seed=22, **tiny)
    folder = tmp_path_factory.mktemp("target") / "store"
    write_store(target, folder, model_id="tiny-target")
    store = Store(folder)
    prompt, vocab = SAMPLING_PROMPT, SAMPLING_VOCAB
    with torch.inference_mode():
        first = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), dim=-1)
        second = torch.softmax(target(torch.tensor([[*prompt, t] for t in range(vocab)])).logits[:, -1].double(), dim=-1)
        q = torch.softmax(draft(torch.tensor([[*prompt, t] for t in range(vocab)])).logits[:, -1].double(), dim=-1)
    # The draft really differs from the target where it is verified (else a broken rule could pass).
    assert float((0.5 * (second - q).abs().sum(-1)).min()) > 0.2
    return store.load_head(), store.load_span(0, 1), draft, first[:, None] * second
