"""Express dsd's Qwen2 target as a Llama checkpoint that Petals 2.2 serves, and check its logits against ours.

Petals 2.2 serves the `llama` family only (of the ones dsd uses). Qwen2 is a Llama with biases on q, k and v, so it
is a transformers 4.34 `LlamaConfig(attention_bias=True)` (bias on q, k, v and o) with a zero o_proj bias, the
same rope_theta, rms_norm_eps and tied/untied embeddings, and the same tokenizer files. Subcommands:

    # in dsd's .venv: convert a store, an HF folder, or `tiny-qwen2` (the tests' tiny random Qwen2)
    .venv/bin/python bench/petals/llama_checkpoint.py convert ~/.cache/dsd/models/stores/Qwen2.5-Coder-1.5B-Instruct-float32
    # in dsd's .venv: convert (if needed), then compare our Qwen2's logits with the Llama's computed by the Petals
    # venv's transformers 4.34 (it runs this file's `logits` subcommand there); prints one JSON line
    .venv/bin/python bench/petals/llama_checkpoint.py check tiny-qwen2
    .venv/bin/python bench/petals/llama_checkpoint.py check ~/.cache/dsd/models/stores/Qwen2.5-Coder-1.5B-Instruct-float32

The output folder defaults to ~/.cache/dsd/petals/<model id>-llama (outside git).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from delay_proxy import provenance
from setup import default_venv
from smoke import PROMPT as SMOKE_PROMPT

REPO = Path(__file__).resolve().parents[2]
MARKER = "dsd-conversion.json"
SHARD_BYTES = 2 * 2**30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "chat_template.jinja", "tokenizer.model")
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\nx = np.linspace(0, 1, 11)\nprint(x.mean(), x.std())\n",
]
GREEDY_TOKENS = 8


def petals_home() -> Path:
    """Where converted checkpoints go: $DSD_PETALS_HOME or ~/.cache/dsd/petals."""
    env = os.environ.get("DSD_PETALS_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dsd" / "petals"


# --- dsd's side (.venv, transformers 5) -------------------------------------------------------------------------

def resolve_source(source: str, rebuild: bool = False) -> tuple[Path, str]:
    """A store or HF folder path and its model id; `tiny-qwen2` is built from tests/support/models.py (once, or
    again when `rebuild`)."""
    if source == "tiny-qwen2":
        root = petals_home() / "tiny-qwen2"
        if rebuild or not (root / "hf" / "config.json").exists():
            sys.path.insert(0, str(REPO / "tests"))
            from support.models import save_tiny_model

            save_tiny_model("qwen2", root / "hf")
        return root / "hf", "tiny-qwen2"
    path = Path(source).expanduser().absolute()
    if (path / "manifest.json").exists():
        return path, json.loads((path / "manifest.json").read_text())["model_id"]
    if (path / "config.json").exists():
        return path, path.name
    raise SystemExit(f"{source}: neither a dsd store (manifest.json) nor an HF folder (config.json)")


def tokenizer_json_ids(tok_dir: Path) -> list[list[int]] | None:
    """PROMPTS through the bare tokenizer.json (the `tokenizers` library, no transformers class around it)."""
    if not (tok_dir / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    return [tok.encode(p).ids for p in PROMPTS]


def load_qwen2(path: Path) -> tuple[Any, Any, Path]:
    """Our Qwen2 model (float32, eval) from a store or an HF folder, its tokenizer (or None), its tokenizer folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (path / "manifest.json").exists():
        from dsd.shard_store import Store

        store = Store(path)
        return store.load_full(dtype=torch.float32), store.load_tokenizer(), path / "tokenizer"
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path)) if (path / "tokenizer_config.json").exists() else None
    return model, tokenizer, path


def llama_config(config: Any) -> dict[str, Any]:
    """transformers 4.34's LlamaConfig fields for a Qwen2 config; raises on what a Llama cannot express."""
    if config.model_type != "qwen2":
        raise ValueError(f"expected a qwen2 model, got {config.model_type}")
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if rope.get("rope_type", rope.get("type", "default")) != "default" or theta is None:
        raise ValueError(f"rope {rope} has no transformers 4.34 Llama equivalent (plain rope with a rope_theta)")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("sliding-window attention has no Llama equivalent")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size or config.hidden_act != "silu":
        raise ValueError("transformers 4.34 Llama needs head_dim = hidden / heads and silu")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings, "initializer_range": config.initializer_range,
        "rms_norm_eps": config.rms_norm_eps, "use_cache": True, "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id, "pretraining_tp": 1,
        "tie_word_embeddings": bool(config.tie_word_embeddings), "rope_theta": float(theta), "rope_scaling": None,
        "attention_bias": True, "torch_dtype": "float32", "transformers_version": "4.34.1",
    }


