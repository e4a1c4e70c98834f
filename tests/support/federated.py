"""Federated generation as the tests run it, and the reference it must equal: greedy decoding of the workers'
weighted average."""

from __future__ import annotations

import torch

from dsd.node.head.sampling import SamplingParams

from .models import TINY_VOCAB, make_tiny_model


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
