"""Shared fixtures: tiny random Llama / Qwen2 causal LMs saved with save_pretrained and converted to
stores once per session, plus a tiny byte-level BPE tokenizer. No downloads; a few seconds total.

Torch is limited to one thread: the test machine is small and shared.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

TINY_VOCAB = 300
TINY_HIDDEN = 64
TINY_LAYERS = 5
TINY_SEED = 0

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "The quick brown fox jumps over the lazy dog.",
    "import numpy as np\nx = np.zeros((3, 4))\n",
    "class Node:\n    def __init__(self, value):\n        self.value = value\n",
] * 20


def tiny_config(family: str, *, layers: int = TINY_LAYERS, tie: bool | None = None, **overrides: object):
    """A tiny config of `family` ("llama" or "qwen2"): GQA (4 heads, 2 KV), rope_theta 12345,
    init range 0.2 so logits are O(1). Qwen2 has attention bias and tied embeddings by default
    (like Qwen2.5-Coder), Llama untied."""
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, object] = dict(
        hidden_size=TINY_HIDDEN,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=512,
        rope_theta=12345.0,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        common["tie_word_embeddings"] = False if tie is None else tie
        common.update(overrides)
        return LlamaConfig(**common)
    if family == "qwen2":
        common["tie_word_embeddings"] = True if tie is None else tie
        common.update(overrides)
        return Qwen2Config(**common)
    raise ValueError(f"no tiny config for family {family!r}")


def tiny_tokenizer():
    """A byte-level BPE tokenizer (<= TINY_VOCAB ids, specials <pad>=0 <s>=1 </s>=2) trained in-process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def make_tiny_model(family: str, *, seed: int = TINY_SEED, layers: int = TINY_LAYERS, **overrides: object):
    """A tiny random causal LM of `family` in eval mode, deterministic for a given seed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, layers=layers, **overrides)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def save_tiny_model(family: str, folder: Path, *, with_tokenizer: bool = True, **kwargs: object) -> Path:
    """Build a tiny model (see make_tiny_model) and save it as an HF folder, optionally with a tokenizer."""
    model = make_tiny_model(family, **kwargs)
    model.save_pretrained(folder)
    if with_tokenizer:
        tiny_tokenizer().save_pretrained(folder)
    return folder


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


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run `dsd-node ARGS` as a subprocess of this interpreter (what a user's shell would run)."""
    return subprocess.run([sys.executable, "-m", "dsd.node.cli", *args], capture_output=True, text=True, timeout=timeout)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value; cells expecting < 5 draws are pooled into one."""
    probs = probs.double().flatten() / probs.double().sum()
    counts = counts.double().flatten()
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, f"emitted tokens outside the target support: {counts.tolist()}"
    expected = n * probs
    big = expected >= 5
    small = support & ~big
    obs = counts[big].tolist()
    exp = expected[big].tolist()
    if small.any():
        obs.append(float(counts[small].sum()))
        exp.append(float(expected[small].sum()))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    dof = len(obs) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The reference: `n` greedy tokens of an HF causal LM after `prompt` (no EOS stop)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@contextlib.contextmanager
def cli_testnet(state: Path, *args: str) -> Iterator[dict]:
    """`dsd-node testnet up --state STATE ARGS --json` for the block; always `testnet down` after it."""
    up = cli("testnet", "up", "--state", str(state), *args, "--json")
    assert up.returncode == 0, up.stderr[-3000:]
    try:
        yield json.loads(up.stdout)
    finally:
        cli("testnet", "down", "--state", str(state), timeout=60)


@contextlib.contextmanager
def cli_serve(state: Path, bootstrap: str, store: Path, *args: str) -> Iterator[dict]:
    """`dsd-node serve` on a free port for the block (ready file and log in STATE); yields its ready info + log."""
    from dsd.node.testnet.processes import spawn, stop_processes, wait_ready

    proc = spawn("serve", ["serve", "--bootstrap", bootstrap, "--store", str(store), "--port", "0",
                           "--ready-file", str(state / "serve.json"), "--threads", "1", *args], state)
    try:
        info = wait_ready(state / "serve.json", proc, 120)
        yield {**info, "log": proc.log}
    finally:
        stop_processes([proc.pid])
        print(f"serve log: {proc.log}")
