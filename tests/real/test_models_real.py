"""The default model pair's preparing: chunk assembly with sha256 checks and `models prepare` writing q4k stores by
default and float ones on request beside them, on fake packages holding a tiny Q4_K GGUF (runs in CI; the real
prepared pair's own tests are in test_pair_real.py)."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.gguf_files import write_q4k_gguf

from dsd.shard_store import Store, StoreError
from dsd.shard_store.default_models import (
    DEFAULT_PAIR,
    DEFAULT_WEIGHTS,
    DRAFT,
    PIP_HINT,
    TARGET,
    DefaultModel,
    assemble,
    assembled_ok,
    default_cache,
    default_store_paths,
    gguf_path,
    marker_path,
    part_files,
    prepare_model,
    prepared,
    prepared_kinds,
    require_prepared,
    store_complete,
    store_kind,
    store_path,
)
from dsd.shard_store.manifest import layer_file

REPO = Path(__file__).resolve().parents[2]

# ---- fake chunk packages (real importlib.metadata lookups over dist-info folders we write) -------


def _fake_packages(site: Path, prefix: str, chunks: list[bytes], version: str = "1.0") -> None:
    """Write installed-looking distributions `{prefix}{i}` each holding data/partNN.bin."""
    for i, chunk in enumerate(chunks, start=1):
        name = f"{prefix}{i}"
        module = name.replace("-", "_")
        data = site / module / "data" / f"part{i:02d}.bin"
        data.parent.mkdir(parents=True)
        data.write_bytes(chunk)
        info = site / f"{module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "RECORD").write_text(
            f"{module}/__init__.py,,\n{module}/data/part{i:02d}.bin,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n"
        )


@pytest.fixture
def fake_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DefaultModel:
    """A 3-chunk model whose packages are installed on a temporary sys.path entry."""
    chunks = [bytes(range(256)) * 40, b"GGUF-middle" * 1000, b"tail" * 7]
    joined = b"".join(chunks)
    site = tmp_path / "site"
    prefix = f"dsdfake-{tmp_path.name.lower().replace('_', '-')}-part"
    _fake_packages(site, prefix, chunks)
    monkeypatch.syspath_prepend(str(site))
    return DefaultModel(
        role="target",
        model_id="Fake-Model",
        package_prefix=prefix,
        version="1.0",
        num_parts=len(chunks),
        gguf_name="fake-model.gguf",
        sha256=hashlib.sha256(joined).hexdigest(),
        size=len(joined),
    )


def test_assemble_joins_parts_in_order_and_records_marker(fake_model: DefaultModel, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    parts = part_files(fake_model)
    assert [p.name for p in parts] == ["part01.bin", "part02.bin", "part03.bin"]
    seen: list[tuple[int, int]] = []
    out = assemble(fake_model, cache, progress=lambda what, done, total: seen.append((done, total)))
    assert out == gguf_path(fake_model, cache)
    data = out.read_bytes()
    assert data == b"".join(p.read_bytes() for p in parts)
    assert hashlib.sha256(data).hexdigest() == fake_model.sha256
    assert seen[-1] == (fake_model.size, fake_model.size)
    marker = json.loads(marker_path(fake_model, cache).read_text())
    assert marker["sha256"] == fake_model.sha256 and marker["size"] == fake_model.size
    assert assembled_ok(fake_model, cache)
    out.write_bytes(data[:-1])  # a truncated file is no longer vouched for, even with the marker
    assert not assembled_ok(fake_model, cache)


def test_assemble_rejects_wrong_hash_and_leaves_nothing(fake_model: DefaultModel, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    part = part_files(fake_model)[1]
    raw = bytearray(part.read_bytes())
    raw[5] ^= 0xFF  # same size, different content
    part.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match=r"sha256 .* expected " + fake_model.sha256) as info:
        assemble(fake_model, cache)
    assert PIP_HINT in str(info.value)
    assert not gguf_path(fake_model, cache).exists()
    assert not marker_path(fake_model, cache).exists()
    assert list(gguf_path(fake_model, cache).parent.iterdir()) == []  # no partial file left behind


def test_assemble_rejects_wrong_total_size(fake_model: DefaultModel, tmp_path: Path) -> None:
    part = part_files(fake_model)[2]
    part.write_bytes(part.read_bytes() + b"x")
    with pytest.raises(StoreError, match=rf"add up to {fake_model.size + 1} bytes, expected {fake_model.size}"):
        assemble(fake_model, tmp_path / "cache")


def test_missing_package_error_names_it_and_the_pip_command(fake_model: DefaultModel) -> None:
    missing = DefaultModel(**{**fake_model.__dict__, "num_parts": 4})
    with pytest.raises(StoreError) as info:
        part_files(missing)
    message = str(info.value)
    assert f"{fake_model.package_prefix}4==1.0" in message
    assert "part 4 of 4" in message
    assert "pip install -e '.[models]'" in message


def test_wrong_package_version_is_refused(fake_model: DefaultModel) -> None:
    other = DefaultModel(**{**fake_model.__dict__, "version": "2.0"})
    with pytest.raises(StoreError, match=r"version 1\.0, expected 2\.0"):
        part_files(other)


def test_prepare_skips_a_complete_store_without_touching_packages(
    tmp_path: Path, tiny_qwen2_store: Path
) -> None:
    ghost = DefaultModel(
        role="target",
        model_id="Ghost",
        package_prefix="dsd-no-such-package-part",
        version="1.0",
        num_parts=2,
        gguf_name="ghost.gguf",
        sha256="0" * 64,
        size=1,
    )
    cache = tmp_path / "cache"
    store = store_path(ghost, cache, "fp32")
    shutil.copytree(tiny_qwen2_store, store)
    step = prepare_model(ghost, cache, weights="fp32")
    assert not step.did_work and step.store == store
    # an incomplete store is not "prepared": the next run would rebuild it, and here it needs packages
    layer = next((store / "layers").iterdir())
    layer.write_bytes(layer.read_bytes()[:-1])
    assert not store_complete(store)
    with pytest.raises(StoreError, match="dsd-no-such-package-part1==1.0"):
        prepare_model(ghost, cache, weights="fp32")


def _ghost(role: str) -> DefaultModel:
    """A default-model entry whose chunk packages do not exist."""
    return DefaultModel(
        role=role,
        model_id=f"Ghost-{role}",
        package_prefix=f"dsd-no-such-{role}-part",
        version="1.0",
        num_parts=2,
        gguf_name=f"ghost-{role}.gguf",
        sha256="0" * 64,
        size=1,
    )


def _run_cli(argv: list[str]) -> int:
    from dsd.node.cli import models as cmd_models

    parser = argparse.ArgumentParser(prog="dsd-node")
    cmd_models.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_prepare_names_missing_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dsd.shard_store import default_models

    pair = (_ghost("target"), _ghost("draft"))
    monkeypatch.setattr(default_models, "DEFAULT_PAIR", pair)
    assert _run_cli(["models", "prepare", "--cache", str(tmp_path)]) == 1
    out = " ".join(capsys.readouterr().out.split())  # undo rich's line wrapping
    assert "models prepare failed" in out
    assert "dsd-no-such-target-part1==1.0" in out
    assert "pip install -e '.[models]'" in out


def test_cli_prepare_with_complete_stores_does_nothing_and_prints_summary(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tiny_qwen2_store: Path,
    tiny_qwen2_draft_store: Path,
) -> None:
    from dsd.shard_store import default_models

    pair = (_ghost("target"), _ghost("draft"))
    monkeypatch.setattr(default_models, "DEFAULT_PAIR", pair)
    shutil.copytree(tiny_qwen2_store, store_path(pair[0], tmp_path, "fp32"))
    shutil.copytree(tiny_qwen2_draft_store, store_path(pair[1], tmp_path, "fp32"))
    assert _run_cli(["models", "prepare", "--cache", str(tmp_path), "--weights", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "already prepared as float32" in out and "nothing to do" in out
    assert f"target store: {store_path(pair[0], tmp_path, 'fp32')}" in out
    assert f"draft store: {store_path(pair[1], tmp_path, 'fp32')}" in out
    rows = [line for line in out.splitlines() if "tiny-qwen2" in line]
    assert len(rows) == 2 and all("float32" in r and " 64 " in r for r in rows)
    assert any(" 5 " in r for r in rows) and any(" 2 " in r for r in rows)  # layers of target, draft


def _gguf_model(site: Path, role: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> DefaultModel:
    """A default-model entry whose two chunk packages join into a tiny Qwen2 GGUF with Q4_K (and Q4_0, Q8_0) blocks,
    as the real pair's Q4_K_M files hold them."""
    gguf = write_q4k_gguf(site.parent / f"tiny-{role}.gguf", layers=2, seed=seed)
    data = gguf.read_bytes()
    prefix = f"dsdgguf-{role}-{site.parent.name.lower().replace('_', '-')}-part"
    _fake_packages(site, prefix, [data[: len(data) // 2], data[len(data) // 2 :]])
    monkeypatch.syspath_prepend(str(site))
    return DefaultModel(role=role, model_id=f"Tiny-{role}", package_prefix=prefix, version="1.0", num_parts=2,
                        gguf_name=gguf.name, sha256=hashlib.sha256(data).hexdigest(), size=len(data))


def test_prepare_keeps_the_ggufs_own_blocks_and_writes_fp32_beside_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default format is q4k: the store holds the file's 4-bit blocks; `weights="fp32"` writes a float32 store
    of its own next to it (the GGUF assembled again: it was removed), and neither touches the other."""
    from dsd.shard_store import default_models

    model = _gguf_model(tmp_path / "site", "target", 3, monkeypatch)
    monkeypatch.setattr(default_models, "DEFAULT_PAIR", (model,))
    cache = tmp_path / "cache"
    step = prepare_model(model, cache)
    assert step.assembled and step.converted and step.gguf_removed
    assert step.store == store_path(model, cache) and step.store.name == "Tiny-target-q4k"
    q4k = Store(step.store, verify=True)
    assert q4k.manifest.weights == "q4k" and q4k.manifest.dtype == "bfloat16"
    tensors = load_file(str(step.store / layer_file(0)))
    assert tensors["self_attn.q_proj.q4"].dtype == torch.uint8 and "mlp.up_proj.q4" in tensors
    assert tensors["self_attn.v_proj.qweight"].dtype == torch.int8  # Q8_0: int8 per channel
    written = (step.store / "manifest.json").stat().st_mtime_ns
    assert prepared_kinds(cache, roles=("target",)) == ["q4k"]

    fp32 = prepare_model(model, cache, weights="fp32")
    assert fp32.assembled and fp32.converted and fp32.store == store_path(model, cache, "float32")
    assert fp32.store.name == "Tiny-target-float32"
    floats = Store(fp32.store, verify=True)
    assert not floats.manifest.weights and floats.manifest.dtype == "float32"
    assert store_complete(step.store) and (step.store / "manifest.json").stat().st_mtime_ns == written
    assert prepared_kinds(cache, roles=("target",)) == ["float32", "q4k"]
    assert not prepare_model(model, cache).did_work  # both are there: nothing to do
    with pytest.raises(StoreError, match=r"not prepared as int4 .*\(prepared here already: float32, q4k\): run "
                                         r"`dsd-node models prepare --weights int4`"):
        require_prepared(cache, "int4", roles=("target",))
    assert require_prepared(cache, "fp32", roles=("target",))["target"] == fp32.store


def test_cli_prepare_writes_q4k_by_default_and_fp32_on_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dsd.shard_store import default_models

    pair = (_gguf_model(tmp_path / "site-t", "target", 3, monkeypatch),
            _gguf_model(tmp_path / "site-d", "draft", 4, monkeypatch))
    monkeypatch.setattr(default_models, "DEFAULT_PAIR", pair)
    cache = tmp_path / "cache"
    assert _run_cli(["models", "prepare", "--cache", str(cache)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 2 and all(" q4k " in r and "bfloat16" in r for r in rows), out
    assert f"target store: {store_path(pair[0], cache, 'q4k')}" in out and "also prepared" not in out
    assert prepared(cache) and not prepared(cache, "fp32")

    assert _run_cli(["models", "prepare", "--cache", str(cache), "--weights", "fp32"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"draft store: {store_path(pair[1], cache, 'fp32')}" in out
    assert "also prepared here, kept as they are: q4k" in out
    assert prepared(cache) and prepared(cache, "fp32")
    assert _run_cli(["models", "prepare", "--cache", str(cache), "--dtype", "float32"]) == 0  # --dtype: a float store
    assert "already prepared as float32" in capsys.readouterr().out
    assert _run_cli(["models", "prepare", "--cache", str(cache), "--dtype", "bfloat16", "--weights", "q4k"]) == 2
    assert "--dtype bfloat16 writes bf16 stores, not --weights q4k" in capsys.readouterr().err


def test_prepare_formats_match_the_library() -> None:
    """`models prepare --weights` offers what `default_models` prepares (spelled out so `--help` loads no torch)."""
    from dsd.node.cli.models import PREPARE_FORMATS as OFFERED
    from dsd.shard_store.default_models import PREPARE_FORMATS

    assert OFFERED == PREPARE_FORMATS


def test_cli_turns_tqdm_into_bar_detail_and_passes_other_stderr() -> None:
    """transformers' GGUF tqdm bar updates our bar instead of flooding stderr; other text passes through."""
    import contextlib
    import io

    from rich.console import Console
    from rich.progress import Progress, TextColumn
    from tqdm import tqdm

    from dsd.node.cli.models import _Bars, _TqdmToBar

    passthrough = io.StringIO()
    progress = Progress(TextColumn("{task.fields[detail]}"), console=Console(file=io.StringIO()))
    bars = _Bars(progress)
    bars.start("convert", TARGET)
    sink = _TqdmToBar(bars, passthrough)
    with contextlib.redirect_stderr(sink):
        for _ in tqdm(range(7), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        print("a real warning", file=sys.stderr)
    assert progress.tasks[0].fields["detail"] == "Converting and de-quantizing GGUF tensors: 7/7"
    assert passthrough.getvalue() == "a real warning\n"


def test_cache_and_store_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSD_CACHE", str(tmp_path / "env"))
    assert default_cache() == tmp_path / "env"
    assert default_cache(tmp_path / "arg") == tmp_path / "arg"
    paths = default_store_paths(tmp_path / "arg")
    assert set(paths) == {"target", "draft"}
    assert paths["target"].parent == paths["draft"].parent == tmp_path / "arg" / "stores"
    assert paths["target"] != paths["draft"]
    assert default_store_paths(tmp_path, "bfloat16")["target"] != default_store_paths(tmp_path)["target"]
    assert default_store_paths(tmp_path, "bf16") == default_store_paths(tmp_path, "bfloat16")
    # q4k by default; a float format keeps the name float stores always had, so stores prepared before are found
    assert DEFAULT_WEIGHTS == "q4k" and paths["target"].name == "Qwen2.5-Coder-1.5B-Instruct-q4k"
    assert default_store_paths(tmp_path / "arg", "fp32")["draft"].name == "Qwen2.5-Coder-0.5B-Instruct-float32"
    assert store_kind("fp32") == store_kind("float32") == "float32" and store_kind("int4") == "int4"
    with pytest.raises(StoreError, match="choose one of q4k, int8, int4, fp32, bf16, fp16"):
        store_kind("q8")
    assert not prepared(tmp_path / "arg")
    monkeypatch.delenv("DSD_CACHE")
    assert default_cache() == Path.home() / ".cache" / "dsd" / "models"


def test_pins_match_the_models_extra() -> None:
    """The chunk packages we read are exactly the ones the `models` extra installs, at the same versions."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["models"]
    pins = dict(re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", req).groups() for req in extra)
    for model in DEFAULT_PAIR:
        for name in model.packages:
            assert pins.get(name) == model.version, name
    assert TARGET.size == 1_117_320_768 and DRAFT.size == 491_400_064
    assert re.fullmatch(r"[0-9a-f]{64}", TARGET.sha256) and re.fullmatch(r"[0-9a-f]{64}", DRAFT.sha256)
