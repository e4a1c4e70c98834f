"""Store integrity and layout: tampered files are named and refused, spans read only their own
files, conversion works with and without a tokenizer, bad input gives clear StoreErrors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.models import make_tiny_model, save_tiny_model, tiny_tokenizer

from dsd.shard_store import Manifest, Store, StoreError, convert, write_store


@pytest.fixture
def store_copy(tiny_llama_store: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama store that a test may damage."""
    dst = tmp_path / "store"
    shutil.copytree(tiny_llama_store, dst)
    return dst


def _flip_byte(path: Path, offset: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_layout_and_manifest(tiny_qwen2_store: Path) -> None:
    m = Manifest.read(tiny_qwen2_store)
    assert (m.family, m.num_layers, m.hidden_size, m.vocab_size, m.dtype) == ("qwen2", 5, 64, 300, "float32")
    assert m.model_id == "tiny-qwen2"
    assert m.config["model_type"] == "qwen2" and m.config["num_hidden_layers"] == 5
    assert m.config["rope_parameters"]["rope_theta"] == 12345.0
    expected = {"embed.safetensors", "head.safetensors"} | {f"layers/layer_{i:03d}.safetensors" for i in range(5)}
    assert expected <= set(m.files)
    on_disk = {p.relative_to(tiny_qwen2_store).as_posix() for p in tiny_qwen2_store.rglob("*") if p.is_file()}
    assert on_disk == set(m.files) | {"manifest.json"}  # no stray staging or tmp files
    for relpath, entry in m.files.items():
        assert (tiny_qwen2_store / relpath).stat().st_size == entry["size"]
    assert m.tokenizer_files and all(f.startswith("tokenizer/") for f in m.tokenizer_files)


def test_verify_clean_store(store_copy: Path) -> None:
    assert Store(store_copy).verify() == []
    Store(store_copy, verify=True)


def test_tampered_file_is_named_and_refused(store_copy: Path) -> None:
    victim = store_copy / "layers" / "layer_002.safetensors"
    _flip_byte(victim)  # same size, different hash
    assert Store(store_copy).verify() == ["layers/layer_002.safetensors"]
    with pytest.raises(StoreError, match="layers/layer_002.safetensors"):
        Store(store_copy, verify=True)
    Store(store_copy).load_span(3, 5)  # other layers are still usable without verify


def test_wrong_size_refused_on_load_without_verify(store_copy: Path) -> None:
    with open(store_copy / "layers" / "layer_001.safetensors", "ab") as fh:
        fh.write(b"\0")
    store = Store(store_copy)
    with pytest.raises(StoreError, match=r"layers/layer_001.safetensors has size \d+, manifest says \d+"):
        store.load_span(0, 2)
    store.load_span(2, 5)


def test_span_reads_only_its_own_files(store_copy: Path) -> None:
    for i in (0, 1, 4):
        (store_copy / "layers" / f"layer_{i:03d}.safetensors").unlink()
    (store_copy / "embed.safetensors").unlink()
    (store_copy / "head.safetensors").unlink()
    store = Store(store_copy)
    span = store.load_span(2, 4)  # layers 2 and 3 are all it needs
    cache = span.new_cache()
    assert span(torch.randn(1, 3, 64), 0, cache).shape == (1, 3, 64)
    with pytest.raises(StoreError, match="missing file layers/layer_001.safetensors"):
        store.load_span(1, 3)
    with pytest.raises(StoreError, match="missing file embed.safetensors"):
        store.load_head()
    assert sorted(store.verify()) == sorted(
        ["embed.safetensors", "head.safetensors"] + [f"layers/layer_{i:03d}.safetensors" for i in (0, 1, 4)]
    )


def test_head_reads_no_layer_files(store_copy: Path) -> None:
    shutil.rmtree(store_copy / "layers")
    head = Store(store_copy).load_head()
    assert head.logits(head.embed(torch.tensor([[5, 6]]))).shape == (1, 2, 300)


def test_file_with_wrong_tensors_is_refused(store_copy: Path, tiny_llama_store: Path) -> None:
    """A layer file swapped for another file (and the manifest updated to match) still fails to load."""
    src = tiny_llama_store / "head.safetensors"
    dst = store_copy / "layers" / "layer_000.safetensors"
    shutil.copy(src, dst)
    data = json.loads((store_copy / "manifest.json").read_text())
    data["files"]["layers/layer_000.safetensors"] = data["files"]["head.safetensors"]
    (store_copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(StoreError, match="layer_000.safetensors has wrong tensors"):
        Store(store_copy, verify=True).load_span(0, 1)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("files"), "missing field 'files'"),
        (lambda d: d.update(format_version=99), "format_version 99"),
        (lambda d: d.update(dtype="int8"), "dtype 'int8'"),
        (lambda d: d.update(num_layers=4), "num_layers does not match"),
        (lambda d: d["files"].update({"../evil": {"sha256": "0" * 64, "size": 1}}), "unsafe file path '../evil'"),
        (lambda d: d["files"].pop("layers/layer_003.safetensors"), "layers/layer_003.safetensors is not listed"),
        (lambda d: d.update(family="gpt2"), "unsupported model family 'gpt2'"),
    ],
)
def test_bad_manifest_is_a_clear_error(store_copy: Path, edit, message: str) -> None:
    path = store_copy / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(StoreError, match=message.replace("(", r"\(").replace("[", r"\[")):
        Store(store_copy)


