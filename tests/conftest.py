"""Shared fixtures and helpers: tiny random Llama / Qwen2 causal LMs saved with save_pretrained and
converted to stores once per session, plus a tiny byte-level BPE tokenizer (no downloads; a few seconds
total); the CLI as a user runs it (`cli`, `cli_testnet`, `cli_serve`) and daemons started one by one
(`DaemonSwarm`); raw frames and streams as a hostile client sends them (`raw_frame`, `raw_exchange`);
the references (HF greedy, a noisy draft, greedy decoding of federated workers' average, the exact
law of the first tokens for the sampling tests). Test modules import helpers from here, never from
each other.

Torch is limited to one thread: the test machine is small and shared.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from dsd.node.head.backend import Capabilities
from dsd.node.head.local import LocalBackend
from dsd.node.head.sampling import SamplingParams, warp
from dsd.node.route.backend import RouteBackend

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


class ForkServer:
    """The session's fork server (tests/forkserver.py): `dsd-node` commands as processes of their own,
    forked from one interpreter that imported torch, transformers and libp2p once."""

    _session: ForkServer | None = None

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.replies: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        if self.replies.get(timeout=300) != {"ready": True}:
            raise RuntimeError("the fork server did not start (see stderr)")

    @classmethod
    def session(cls) -> ForkServer:
        if cls._session is None or cls._session.proc.poll() is not None:
            cls._session = cls()
        return cls._session

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.replies.put(json.loads(line))
        self.replies.put(None)

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run `dsd-node ARGV` in a forked child; its output and exit code, or TimeoutExpired (the child killed)."""
        import tempfile

        assert self.proc.stdin is not None
        cmd = ["dsd-node", *argv]
        with tempfile.TemporaryDirectory(prefix="cli-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "stdout": str(out), "stderr": str(err),
                       "daemon": False}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            started = self.replies.get(timeout=60)
            assert started is not None, "the fork server died"
            try:
                done = self.replies.get(timeout=timeout)
            except queue.Empty:
                os.kill(started["pid"], signal.SIGKILL)
                self.replies.get(timeout=60)
                raise subprocess.TimeoutExpired(cmd, timeout, output=out.read_text(errors="replace"),
                                                stderr=err.read_text(errors="replace")) from None
            assert done is not None, "the fork server died"
            return subprocess.CompletedProcess(cmd, done["returncode"], out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))

    def start(self, name: str, argv: list[str], state: Path):
        """Start the daemon `dsd-node -v ARGV` in a forked child of its own session, its log in STATE/logs/NAME.log
        (`dsd.node.testnet.processes.spawn` without the imports); its process, which `stop_processes` stops."""
        from dsd.node.testnet.processes import PeerProcess, log_path_of, process_start

        assert self.proc.stdin is not None
        log = str(log_path_of(state, name))
        request = {"argv": ["-v", *argv], "cwd": os.getcwd(), "env": dict(os.environ), "stdout": log, "stderr": log,
                   "daemon": True}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        started = self.replies.get(timeout=60)
        assert started is not None, "the fork server died"
        return PeerProcess(name=name, pid=started["pid"], log=log, started=process_start(started["pid"]))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if ForkServer._session is not None:
        ForkServer._session.close()


