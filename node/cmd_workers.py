"""Federated mode on the command line: `dsd-node workers` (list federated workers) and the body of
`dsd-node generate --federated` (draft locally, verify against the workers' aggregated top-K)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .cmd_daemon import add_wan_options, link_profile


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("workers", help="list the federated workers of a model or vocabulary, with K cap and RTT")
    p.add_argument("--bootstrap", action="append", required=True, metavar="MULTIADDR", help="a peer of the swarm (repeatable)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="workers of this model id")
    which.add_argument("--vocab", type=int, metavar="V", help="workers of any model with this vocabulary size")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_wan_options(p)
    p.set_defaults(func=cmd_workers)


def add_generate_options(p: argparse.ArgumentParser) -> None:
    """The `generate --federated` options (called by cmd_generate's register)."""
    g = p.add_argument_group("federated mode (SpecFed): --store is the draft; workers hold whole models")
    g.add_argument("--federated", action="store_true", help="verify against federated workers' top-K distributions")
    g.add_argument("--workers", default="auto", metavar="auto|PEER_ID,...", help="workers to use (default auto: every live worker of the vocabulary, sorted by peer id)")
    g.add_argument("--weights", default=None, metavar="W1,W2,...", help="aggregation weights in the order of --workers (default equal)")
    g.add_argument("--topk", type=int, default=None, metavar="K", help="K asked of every worker (default: each worker's own cap)")
    g.add_argument("--reconstruct", choices=("renormalize", "residual"), default="residual", help="how a top-K is rebuilt into a distribution (default residual)")
    g.add_argument("--worker-timeout", type=float, default=60.0, metavar="S", help="window deadline: a worker later than S seconds is left out of that window")


async def list_workers(node: Any, *, model: str | None, vocab: int | None) -> list[dict[str, Any]]:
    """Live federated workers of `model` (or of vocabulary `vocab`), with RTT and (via Hello) their model."""
    import trio

    from dsd.discovery.ping import measure_rtt

    from .federated import describe_worker, find_workers

    infos = await find_workers(node, vocab or 0, model=model)
    rows: list[dict[str, Any]] = []

    async def one(info: Any) -> None:
        row = {"peer_id": info.peer_id, "addrs": list(info.addrs), "model": info.model, "vocab_size": info.vocab_size,
               "topk_cap": info.topk_cap, "num_layers": info.num_layers, "throughput": round(info.throughput, 3),
               "rtt_ms": None}
        try:
            row["rtt_ms"] = round(await measure_rtt(node, info.peer_id, info.addrs) * 1000, 3)
            if info.model is None:
                row["model"] = (await describe_worker(node, info.peer_id, info.addrs))["model"]
        except Exception as exc:  # unreachable, timeout, refused
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)

    async with trio.open_nursery() as nursery:
        for info in infos:
            nursery.start_soon(one, info)
    return sorted(rows, key=lambda r: r["peer_id"])


def cmd_workers(args: argparse.Namespace) -> int:
    import trio

    from .headnode import head_node

    async def main() -> list[dict[str, Any]]:
        async with head_node(args.bootstrap, link_profile(args)) as (node, _legs):
            return await list_workers(node, model=args.model, vocab=args.vocab)

    workers = trio.run(main)
    if args.json:
        print(json.dumps({"model": args.model, "vocab": args.vocab, "workers": workers}, indent=2))
        return 0 if workers else 1
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"federated workers of {args.model or f'vocabulary {args.vocab}'}")
    for col in ("peer", "model", "vocab", "K cap", "layers", "tok/s", "RTT ms"):
        table.add_column(col)
    for w in workers:
        table.add_row(w["peer_id"][-12:], str(w["model"]), str(w["vocab_size"]), str(w["topk_cap"]), str(w["num_layers"]),
                      f"{w['throughput']:.1f}", "-" if w["rtt_ms"] is None else f"{w['rtt_ms']:.1f}")
    Console().print(table)
    if not workers:
        print("no federated workers found", file=sys.stderr)
    return 0 if workers else 1