def test_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        Store(tmp_path / "nope")
    with pytest.raises(StoreError, match="no manifest.json"):
        Store(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError, match="cannot parse"):
        Store(tmp_path)


def test_convert_without_tokenizer(tmp_path: Path) -> None:
    hf = save_tiny_model("llama", tmp_path / "hf", with_tokenizer=False, layers=2)
    manifest = convert(hf, tmp_path / "store")
    assert manifest.tokenizer_files == []
    assert manifest.model_id == "hf"
    store = Store(tmp_path / "store", verify=True)
    assert store.load_tokenizer() is None
    assert store.summary()["tokenizer"] is False


def test_tokenizer_round_trip(tiny_qwen2_root: Path) -> None:
    """The stored tokenizer encodes exactly as transformers loads it from the source folder."""
    from transformers import AutoTokenizer

    tok = Store(tiny_qwen2_root / "store").load_tokenizer()
    want = AutoTokenizer.from_pretrained(str(tiny_qwen2_root / "hf"))
    assert type(tok) is type(want)
    text = "def add(a, b):\n    return a + b\n"
    ids = tok(text).input_ids
    assert ids == want(text).input_ids and len(ids) > 5
    assert tok.decode(ids) == text
    assert max(len(tiny_tokenizer()), max(ids) + 1) <= Store(tiny_qwen2_root / "store").manifest.vocab_size


def test_convert_refuses_to_clobber(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(StoreError, match="not a store"):
        convert(tiny_llama_dir, out)
    assert (out / "precious.txt").read_text() == "keep me"
    store = tmp_path / "store"
    convert(tiny_llama_dir, store)
    with pytest.raises(StoreError, match="already holds a store"):
        convert(tiny_llama_dir, store)
    convert(tiny_llama_dir, store, overwrite=True, model_id="again")
    assert Store(store, verify=True).manifest.model_id == "again"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left


def test_convert_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        convert(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(StoreError, match="not a .gguf"):
        convert(tmp_path / "weights.bin", tmp_path / "out")
    with pytest.raises(StoreError, match="no config.json"):
        convert(tmp_path, tmp_path / "out")
    with pytest.raises(StoreError, match="unsupported dtype 'int4'"):
        convert(tmp_path, tmp_path / "out", dtype="int4")


def test_unsupported_family_is_named(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=32))
    with pytest.raises(StoreError, match="unsupported model family 'gpt2'"):
        write_store(model, tmp_path / "out", model_id="gpt2-tiny")
    assert not (tmp_path / "out").exists()


def test_float16_store_holds_float16(tmp_path: Path) -> None:
    model = make_tiny_model("qwen2", layers=1)
    manifest = write_store(model, tmp_path / "fp16", model_id="m", dtype="float16")
    store = Store(tmp_path / "fp16", verify=True)
    assert manifest.config["dtype"] == "float16"
    span = store.load_span(0, 1)
    assert all(p.dtype == torch.float16 for p in span.parameters())
    out = span(torch.randn(1, 4, 64), 0, span.new_cache())
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
