"""Where specdecode keeps its caches: `$XDG_CACHE_HOME/specdecode`, else `~/.cache/specdecode`."""

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """Return (and create) a folder under the user cache directory."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdecode"
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
