"""The machine a measurement was made on, and where machine-specific measurements are cached.

Kernel choices, step-cost tables and round costs are measured where the code runs, never assumed: each is
cached under `$XDG_CACHE_HOME/specdecode/<kind>/`, keyed by what it measured plus this machine's identity.
"""

import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from specdecode.paths import cache_dir


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def measurement_file(kind: str, key: dict) -> Path:
    """The cache file of the measurement `key` (a JSON-able dict that includes the machine) of this `kind`."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir(kind) / f"{key.get('target', 'target')}-{digest}.json"