def daemon(name: str, args: list[str], state: Path):
    """`dsd-node -v ARGS` as a daemon of its own (`dsd.node.testnet.processes.spawn`, forked from the session's
    fork server): log in STATE/logs/NAME.log; its process, for `wait_ready` and `stop_processes`."""
    return ForkServer.session().start(name, args, state)


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run `dsd-node ARGS` in a process of its own, as a user's shell would (forked from the session's
    fork server, so it skips the imports; see tests/forkserver.py)."""
    return ForkServer.session().run(list(args), timeout)


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
def cli_serve(state: Path, bootstrap: str, store: Path | None, *args: str) -> Iterator[dict]:
    """`dsd-node serve` on a free port for the block (ready file and log in STATE); yields its ready info + log.
    `store` None: ARGS say where the target comes from (`--model ... --manifest-sha256 ...`)."""
    from dsd.node.testnet.processes import stop_processes, wait_ready

    target = [] if store is None else ["--store", str(store)]
    proc = ForkServer.session().start("serve", ["serve", "--bootstrap", bootstrap, *target, "--port", "0",
                                                "--ready-file", str(state / "serve.json"), "--threads", "1", *args],
                                      state)
    try:
        info = wait_ready(state / "serve.json", proc, 120)
        yield {**info, "log": proc.log}
    finally:
        stop_processes([proc])
        print(f"serve log: {proc.log}")


class DaemonSwarm:
    """`dsd-node start` daemons on loopback: a bootstrap node, then peers added one by one, each with its key,
    ready file and log in `state`; `stop` (or leaving the `with` block) ends them all, the last started first."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.procs: list = []
        self.bootstrap = self.start("bootstrap", "--bootstrap-only")["addrs"][0]

    def __enter__(self) -> DaemonSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def spawn(self, name: str, *args: str):
        """Start `dsd-node start ARGS` as NAME without waiting (`ready` waits): several daemons start at once."""
        proc = ForkServer.session().start(name, ["start", *args, "--identity", str(self.state / f"{name}.key"),
                                                 "--ready-file", str(self.state / f"{name}.json")], self.state)
        self.procs.append(proc)
        return proc

    def ready(self, proc) -> dict:
        """A spawned daemon's ready info (peer_id, addrs, its span...) with its name, pid, start time and log,
        once it serves (`PeerProcess.from_dict` of it is what `stop_processes` takes)."""
        from dsd.node.testnet.processes import wait_ready

        info = wait_ready(self.state / f"{proc.name}.json", proc, 120)
        return {**info, "name": proc.name, "pid": proc.pid, "started": proc.started, "log": proc.log}

    def start(self, name: str, *args: str) -> dict:
        return self.ready(self.spawn(name, *args))

    def peer(self, name: str, store: Path, blocks: str, *args: str) -> dict:
        """A block peer serving `blocks` of `store` (one torch thread), joined through the bootstrap node; its
        ready info, pid, log and the bootstrap address."""
        info = self.start(name, "--store", str(store), "--blocks", blocks, "--bootstrap", self.bootstrap,
                          "--threads", "1", *args)
        return {**info, "bootstrap": self.bootstrap}

    def wait_route(self, model: str, num_layers: int, blocks: tuple[int, int] | None = None) -> None:
        """Until the peers announce a complete route over `blocks` (default every layer)."""
        import trio

        from dsd.discovery.survey import wait_for_route
        from dsd.node.peer.host import head_node

        async def main() -> None:
            async with head_node([self.bootstrap]) as (node, _legs):
                await wait_for_route(node, model, num_layers, 60, poll_s=0.3, blocks=blocks)

        trio.run(main)

    def stop(self) -> None:
        from dsd.node.testnet.processes import stop_processes

        stop_processes(list(reversed(self.procs)))


def swarm_of(node, model: str, num_layers: int, blocks: tuple[int, int] | None = None):
    """The test head's view of the swarm (one per head, as in a head process): what its routes plan failovers on."""
    from dsd.discovery.swarm import SwarmWatch

    return SwarmWatch(node, model, num_layers, blocks=blocks)


async def generate_on(node, legs, setup, prompt: list[int], cfg, *, hops=None, local_span=None, tokenizer=None):
    """One generation from a test head already in the swarm over a route (`hops`, else planned), the head serving
    `local_span` itself: a `GenerationReport` (`GenerationFailed` comes out as itself)."""
    from dsd.node.peer.generation import RouteTarget, generate_over_swarm, swarm_watch

    target = RouteTarget(hops=hops, local=local_span)
    return await generate_over_swarm(node, legs, swarm_watch(node, setup, target.local_blocks), setup, prompt, cfg,
                                     target=target, tokenizer=tokenizer)


# --- raw frames and streams, as a hostile client sends them ---------------------------------------