def llama_state(model: Any) -> dict[str, Any]:
    """The Qwen2 weights under Llama's names (the same), plus a zero o_proj bias per layer; lm_head only if untied."""
    import torch

    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    layer_keys = {"self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                  "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                  "input_layernorm.weight", "post_attention_layernorm.weight"}
    layers = model.config.num_hidden_layers
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | (
        set() if model.config.tie_word_embeddings else {"lm_head.weight"})
    expected |= {f"model.layers.{i}.{k}" for i in range(layers) for k in layer_keys}
    if set(state) != expected:
        raise ValueError(f"Qwen2 weights do not map onto Llama's: unexpected {sorted(set(state) - expected)[:5]}, "
                         f"missing {sorted(expected - set(state))[:5]}")
    for i in range(layers):
        o_proj = state[f"model.layers.{i}.self_attn.o_proj.weight"]
        state[f"model.layers.{i}.self_attn.o_proj.bias"] = torch.zeros(o_proj.shape[0], dtype=o_proj.dtype)
    return {k: v.detach().contiguous() for k, v in state.items()}


def write_shards(out: Path, state: dict[str, Any]) -> None:
    """Safetensors shards of at most SHARD_BYTES with a model.safetensors.index.json (what 4.34 and Petals read)."""
    from safetensors.torch import save_file

    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    weight_map: dict[str, str] = {}
    for n, keys in enumerate(shards, start=1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: state[k] for k in keys}, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def copy_tokenizer(src: Path, out: Path) -> list[str]:
    """The tokenizer files, made readable by 4.34 and its tokenizers 0.14 without changing the tokenizer.

    tokenizer.json: BPE merges as "a b" strings (0.14 cannot read the [a, b] pairs newer tokenizers write);
    tokenizer_config.json: the fast class (4.34 has no Qwen2Tokenizer; tokenizer.json defines the tokenizer) and
    the chat template inlined (4.34 reads no chat_template.jinja). The `check` compares the ids both produce."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, out / name)
            copied.append(name)
    tok_path = out / "tokenizer.json"
    if tok_path.exists():
        tok = json.loads(tok_path.read_text())
        model = tok.get("model", {})
        merges = model.get("merges") or []
        if merges and isinstance(merges[0], list):
            if any(" " in part for pair in merges for part in pair):
                raise ValueError("a BPE merge contains a space: no legacy \"a b\" form for tokenizers 0.14")
            model["merges"] = [" ".join(pair) for pair in merges]
        if model.get("ignore_merges") is False:  # the only behaviour 0.14 has
            del model["ignore_merges"]
        tok_path.write_text(json.dumps(tok, ensure_ascii=False))
    cfg_path = out / "tokenizer_config.json"
    if cfg_path.exists() and tok_path.exists():
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        if (out / "chat_template.jinja").exists() and "chat_template" not in cfg:
            cfg["chat_template"] = (out / "chat_template.jinja").read_text()
        cfg_path.write_text(json.dumps(cfg, indent=1))
    return copied


def convert(source: str, out: Path | None, force: bool = False) -> tuple[Path, Any, Any, Path]:
    """The Llama folder of `source` (written unless a finished one is there), our Qwen2 model, its tokenizer (or
    None) and its tokenizer folder."""
    path, model_id = resolve_source(source, rebuild=force)
    out = (out or petals_home() / f"{model_id}-llama").expanduser().absolute()
    model, tokenizer, tok_dir = load_qwen2(path)
    marker = out / MARKER
    if not force and marker.exists() and json.loads(marker.read_text()).get("model_id") == model_id:
        return out, model, tokenizer, tok_dir
    config = llama_config(model.config)
    state = llama_state(model)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    write_shards(tmp, state)
    copied = copy_tokenizer(tok_dir, tmp)
    (tmp / MARKER).write_text(json.dumps({"model_id": model_id, "source_kind": "store" if (
        path / "manifest.json").exists() else "hf", "tokenizer_files": copied, "o_proj_bias": "zeros"}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out, model, tokenizer, tok_dir


def prompt_ids(tokenizer: Any) -> list[list[int]]:
    """PROMPTS as token ids of our tokenizer, or as bytes (mod the vocab) for a model without one."""
    if tokenizer is None:
        return [list(p.encode())[:48] for p in PROMPTS]
    return [tokenizer(p, add_special_tokens=True)["input_ids"] for p in PROMPTS]


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Convert, then compare our logits (transformers 5) with the Llama's (transformers 4.34 in the Petals venv)."""
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    out, model, tokenizer, tok_dir = convert(args.source, args.out, args.force)
    t1 = time.monotonic()
    ids = prompt_ids(tokenizer)
    vocab = model.config.vocab_size
    ids = [[i % vocab for i in p] for p in ids]
    with torch.no_grad():
        ours = [model(torch.tensor([p])).logits[0] for p in ids]
        greedy = model.generate(torch.tensor([SMOKE_PROMPT]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(SMOKE_PROMPT):].tolist()
    del model
    with tempfile.TemporaryDirectory(prefix="dsd-llama-check-") as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps({"ids": ids, "texts": PROMPTS if tokenizer is not None else []}))
        python = args.petals_python or default_venv() / "bin" / "python"
        run = subprocess.run([str(python), __file__, "logits", str(out), str(request), str(Path(tmp) / "theirs"),
                              "--threads", str(args.threads)], capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"the Petals venv's `logits` step failed: {run.stderr[-3000:]}")
        theirs_meta = json.loads((Path(tmp) / "theirs.json").read_text())
        theirs = load_file(str(Path(tmp) / "theirs.safetensors"))
    diffs, scale, argmax_same, positions = [], 0.0, 0, 0
    for n, a in enumerate(ours):
        b = theirs[f"logits_{n}"]
        diffs.append(float((a - b).abs().max()))
        scale = max(scale, float(a.abs().max()))
        argmax_same += int((a.argmax(-1) == b.argmax(-1)).sum())
        positions += a.shape[0]
    return {
        "source": Path(args.source).name, "llama_dir": f"<{out.name}>", "convert_s": round(t1 - t0, 1),
        "prompt_tokens": [len(p) for p in ids], "max_abs_diff": max(diffs),
        "max_abs_diff_per_prompt": diffs, "max_abs_logit": scale, "argmax_equal": f"{argmax_same}/{positions}",
        "tokenizer_ids_equal": {  # the 4.34 tokenizer's ids vs ours (transformers 5) and vs the bare tokenizer.json
            "ours": theirs_meta["ids_from_texts"] == ids if tokenizer is not None else None,
            "tokenizer_json": theirs_meta["ids_from_texts"] == tokenizer_json_ids(tok_dir) if tokenizer else None},
        "greedy_qwen2": greedy, "greedy_llama": theirs_meta["greedy"], "greedy_equal": greedy == theirs_meta["greedy"],
        "versions": {"ours": _versions(), "petals_venv": theirs_meta["versions"]},
    }


