"""Where specdecode keeps its caches (`$XDG_CACHE_HOME/specdecode`, else `~/.cache/specdecode`), and how it writes
files that a kill must not tear: whole files replaced atomically, logs appended a synced record at a time."""

import json
import os
import tempfile
from pathlib import Path
from typing import TextIO

from specdecode.errors import SpecDecodeError


def cache_dir(*parts: str) -> Path:
    """Return (and create) a folder under the user cache directory; one clear error where it cannot be made."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdecode"
    path = root.joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = f"{error.strerror or error}; set XDG_CACHE_HOME to a writable folder"
        raise SpecDecodeError(f"cannot create the cache folder {path} ({reason})") from None
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


def read_jsonl(path: str | Path) -> list[dict]:
    """Every complete record of one JSONL file; a torn last line (a crash mid-write) is ignored."""
    return _complete_records(Path(path).read_text(encoding="utf-8"))


def _complete_records(text: str) -> list[dict]:
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def resume_jsonl(path: Path) -> list[dict]:
    """The complete records of a log that this run goes on appending to. A torn last line goes from the file too:
    the next record landed on it, and both were lost (redone at every resume)."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    records = _complete_records(text)
    if text and not text.endswith("\n"):
        write_text_atomically(path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
    return records


def append_synced(file: TextIO, record: dict) -> None:
    """Append one record as a JSONL line and make it durable at once: a kill loses no finished work."""
    file.write(json.dumps(record, ensure_ascii=False) + "\n")
    file.flush()
    os.fsync(file.fileno())


def check_writable_folder(folder: str | Path) -> None:
    """One clear error where `folder` cannot be made or written, before the work that would write there runs: a
    benchmark's minutes were lost to a traceback at its last step. Folders made to find out are removed again."""
    missing, probe = [], Path(folder).absolute()
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    made = []
    try:
        for path in reversed(missing):
            path.mkdir()
            made.append(path)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        raise SpecDecodeError(f"cannot write to {folder} ({error.strerror or error})") from None
    finally:
        for path in reversed(made):
            path.rmdir()