def raw_frame(body: dict | bytes) -> bytes:
    """A frame of any wire map (msgpack), or of any bytes as they are, with its 4-byte length: what the
    message classes refuse to build."""
    import msgpack

    raw = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    return len(raw).to_bytes(4, "big") + raw


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` cut at the offsets `cuts` (taken modulo its length + 1): the chunks a stream may deliver."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


async def read_frames(stream, decoder, replies: int | None = None) -> list:
    """Frames read from a raw stream until the peer closes (or resets) it, or `replies` have come."""
    got: list = []
    while replies is None or len(got) < replies:
        try:
            chunk = await stream.read(65536)
        except Exception:  # reset by the peer
            break
        if not chunk:
            break
        got.extend(decoder.feed(chunk))
    return got


async def raw_exchange(node, peer: dict, protocol: str, data: bytes, *, replies: int | None = None,
                       timeout: float = 20.0, close_write: bool = False) -> list:
    """Write raw bytes on a fresh `protocol` stream to `peer` ({peer_id, addrs}), closing our side after them
    if `close_write`; the frames answered until the peer closed the stream (or `replies` came). Taking
    longer than `timeout` fails the test (trio.TooSlowError). The stream is reset at the end."""
    import trio

    from dsd.protocol import FrameDecoder

    stream = await node.open_raw(peer["peer_id"], peer["addrs"], protocol)
    try:
        with trio.fail_after(timeout):
            await stream.write(data)
            if close_write:
                with contextlib.suppress(Exception):
                    await stream.close_write()
            return await read_frames(stream, FrameDecoder(), replies)
    finally:
        with trio.move_on_after(5), contextlib.suppress(Exception):
            await stream.reset()


# --- a tiny Qwen2 target as transformers runs it, and a draft that often disagrees with it -----------


def noisy_copy(model: torch.nn.Module, noise: float, seed: int = 0) -> torch.nn.Module:
    """The target with Gaussian noise (`noise` × each tensor's std) on its decoder layers: a draft that
    agrees with the target often but not always, and whose misses are often its 2nd or 3rd choice."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if ".layers." in name:
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return out.eval()


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


class KillOnTree(RouteBackend):
    """A route backend that kills the route's last hop (SIGKILL, by `pids[peer_id]`) just before the first
    tree window goes out, and notes whether the tree was replayed on the new route."""

    def __init__(self, *args, pids: dict[str, int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pids = pids
        self.killed: str | None = None
        self.replayed_tree = False

    async def submit(self, tokens: Sequence[int], *, start: int, commit: int, epoch: int,
                     parents: Sequence[int] | None = None, keep: Sequence[int] | None = None) -> None:
        if parents is not None and self.killed is None:
            self.killed = self.session.hops[-1].peer_id
            os.kill(self.pids[self.killed], signal.SIGKILL)
        await super().submit(tokens, start=start, commit=commit, epoch=epoch, parents=parents, keep=keep)

    async def _replay(self, epoch: int) -> None:
        self.replayed_tree = self.replayed_tree or self._parents is not None
        await super()._replay(epoch)


# --- federated workers: two tiny Qwen2 models sharing a vocabulary, as a real testnet ----------------


@pytest.fixture(scope="module")
def worker_b_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second worker model: another seed and depth (3 layers), same vocabulary and tokenizer, model id
    tiny-qwen2-b: `hf/` and `store/`."""
    from dsd.shard_store import convert

    root = tmp_path_factory.mktemp("worker_b")
    convert(save_tiny_model("qwen2", root / "hf", seed=1, layers=3), root / "store", model_id="tiny-qwen2-b")
    return root


@pytest.fixture(scope="module")
def federated_net(tiny_qwen2_root: Path, worker_b_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """`testnet up --federated` with worker "a" (tiny-qwen2, 5 layers) and "b" (tiny-qwen2-b), fp32 top-K;
    a worker a test stopped (SIGSTOP) is resumed before `testnet down`."""
    state = tmp_path_factory.mktemp("fednet")
    up = cli("testnet", "up", "--federated", "--store", str(tiny_qwen2_root / "store"), "--store2",
             str(worker_b_root / "store"), "--state", str(state), "--topk-codec", "fp32", "--record-ttl", "10", "--json")
    assert up.returncode == 0, up.stderr[-3000:]
    info = json.loads(up.stdout)
    workers = [p for p in info["peers"] if p["role"] == "federated"]
    info["a"], info["b"] = workers[0], workers[1]
    yield info
    for w in workers:  # a test may have stopped one
        try:
            os.kill(w["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    down = cli("testnet", "down", "--state", str(state), timeout=60)
    assert down.returncode == 0, down.stderr


@pytest.fixture(scope="module")
def federated_models(tiny_qwen2_root: Path, worker_b_root: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Both workers' models as transformers runs them (float32, eval)."""
    from transformers import AutoModelForCausalLM

    def load(root: Path) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()

    return load(tiny_qwen2_root), load(worker_b_root)


def average_greedy(models, prompt: list[int], n: int, weights: tuple[float, float],
                   switch_at: int | None = None) -> list[int]:
    """Greedy decoding of the weighted average of both models' softmax; from token `switch_at` on, model A alone."""
    seq = list(prompt)
    with torch.no_grad():
        for i in range(n):
            ps = [torch.softmax(m(input_ids=torch.tensor([seq])).logits[0, -1].double(), -1) for m in models]
            p = ps[0] if switch_at is not None and i >= switch_at else weights[0] * ps[0] + weights[1] * ps[1]
            seq.append(int(torch.argmax(p)))
    return seq[len(prompt):]


def run_federated(net: dict, prompt: list[int], cfg, **kw) -> dict:
    """One federated generation from a fresh head over both workers of `net` (`federated_net`) with a random
    2-layer draft, as `--json` reports it; `kw` goes to `FederatedBackend` (`server_vocab` and `workers`
    override the vocabulary and the workers found, `on_tokens` sees the tokens). A FederatedError or GenerationFailed comes out as itself."""
    import trio

    from dsd.node.federated.backend import open_federated_backend
    from dsd.node.federated.pool import FederatedError, find_workers
    from dsd.node.head.drafters import ModelDrafter
    from dsd.node.head.generation import generate
    from dsd.node.head.report import GenerationFailed
    from dsd.node.head.sampling import SamplingParams
    from dsd.node.peer.host import head_node

    failed: list[Exception] = []

    async def main():
        async with head_node([net["bootstrap"]]) as (node, _):
            vocab = kw.pop("server_vocab", TINY_VOCAB)
            workers = kw.pop("workers", None)
            on_tokens = kw.pop("on_tokens", None)
            with trio.move_on_after(20):  # a worker stopped by an earlier test re-announces within TTL/3
                while workers is None:
                    found = {w.peer_id: w for w in await find_workers(node, TINY_VOCAB)}
                    if net["a"]["peer_id"] in found and net["b"]["peer_id"] in found:
                        workers = [found[net["a"]["peer_id"]], found[net["b"]["peer_id"]]]
                    else:
                        await trio.sleep(0.5)
            assert workers is not None, "both workers must be announced"
            drafter = ModelDrafter(make_tiny_model("qwen2", seed=21, layers=2), SamplingParams())
            try:
                async with open_federated_backend(node, workers, vocab_size=vocab, params=cfg.params,
                                                  max_len=cfg.session_len(len(prompt)), deadline=cfg.deadline,
                                                  **kw) as backend:
                    return (await generate(backend, drafter, cfg, prompt, on_tokens=on_tokens)).as_dict()
            except (FederatedError, GenerationFailed) as exc:  # raised outside the node's nursery, not as a group
                failed.append(exc)

    report = trio.run(main)
    if failed:
        raise failed[0]
    return report


class ProbsBackend(LocalBackend):
    """The whole model in-process, answering with warped probabilities as a federated worker would."""

    capabilities = Capabilities(trees=True, pipeline=True, probs=True)

    def __init__(self, head, spans, temperature: float) -> None:
        super().__init__(head, spans)
        self.temperature = temperature

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        logits = await super().collect(epoch=epoch, rows=rows)
        return warp(logits, SamplingParams(temperature=self.temperature or 1.0))


# --- lossless sampling through the engine: a tiny 1-layer target and another draft, vocabulary 12 ------

SAMPLING_VOCAB = 12
SAMPLING_PROMPT = [1, 5, 7]
SAMPLING_RUNS = 3000
SAMPLING_BROKEN_RUNS = 1200  # plenty: each broken rule scores p < 1e-8 with these
SAMPLING_ALPHA = 1e-3  # a correct rule fails with this probability (the seeds are fixed: it passes or fails for good)
SAMPLING_TREE_NODES = 4  # the tree case: the second window is the draft's 4 likeliest tokens, siblings of the root
T1 = SamplingParams(temperature=1.0)


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


def pair_counts(pairs: list[tuple[int, int]], vocab: int = SAMPLING_VOCAB) -> torch.Tensor:
    """Counts [V, V] of (first, second) token pairs."""
    counts = torch.zeros(vocab, vocab)
    for a, b in pairs:
        counts[a, b] += 1
    return counts


def sampling_p_values(models, pairs: list[tuple[int, int]]) -> tuple[float, float]:
    """p-values of the first tokens and of the first two of `pairs` against the target's exact distributions."""
    joint = models[3]
    counts = pair_counts(pairs, joint.shape[0])
    return chi2_pvalue(counts.sum(1), joint.sum(1)), chi2_pvalue(counts, joint)
