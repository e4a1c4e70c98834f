"""`dsd-node generate`: run the head — draft locally, verify over the swarm (or federated workers), stream the text."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dsd.node.head.modes import MODE_HELP, MODES

from .options import (
    add_audit_options,
    add_codec_options,
    add_cpus_option,
    add_deadline_options,
    add_device_options,
    add_head_options,
    add_overlap_options,
    add_wan_options,
    add_weights_option,
    audit_options,
    deadline_rule,
    fail,
    link_profile,
    listen_addrs,
    overlap_options,
    pin_head_process,
    wire_format,
)
from .store import add_fetch_options, fetched_store


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text over the swarm (the head role)")
    add_head_options(p, store_help="the target's store: the head loads its embeddings, final norm and lm_head")
    p.add_argument("--draft", default=None, metavar="DRAFT_STORE|ngram|DRAFT_STORE+ngram", help="draft model store; ngram for model-free prompt lookup (default; with --federated the default is the --store model); or DRAFT_STORE+ngram (also ngram+DRAFT_STORE): prompt lookup when the context's tail repeats earlier text, the draft model otherwise")
    p.add_argument("--draft-quant", choices=("none", "int8"), default="none", help="quantize the draft model's linear layers after loading: int8 = torch dynamic int8, faster on CPU (a q4k draft store, what `models prepare` makes, is dequantized first: 1.9x faster steps than drafting on its packed kernels as held, which none does; bench/draft_formats.py); the target still decides every token (default none)")
    p.add_argument("--mode", choices=MODES, default="dsd", help=MODE_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a store with a tokenizer)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gamma", type=int, default=None, help="fixed draft window size (default: adaptive)")
    p.add_argument("--gamma-max", type=int, default=16)
    p.add_argument("--tau-max", type=float, default=0.3, help="dsd-adaptive only: largest relaxation (default 0.3, LOSSY; 0 = lossless)")
    add_overlap_options(p)
    p.add_argument("--tree-nodes", type=_tree_nodes, default=None, metavar="N|auto", help="drafted nodes of a token-tree window (at most 63; default auto: the window controller picks a tree or a chain from measured round times and acceptance; 0 = always chains); trees need a draft model (block peers and federated workers both run them)")
    p.add_argument("--blocks", default=None, metavar="A:B", help="layers the head serves itself, the model's first (0:B) or last (A:L) ones, from its --store (which must hold those layer files): the route covers the others, one peer and one link crossing fewer (not with --federated)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on the head (default torch's, or one per --cpus CPU)")
    add_cpus_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    add_device_options(p)
    add_weights_option(p, "the --blocks layers' (and the route's peers')")
    p.add_argument("--mix-weights", action="store_true", help="let the route mix peers of different --weights formats (default: one format per route, the --weights given or the cheapest route's)")
    add_codec_options(p, "the head's")
    add_wan_options(p)
    add_fetch_options(p, model_help=None)
    add_deadline_options(p)
    add_audit_options(p)
    g = p.add_argument_group("federated mode (SpecFed): --store is the draft; workers hold whole models")
    g.add_argument("--federated", action="store_true", help="verify against federated workers' top-K distributions")
    g.add_argument("--workers", default="auto", metavar="auto|PEER_ID,...", help="workers to use (default auto: every live worker of the vocabulary, sorted by peer id)")
    g.add_argument("--worker-weights", default=None, metavar="W1,W2,...", help="aggregation weights in the order of --workers (default equal)")
    g.add_argument("--topk", default="64", metavar="K|all", help="K asked of every worker, capped by each worker's own cap (default 64: bias under 2ε̄ in bench/federated.py at 1/2600 of the full distribution's bytes; all = the whole distribution)")
    g.add_argument("--reconstruct", choices=("renormalize", "residual"), default="residual", help="how a top-K is rebuilt into a distribution (default residual)")
    g.add_argument("--worker-timeout", type=float, default=60.0, metavar="S", help="window deadline: a worker later than S seconds is left out of that window")
    p.set_defaults(func=cmd_generate)


def parse_weights(text: str | None) -> list[float] | None:
    """`1,2.5,...` -> floats; None stays None (equal weights)."""
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"dsd-node: --worker-weights must be comma-separated numbers, got {text!r}") from None


def _tree_nodes(text: str) -> int | None:
    """`--tree-nodes`: `auto` (None: the controller decides) or a node budget >= 0 (0 = chains)."""
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a node count or auto, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = chains), got {n}")
    return n


def _topk(text: str) -> int | None:
    """`--topk`: a positive K, or `all` (None: the whole distribution)."""
    if text == "all":
        return None
    try:
        k = int(text)
    except ValueError:
        raise SystemExit(f"dsd-node: --topk takes a positive K or all, got {text!r}") from None
    if k < 1:
        raise SystemExit(f"dsd-node: --topk must be >= 1, got {k}")
    return k


def _federated_target(args: argparse.Namespace) -> Any:
    from dsd.node.peer.generation import FederatedTarget

    peer_ids = None if args.workers == "auto" else [p.strip() for p in args.workers.split(",") if p.strip()]
    return FederatedTarget(peer_ids=peer_ids, top_k=_topk(args.topk), weights=parse_weights(args.worker_weights),
                           method=args.reconstruct, window_timeout_s=args.worker_timeout)


def _summary(report: Any) -> str:
    """One line on how the generation went (a `GenerationReport`)."""
    from dsd.node.federated.record import FederatedRecord

    r, t = report.result, report.transport
    if isinstance(t, FederatedRecord):
        return (f"[federated {r.mode}] {r.new_tokens} tokens in {r.elapsed_s:.2f} s, "
                f"{t.active_workers}/{len(t.workers)} workers, acceptance {r.acceptance_rate:.2f}, "
                f"uplink {t.bytes_received / max(1, r.new_tokens):.0f} B/token, missed {t.missed}")
    return (f"[{r.mode}] {r.new_tokens} tokens in {r.elapsed_s:.2f} s ({r.tokens_per_s:.2f} tok/s), "
            f"{r.rounds} rounds, mean accepted {r.mean_accepted:.2f}")


def cmd_generate(args: argparse.Namespace) -> int:
    import torch
    import trio

    from dsd.node.head.config import GenerationConfig
    from dsd.node.head.report import GenerationFailed
    from dsd.node.head.sampling import SamplingParams
    from dsd.node.head.setup import encode_prompt, eos_ids, load_head_setup
    from dsd.node.head.streaming import TextStreamer
    from dsd.node.peer.generation import RouteTarget, generate_from_fresh_head, load_head_span
    from dsd.shard_store import Store, StoreError
    from dsd.shard_store.devices import resolve_placement

    pin_head_process(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.federated and args.mode == "ar":
        return fail("--federated drafts by design; use --mode sd or dsd")
    if args.blocks and args.federated:
        return fail("--blocks serves layers for a route of block peers; federated workers hold whole models")
    if args.federated and (args.audit_rate is not None or args.audit_tolerance is not None):
        return fail("--audit-rate and --audit-tolerance audit routes of block peers; federated workers are not audited")
    try:
        audit = None if args.federated else audit_options(args)
    except ValueError as exc:
        return fail(str(exc))
    try:
        place = resolve_placement(args.device, args.dtype, args.weights)  # a device not there: one line, before any load
    except StoreError as exc:
        return fail(str(exc))
    if args.model:  # fetch the head's files (and --blocks' layers; the whole model when it is the federated draft)
        args.store = fetched_store(args, "all" if args.federated and not args.draft else args.blocks)
    draft = args.draft or (str(args.store) if args.federated else "ngram")
    if args.tree_nodes and args.mode != "ar" and "ngram" in draft.split("+"):
        return fail("--tree-nodes N needs a draft model store without ngram; use auto or 0")
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        setup, tokenizer = load_head_setup(args.store, draft, params, args.seed, load_head=not args.federated,
                                           quant=args.draft_quant, device=place.device, dtype=place.dtype,
                                           weights=place.weights)
        cfg = GenerationConfig(
            mode=args.mode, max_new_tokens=args.max_new_tokens, params=params, gamma=args.gamma,
            gamma_max=args.gamma_max, tau_max=args.tau_max if args.mode == "dsd-adaptive" else 0.0, seed=args.seed,
            eos_ids=eos_ids(tokenizer, Store(args.store).manifest), stop_strings=tuple(args.stop),
            **overlap_options(args),
            deadline=deadline_rule(args),
            tree_nodes=args.tree_nodes,
        )
        prompt = encode_prompt(tokenizer, text=args.prompt, ids=args.prompt_ids, chat=args.chat)
        local_span = load_head_span(Store(args.store), args.blocks, place) if args.blocks else None
    except (ValueError, StoreError, OSError) as exc:
        return fail(str(exc))
    streamer = TextStreamer(tokenizer, cfg.stop_strings) if tokenizer is not None and not args.json else None

    def on_tokens(toks: list[int]) -> None:
        if streamer is not None:
            sys.stdout.write(streamer.push(toks))
            sys.stdout.flush()

    def text_of(tokens: list[int]) -> str | None:
        return tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None

    route_weights = "any" if args.mix_weights else None if args.weights == "auto" else args.weights
    target = _federated_target(args) if args.federated else RouteTarget(local=local_span, wire=wire_format(args),
                                                                       weights=route_weights)
    try:
        report = trio.run(lambda: generate_from_fresh_head(
            args.bootstrap, link_profile(args), setup, prompt, cfg, seed=args.seed, tokenizer=tokenizer,
            on_tokens=on_tokens, target=target, listen=listen_addrs(args), audit=audit,
        ))
    except GenerationFailed as exc:
        failure = exc.failure
        blamed = f"; blamed {', '.join(failure.blamed)}" if failure.blamed else ""
        print(f"\ndsd-node: generation failed after {len(exc.tokens)} tokens ({failure.verdict}): {exc}{blamed}",
              file=sys.stderr)
        if args.json:
            print(json.dumps({**exc.as_dict(), "text": text_of(exc.tokens)}))
        return 1
    except ConnectionError as exc:  # no bootstrap peer reachable
        return fail(str(exc), 1)
    text = text_of(report.tokens)
    audits = getattr(report.transport, "audits", None)
    if streamer is not None and audits is not None and audits.shown_wrong_from is not None:
        print(f"\ndsd-node: an audit caught a peer lying after the text above was shown; it was wrong from token "
              f"{audits.shown_wrong_from} on. The corrected text:", file=sys.stderr)
        streamer = None
    if args.json:
        print(json.dumps({**report.as_dict(), "text": text, "device": str(place.device), "dtype": place.dtype_name}))
    else:
        sys.stdout.write((streamer.finish(report.tokens) if streamer else (text or "")) + "\n")
        print(_summary(report), file=sys.stderr)
    return 0
