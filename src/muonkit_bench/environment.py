"""The environment a benchmark ran in, recorded beside every result."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any


def environment() -> dict[str, Any]:
    """Versions, device, threads, load and date: what a reader needs to weigh a number."""
    import torch

    from muonkit.functional.orthogonalize import default_compute_dtype

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "default_ns_dtype": str(default_compute_dtype("cuda" if torch.cuda.is_available() else "cpu")),
    }
    for name in ("transformers", "deepspeed"):
        info[name] = _version(name)
    return info


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
