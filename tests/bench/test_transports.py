"""bench/transports.py end to end, small: both transports really carry the echoes (QUIC over a QUIC connection, TCP
over yamux), and the summary pairs them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from transports import main  # noqa: E402

pytestmark = pytest.mark.network


def test_both_transports_echo_every_size_over_their_own_connections(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert main(["--connections", "2", "--round-trips", "3", "--sizes", "64,6144", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert sorted((r["rep"], r["transport"]) for r in runs) == [(0, "quic"), (0, "tcp"), (1, "quic"), (1, "tcp")]
    for r in runs:
        assert r["connection"] == (["QUICConnection"] if r["transport"] == "quic" else ["Yamux"]), r
        assert set(r["rtt_s"]) == {"64", "6144"} and all(v > 0 for v in r["rtt_s"].values())
    ratio = result["summary"]["quic_over_tcp"]
    assert ratio["rtt_6144"]["n"] == 2 and ratio["rtt_6144"]["median"] > 0
    with pytest.raises(SystemExit):
        main(["--connections", "0"])
