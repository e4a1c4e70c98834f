"""The codec comparison's arithmetic: bytes per new token on the head's links, the speedup over the exact codec
paired by prompt and repetition, and outputs equal to the exact codec's, from the sweep's raw runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from wire_codecs import compare, markdown, parse_args, wire_of  # noqa: E402


def run(task: str, rep: int, mode: str, tps: float, sent: int, received: int, tokens: list[int]) -> dict[str, Any]:
    return {"task_id": task, "rep": rep, "mode": mode, "tokens_per_s": tps, "new_tokens": 10, "bytes_sent": sent,
            "bytes_received": received, "tokens": tokens}


def setting(key: str, codec: str, zstd: bool, runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"key": key, "options": {"codec": codec, "zstd": zstd}, "runs": runs,
            "summary": {"modes": {"ar": {"median_tokens_per_s": [1.0, 0.9, 1.1], "median_tokens_per_s_mc": [0.0, 0.0]}}}}


def test_bytes_speedups_and_equal_outputs_are_per_codec_against_the_exact_one() -> None:
    exact = setting("real-N4-home", "auto", False, [run("A", 1, "ar", 1.0, 60_000, 62_000, [1, 2]),
                                                    run("B", 1, "ar", 2.0, 80_000, 82_000, [3, 4])])
    int8 = setting("real-N4-home-int8+zstd", "int8", True, [run("A", 1, "ar", 1.5, 15_000, 16_000, [1, 2]),
                                                           run("B", 1, "ar", 2.5, 20_000, 21_000, [3, 5])])
    got = compare([exact, int8])
    assert list(got) == ["auto", "int8+zstd"]
    e, i = got["auto"]["modes"]["ar"], got["int8+zstd"]["modes"]["ar"]
    assert e["sent_bytes_per_token"] == 7_000 and e["received_bytes_per_token"] == 7_200
    assert i["sent_bytes_per_token"] == 1_750 and i["received_bytes_per_token"] == pytest.approx(1_850)
    assert e["vs_exact"] is None and e["identical_to_exact"] == "2/2"
    assert i["vs_exact"]["median"] == pytest.approx((1.5 + 1.25) / 2) and i["vs_exact"]["pairs"] == 2
    assert i["identical_to_exact"] == "1/2"  # B's int8 output differs from the exact codec's
    table = markdown(got, "home")
    assert "| int8+zstd | ar | 2 |" in table and "| 1/2 |" in table


def test_the_exact_codec_comes_first_and_the_profile_must_limit_bandwidth(capsys: pytest.CaptureFixture[str]) -> None:
    assert wire_of("int8+zstd") == ("int8", True) and wire_of("bf16") == ("bf16", False)
    opts, codecs = parse_args(["--pin-head"])
    assert codecs == ["auto", "bf16", "int8+zstd"] and opts.link_profile == "home" and opts.pin_head
    for argv, message in ((["--codecs", "bf16,auto"], "comes first"), (["--link-profile", "paper"], "bandwidth limit"),
                          (["--codecs", "auto,int3"], "unknown codec")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
