"""The committed audit calibration (`python bench/integrity.py calibrate`): the tolerance per precision pair."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CALIBRATION = Path(__file__).resolve().parents[2] / "bench" / "results" / "audit-calibration-2026-12-06.json"


def calibration() -> dict[str, Any]:
    return json.loads(CALIBRATION.read_text())


def calibrated(model: str) -> dict[str, float]:
    """The tolerance per precision pair the calibration gives `model` ("real" or "tiny")."""
    return {pair: row["tolerance"] for pair, row in calibration()["models"][model]["pairs"].items()}
