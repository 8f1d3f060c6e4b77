"""Shared fixtures: real gradients from ../shared/data when present."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

GRADS = Path(os.environ.get("ZIPCCL_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")) \
    / "grads_step050_bucket0_fp32.npy"


@pytest.fixture(scope="session")
def real_grads() -> torch.Tensor:
    """The fp32 gradient bucket of a small GPT (3.3M elements), or skip with the reason."""
    if not GRADS.exists():
        pytest.skip(f"real gradients not found at {GRADS} (set ZIPCCL_DATA)")
    return torch.from_numpy(np.load(GRADS))
