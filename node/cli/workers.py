"""`dsd-node workers`: list the federated workers of a model or vocabulary, with K cap and RTT."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .options import add_wan_options, link_profile


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("workers", help="list the federated workers of a model or vocabulary, with K cap and RTT")
    p.add_argument("--bootstrap", action="append", required=True, metavar="MULTIADDR", help="a peer of the swarm (repeatable)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="workers of this model id")
    which.add_argument("--vocab", type=int, metavar="V", help="workers of any model with this vocabulary size")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_wan_options(p)
    p.set_defaults(func=cmd_workers)


def cmd_workers(args: argparse.Namespace) -> int:
    import trio

    from dsd.node.federated.pool import list_workers
    from dsd.node.peer.host import head_node

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
