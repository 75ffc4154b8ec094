"""Where specdecode keeps its caches: `$XDG_CACHE_HOME/specdecode`, else `~/.cache/specdecode`."""

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """Return (and create) a folder under the user cache directory."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdecode"
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's (its entries') data to disk: renames are only durable after this."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomically(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a torn one, even after a crash (a temporary file per process:
    two processes caching the same measurement do not write into one)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)
