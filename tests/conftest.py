"""Markers: `gpu` and `multi_gpu(n)` skip at collection, with a reason, where the hardware is absent.

A multi-GPU test run outside torchrun (no RANK/WORLD_SIZE in the environment) skips instead of
hanging on a rendezvous that never completes.
"""

from __future__ import annotations

import os

import pytest

from mhc_ar.transport import disable_multicast_env

# Every process this suite starts keeps NVLink multicast off (see mhc_ar.transport).
disable_multicast_env()


def _cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover - torch without CUDA runtime
        return 0


def pytest_collection_modifyitems(config, items):
    devices = _cuda_devices()
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    for item in items:
        if item.get_closest_marker("gpu") and devices == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is visible"))
        marker = item.get_closest_marker("multi_gpu")
        if marker is not None:
            need = marker.args[0] if marker.args else 2
            if devices < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPUs; {devices} visible"))
            elif not under_torchrun:
                item.add_marker(pytest.mark.skip(reason="multi-GPU test: launch it with torchrun"))
