"""`dsd-node serve`: keep the head loaded and serve an OpenAI-compatible API over the swarm."""

from __future__ import annotations

import argparse
from pathlib import Path

from dsd.node.head.modes import MODE_HELP, MODES
from dsd.node.service.defaults import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_PER_CLIENT,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PORT,
    DEFAULT_QUEUE,
    DEFAULT_REFRESH_S,
)

from .generate import _tree_nodes
from .options import (
    add_audit_options,
    add_cpus_option,
    add_deadline_options,
    add_device_options,
    add_head_options,
    add_overlap_options,
    add_wan_options,
    audit_options,
    deadline_rule,
    fail,
    link_profile,
    listen_addrs,
    overlap_options,
    pin_head_process,
)
from .store import add_fetch_options, fetched_store


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (completions, chat, streaming), a live swarm page at / and /metrics")
    add_head_options(p, store_help="the target's store: the head loads its embeddings, final norm, lm_head and tokenizer (chat template) once")
    p.add_argument("--draft", default="ngram", metavar="DRAFT_STORE|ngram|DRAFT_STORE+ngram", help="drafter, loaded once and shared by every request (default ngram: model-free prompt lookup)")
    p.add_argument("--draft-quant", choices=("none", "int8"), default="none", help="quantize the draft model's linear layers (int8: torch dynamic int8 on the CPU, a q4k draft store dequantized first; none: the store as held) (default none)")
    p.add_argument("--head-batching", choices=("on", "off"), default="on", help="run the draft forwards of every request waiting at once as one forward over one shared token tree (default on; off: each request drafts alone, as before)")
    p.add_argument("--mode", choices=MODES, default="dsd", help=MODE_HELP)
    p.add_argument("--gamma-max", type=int, default=16, help="largest draft window (default 16)")
    p.add_argument("--tau-max", type=float, default=0.3, help="dsd-adaptive only: largest relaxation (default 0.3, LOSSY)")
    add_overlap_options(p)
    p.add_argument("--tree-nodes", type=_tree_nodes, default=None, metavar="N|auto", help="token-tree window budget (default auto; 0 = chains); trees need a draft model store")
    p.add_argument("--blocks", default=None, metavar="A:B", help="layers the head serves itself, the model's first (0:B) or last (A:L) ones, from its store (which must hold those layer files): every route covers the others, one peer and one link crossing fewer")
    p.add_argument("--federated", action="store_true", help="not in serve: it verifies over a route of block peers; for federated workers (whole models) use `dsd-node generate --federated`")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST}: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT}; 0 = any free port, see --ready-file)")
    p.add_argument("--max-concurrent", type=int, default=DEFAULT_MAX_CONCURRENT, metavar="N", help=f"generations running at once (default {DEFAULT_MAX_CONCURRENT}; block peers admit 8 sessions per head by default)")
    p.add_argument("--queue", type=int, default=DEFAULT_QUEUE, metavar="N", help=f"requests that may wait for a slot; more are refused with 429 (default {DEFAULT_QUEUE})")
    p.add_argument("--max-per-client", type=int, default=DEFAULT_MAX_PER_CLIENT, metavar="N", help="requests (running + waiting) one client may hold, a client being its API key when FILE holds several, else its address (default 0: no fixed cap, so a lone user may fill the server; when it is full, a client over its fair share still gives its newest waiting place to a newcomer, and freed slots go to the client running fewest)")
    p.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_MB, metavar="MB", help=f"largest request body in MiB, answered 413 before it is read when its length says so (default {DEFAULT_MAX_BODY_MB:g}: a 131072-token context is 3 MiB with every character escaped as \\uXXXX at 4 a token, 1 MiB as token ids)")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S", help=f"a request body must arrive within S seconds plus one per 64 KiB, else 408 (default {DEFAULT_BODY_TIMEOUT_S:g})")
    p.add_argument("--api-key", type=Path, default=None, metavar="FILE", help="require 'Authorization: Bearer KEY' on /v1 with a KEY in FILE, one a line (# comments; default: no key); with several keys each is a client of its own for --max-per-client; the swarm page at / (with its JSON /api/swarm) and /metrics stay public: they show no prompts, texts or keys")
    p.add_argument("--max-context", type=int, default=None, metavar="TOKENS", help="prompt + completion limit (default: the model's positions, at most the peers' default --max-len 4096)")
    p.add_argument("--max-tokens-default", type=int, default=DEFAULT_MAX_TOKENS, metavar="N", help=f"completion tokens of a request without max_tokens (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--refresh", type=float, default=DEFAULT_REFRESH_S, metavar="S", help=f"survey the swarm every S seconds (default {DEFAULT_REFRESH_S:g}; also when a route fails)")
    p.add_argument("--identity", type=Path, default=None, help="the head's key file (default: a new identity each start)")
    p.add_argument("--ready-file", type=Path, default=None, help="write {url, model, peer_id, pid} as JSON here once listening")
    p.add_argument("--threads", type=int, default=None, help="torch threads on the head (default torch's, or one per --cpus CPU)")
    add_cpus_option(p)
    add_device_options(p)
    add_wan_options(p)
    add_fetch_options(p, model_help=None)
    add_deadline_options(p)
    add_audit_options(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from dsd.node.head.config import GenerationConfig
    from dsd.node.service.guards import HttpLimits
    from dsd.node.service.model import HeadOptions
    from dsd.node.service.serve import ServeConfig, read_api_keys, serve_until_signal
    from dsd.shard_store import StoreError
    from dsd.shard_store.devices import resolve_placement

    if args.federated:
        return fail("serve verifies over a route of block peers; federated workers (whole models) are not served "
                    "by it yet: use `dsd-node generate --federated`")
    try:
        place = resolve_placement(args.device, args.dtype)  # one line and no loading when the device is not there
    except StoreError as exc:
        return fail(str(exc))
    pin_head_process(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_concurrent < 1 or args.queue < 0 or args.max_per_client < 0 or not 0 <= args.port <= 65535:
        return fail("need --max-concurrent >= 1, --queue >= 0, --max-per-client >= 0 and a --port in 0..65535")
    if not args.max_body_mb > 0 or not args.body_timeout > 0:
        return fail("--max-body-mb and --body-timeout must be > 0")
    if args.max_tokens_default < 1 or (args.max_context is not None and args.max_context < 2):
        return fail("--max-tokens-default must be >= 1 and --max-context >= 2")
    try:  # what every request's generation would refuse, refused once at the start
        GenerationConfig(mode=args.mode, gamma_max=args.gamma_max, **overlap_options(args))
        audit = audit_options(args)
    except ValueError as exc:
        return fail(str(exc))
    try:
        api_keys = read_api_keys(args.api_key) if args.api_key else ()
    except (OSError, ValueError) as exc:
        return fail(f"--api-key: {exc}")
    if args.model:  # fetch the head's files (and --blocks' layers) before anything loads
        args.store = fetched_store(args, args.blocks)
    head = HeadOptions(
        store=args.store, draft=args.draft, blocks=args.blocks, placement=place, draft_quant=args.draft_quant,
        mode=args.mode, overlap=overlap_options(args),
        tree_nodes=args.tree_nodes, gamma_max=args.gamma_max, tau_max=args.tau_max,
        deadline=deadline_rule(args),
        max_context=args.max_context, default_max_tokens=args.max_tokens_default, audit=audit,
        head_batching=args.head_batching == "on",
    )
    cfg = ServeConfig(
        bootstrap=args.bootstrap, head=head, host=args.host, port=args.port, max_concurrent=args.max_concurrent,
        queue=args.queue, max_per_client=args.max_per_client, api_keys=api_keys, link=link_profile(args),
        identity=args.identity, listen=listen_addrs(args), refresh_s=args.refresh, ready_file=args.ready_file,
        limits=HttpLimits(max_body_bytes=int(args.max_body_mb * 2**20), body_timeout_s=args.body_timeout),
    )
    try:
        serve_until_signal(cfg)
    except (ValueError, StoreError, OSError) as exc:
        return fail(str(exc))
    return 0
