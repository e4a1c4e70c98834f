"""`dsd-node generate`: run the head — draft locally, verify over the swarm, stream the text."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .cmd_daemon import add_wan_options, link_profile
from .settings import MODES

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text over the swarm (the head role)")
    p.add_argument("--bootstrap", action="append", required=True, metavar="MULTIADDR", help="a peer of the swarm (repeatable)")
    p.add_argument("--store", type=Path, required=True, metavar="TARGET_STORE", help="the target's store: the head loads its embeddings, final norm and lm_head")
    p.add_argument("--draft", default=None, metavar="DRAFT_STORE|ngram", help="draft model store, or ngram for model-free prompt lookup (default; with --federated the default is the --store model)")
    p.add_argument("--mode", choices=MODES, default="dsd", help="ar: one token per trip; sd: draft, send, wait; dsd: draft the next window during the trip (default); dsd-adaptive: dsd + adaptive verification")
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
    p.add_argument("--tau-max", type=float, default=0.3, help="dsd-adaptive: largest relaxation (0 = lossless)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on the head")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    add_wan_options(p)
    from .cmd_workers import add_generate_options

    add_generate_options(p)
    p.set_defaults(func=cmd_generate)


def load_head_setup(target_store: Path, draft: str, params, seed: int):
    """Load the target's ends, its tokenizer and the drafter; refuse a draft with another vocabulary."""
    import torch

    from dsd.shard_store import Store

    from .drafters import ModelDrafter, NgramDrafter
    from .generate import HeadSetup

    store = Store(target_store)
    head = store.load_head()
    tokenizer = store.load_tokenizer()
    drafter = None
    if draft == "ngram":
        drafter = NgramDrafter()
    elif draft:
        dstore = Store(Path(draft))
        md = ModelDrafter(dstore.load_full(), params, torch.Generator().manual_seed(seed + 1))
        md.check_compatible(head.vocab_size, tokenizer, dstore.load_tokenizer())
        drafter = md
    setup = HeadSetup(head=head, model_id=store.manifest.model_id, num_layers=int(store.manifest.num_layers), drafter=drafter)
    return setup, tokenizer


def encode_prompt(args: argparse.Namespace, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise SystemExit("dsd-node: --prompt-ids must be comma-separated integers") from None
    if tokenizer is None:
        raise SystemExit("dsd-node: this store has no tokenizer; use --prompt-ids")
    if args.chat:
        msgs = [{"role": "user", "content": args.prompt}]
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    return list(tokenizer(args.prompt)["input_ids"])


def eos_ids(tokenizer, store_config: dict) -> frozenset[int]:
    ids = store_config.get("eos_token_id")
    out = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        out.add(int(tokenizer.eos_token_id))
    return frozenset(int(i) for i in out)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch
    import trio

    from dsd.discovery.planner import NoRouteError
    from dsd.shard_store import Store, StoreError

    from .client import RouteError
    from .generate import GenerationFailed, generate_once
    from .head import GenerationConfig
    from .headnode import head_node
    from .sampling import SamplingParams
    from .verify import stream_safe_length

    if args.federated:
        from .cmd_workers import cmd_generate_federated

        return cmd_generate_federated(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        setup, tokenizer = load_head_setup(args.store, args.draft or "ngram", params, args.seed)
        cfg = GenerationConfig(
            mode=args.mode, max_new_tokens=args.max_new_tokens, params=params, gamma=args.gamma,
            gamma_max=args.gamma_max, tau_max=args.tau_max if args.mode == "dsd-adaptive" else 0.0, seed=args.seed,
            eos_ids=eos_ids(tokenizer, Store(args.store).manifest.config), stop_strings=tuple(args.stop),
        )
    except (ValueError, StoreError, OSError) as exc:
        print(f"dsd-node: {exc}", file=sys.stderr)
        return 2
    prompt = encode_prompt(args, tokenizer)
    streamed: list[int] = []
    printed = 0  # characters of the decoded text already written

    def on_tokens(toks: list[int]) -> None:
        """Stream accepted text; hold back a tail that is an incomplete character or may become a stop string."""
        nonlocal printed
        streamed.extend(toks)
        if args.json or tokenizer is None:
            return
        text = tokenizer.decode(streamed, skip_special_tokens=True)
        safe = min(len(text.rstrip("\ufffd")), stream_safe_length(text, cfg.stop_strings))
        if safe > printed:
            sys.stdout.write(text[printed:safe])
            sys.stdout.flush()
            printed = safe

    async def main() -> dict:
        async with head_node(args.bootstrap, link_profile(args), seed=args.seed) as (node, legs):
            return await generate_once(node, legs, setup, prompt, cfg, on_tokens=on_tokens, tokenizer=tokenizer)

    def text_of(tokens: list[int]) -> str | None:
        return tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None

    try:
        report = trio.run(main)
    except GenerationFailed as exc:
        print(f"\ndsd-node: generation failed after {len(exc.tokens)} tokens: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps({**exc.report, "tokens": exc.tokens, "text": text_of(exc.tokens), "error": str(exc)}))
        return 1
    except (NoRouteError, RouteError) as exc:
        print(f"dsd-node: generation failed: {exc}", file=sys.stderr)
        return 1
    report["text"] = text_of(report["tokens"])
    if args.json:
        print(json.dumps(report))
    else:
        sys.stdout.write((report["text"] or "")[printed:] + "\n")
        print(
            f"[{report['mode']}] {report['new_tokens']} tokens in {report['elapsed_s']:.2f} s "
            f"({report['tokens_per_s']:.2f} tok/s), {report['rounds']} rounds, "
            f"mean accepted {report['mean_accepted']:.2f}", file=sys.stderr,
        )
    return 0