def _versions() -> dict[str, str]:
    """torch and transformers versions of the running interpreter."""
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


# --- the Petals venv's side (transformers 4.34) -------------------------------------------------------------------

def logits_main(model_dir: Path, request: Path, out: Path, threads: int) -> None:
    """Llama logits of the requested ids, the 4.34 tokenizer's ids of the texts, and greedy tokens, into out.*."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(threads)
    req = json.loads(request.read_text())
    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32, low_cpu_mem_usage=True).eval()
    ids_from_texts = []
    if req["texts"]:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        ids_from_texts = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in req["texts"]]
    with torch.no_grad():
        logits = {f"logits_{n}": model(torch.tensor([p])).logits[0].contiguous() for n, p in enumerate(req["ids"])}
        greedy = model.generate(torch.tensor([SMOKE_PROMPT]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(SMOKE_PROMPT):].tolist()
    save_file(logits, str(out.with_suffix(".safetensors")))
    out.with_suffix(".json").write_text(json.dumps({"ids_from_texts": ids_from_texts, "greedy": greedy,
                                                    "versions": _versions()}))


def main(argv: list[str] | None = None) -> int:
    """convert / check (dsd's .venv) or logits (the Petals venv)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("convert", "check"):
        c = sub.add_parser(name)
        c.add_argument("source", help="a dsd store, an HF Qwen2 folder, or tiny-qwen2")
        c.add_argument("--out", type=Path, default=None, help="Llama folder (default ~/.cache/dsd/petals/ID-llama)")
        c.add_argument("--force", action="store_true", help="convert again even if the folder is there")
        c.add_argument("--threads", type=int, default=2)
        c.add_argument("--petals-python", type=Path, default=None, help="the Petals venv's python (check only)")
    lg = sub.add_parser("logits")
    lg.add_argument("model_dir", type=Path)
    lg.add_argument("request", type=Path)
    lg.add_argument("out", type=Path)
    lg.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.cmd == "logits":
        logits_main(args.model_dir, args.request, args.out, args.threads)
    elif args.cmd == "convert":
        out = convert(args.source, args.out, args.force)[0]
        print(json.dumps({"llama_dir": str(out)}))
    else:
        load_before = os.getloadavg()
        result = check(args)
        shown = [a if not Path(a).is_absolute() else f"<{Path(a).name}>" for a in (argv or sys.argv[1:])]
        print(json.dumps({**provenance("python bench/petals/llama_checkpoint.py", shown), "load_before": load_before,
                          "load_after": os.getloadavg(), **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
