"""What a run ran on: GPU, driver, package versions, host. Recorded in reports and bundles."""

from __future__ import annotations

import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path

import torch

_PACKAGES = {"torch": "torch", "cutlass_dsl": "nvidia-cutlass-dsl", "flashinfer": "flashinfer-python", "mhc_ar": "mhc-ar", "numpy": "numpy"}


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        if distribution == "mhc-ar":  # used from the source tree (PYTHONPATH), not installed
            import mhc_ar

            return f"{mhc_ar.__version__} (source tree)"
        return None


def _driver_version() -> str | None:
    try:
        import pynvml  # from nvidia-ml-py, a FlashInfer dependency

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML (no GPU, no driver): the version is simply unknown
        return None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    commit = out.stdout.strip()
    # A working tree that differs from HEAD (e.g. a synced copy on a GPU machine) says so.
    try:
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return commit
    return commit + "+modified" if status.returncode == 0 and status.stdout.strip() else commit


def collect_environment(device: torch.device | str | None = None) -> dict:
    """GPU name / capability / driver (None without a GPU), package versions, python, host."""
    device = torch.device(device) if device is not None else None
    gpu = None
    if device is not None and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        gpu = {
            "name": torch.cuda.get_device_name(device),
            "capability": f"{major}.{minor}",
            "driver": _driver_version(),
            "cuda_runtime": torch.version.cuda,
            "count": torch.cuda.device_count(),
        }
    return {
        "gpu": gpu,
        "versions": {name: _version(dist) for name, dist in _PACKAGES.items()} | {"python": platform.python_version()},
        "torch_build": torch.__version__,
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "git_commit": _git_commit(),
    }
