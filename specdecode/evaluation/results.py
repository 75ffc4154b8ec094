"""One convention for every results file: docs/results/<name>.json and .md, with the command that made them."""

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from specdecode.machine import machine_info


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def command_line() -> str:
    return "specdecode " + " ".join(sys.argv[1:]) if Path(sys.argv[0]).name == "specdecode" else " ".join(sys.argv)


NOTES_HEADING = "## Notes"


def kept_notes(path: Path) -> str:
    """The hand-written `## Notes` section (to the end) of an earlier `<name>.md`: a rerun keeps what people
    wrote about the numbers, for them to update, instead of silently dropping it."""
    if not path.exists():
        return ""
    lines = path.read_text().splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.rstrip() == NOTES_HEADING]
    return "\n" + "".join(lines[starts[0] :]) if starts else ""


def write_results(name: str, out_dir: str, target: str, runs: list[dict], table_md: str, **extra) -> Path:
    """Write `<name>.json` in the shared shape and `<name>.md` (the table plus the command, and the notes of
    the file it replaces)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "name": name,
        "command": command_line(),
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": git_commit(),
        "machine": machine_info(),
        "target": target,
        **extra,
        "runs": runs,
    }
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    markdown = out / f"{name}.md"
    markdown.write_text(
        f"# {name}\n\nCommand: `{doc['command']}`  \nCreated {doc['created']} at commit {doc['git_commit']} on "
        f"{doc['machine']['cpu']} ({doc['machine']['cores']} cores, torch {doc['machine']['torch']}).\n\n"
        f"{table_md}\n{kept_notes(markdown)}"
    )
    return out / f"{name}.json"
