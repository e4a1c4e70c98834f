"""Marks for tests on the real default model pair: run where it is prepared (`dsd-node models prepare`: q4k; the
tests written against float32 numbers need `dsd-node models prepare --weights fp32`), never in CI (the pair is
1.6 GB and its tests take minutes)."""

from __future__ import annotations

import os

import pytest

from dsd.shard_store.default_models import prepared

realmodels = pytest.mark.realmodels
needs_pair = pytest.mark.skipif(
    bool(os.environ.get("CI")) or not prepared(),
    reason="default model pair not prepared (dsd-node models prepare), or running in CI",
)
needs_fp32_pair = pytest.mark.skipif(
    bool(os.environ.get("CI")) or not prepared(weights="fp32"),
    reason="default model pair not prepared in float32 (dsd-node models prepare --weights fp32), or running in CI",
)