def parse_weights(text: str | None) -> list[float] | None:
    """`1,2.5,...` -> floats; None stays None (equal weights)."""
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"dsd-node: --weights must be comma-separated numbers, got {text!r}") from None


def cmd_generate_federated(args: argparse.Namespace) -> int:
    """`dsd-node generate --federated`: the server drafts with --draft (default: the --store model itself)."""
    import torch
    import trio

    from dsd.shard_store import Store, StoreError

    from .cmd_generate import encode_prompt, eos_ids
    from .drafters import ModelDrafter, NgramDrafter
    from .federated import FederatedError, find_workers, generate_federated
    from .head import GenerationConfig
    from .headnode import head_node
    from .sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode == "ar":
        print("dsd-node: --federated drafts by design; use --mode sd or dsd", file=sys.stderr)
        return 2
    weights = parse_weights(args.weights)
    peer_ids = None if args.workers == "auto" else [p.strip() for p in args.workers.split(",") if p.strip()]
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        store = Store(args.store)
        tokenizer = store.load_tokenizer()
        vocab = int(store.manifest.vocab_size)
        draft = args.draft or str(args.store)
        if draft == "ngram":
            drafter: Any = NgramDrafter()
        else:
            dstore = Store(Path(draft))
            drafter = ModelDrafter(dstore.load_full(), params, torch.Generator().manual_seed(args.seed + 1))
            drafter.check_compatible(vocab, tokenizer, dstore.load_tokenizer())
        cfg = GenerationConfig(
            mode=args.mode, max_new_tokens=args.max_new_tokens, params=params, gamma=args.gamma,
            gamma_max=args.gamma_max, tau_max=args.tau_max if args.mode == "dsd-adaptive" else 0.0, seed=args.seed,
            eos_ids=eos_ids(tokenizer, store.manifest.config), stop_strings=tuple(args.stop),
        )
    except (ValueError, StoreError, OSError) as exc:
        print(f"dsd-node: {exc}", file=sys.stderr)
        return 2
    prompt = encode_prompt(args, tokenizer)
    streamed: list[int] = []

    def on_tokens(toks: list[int]) -> None:
        if args.json or tokenizer is None:
            return
        before = tokenizer.decode(streamed, skip_special_tokens=True)
        streamed.extend(toks)
        sys.stdout.write(tokenizer.decode(streamed, skip_special_tokens=True)[len(before):])
        sys.stdout.flush()

    async def main() -> dict | FederatedError:
        async with head_node(args.bootstrap, link_profile(args), seed=args.seed) as (node, _legs):
            try:
                workers = await find_workers(node, vocab, peer_ids=peer_ids)
                if not workers:
                    raise FederatedError(f"no live federated worker with a vocabulary of {vocab} tokens")
                return await generate_federated(
                    node, workers, drafter, prompt, cfg, vocab_size=vocab, top_k=args.topk, weights=weights,
                    method=args.reconstruct, window_timeout_s=args.worker_timeout, tokenizer=tokenizer,
                    on_tokens=on_tokens,
                )
            except FederatedError as exc:  # returned, so it does not leave the node's nursery as a group
                return exc

    report = trio.run(main)
    if isinstance(report, FederatedError):
        print(f"\ndsd-node: federated generation failed: {report}", file=sys.stderr)
        return 1
    report["text"] = tokenizer.decode(report["tokens"], skip_special_tokens=True) if tokenizer is not None else None
    if args.json:
        print(json.dumps(report))
    else:
        sys.stdout.write("\n")
        print(
            f"[federated {report['mode']}] {report['new_tokens']} tokens in {report['elapsed_s']:.2f} s, "
            f"{len([w for w in report['workers'] if w['state'] == 'active'])}/{len(report['workers'])} workers, "
            f"acceptance {report['acceptance_rate']:.2f}, uplink {report['uplink_bytes_per_token']:.0f} B/token, "
            f"missed {report['missed']}", file=sys.stderr,
        )
    return 0
