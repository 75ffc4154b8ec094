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


def write_results(name: str, out_dir: str, target: str, runs: list[dict], table_md: str, **extra) -> Path:
    """Write `<name>.json` in the shared shape and `<name>.md` (the table plus the command)."""
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
    (out / f"{name}.md").write_text(
        f"# {name}\n\nCommand: `{doc['command']}`  \nCreated {doc['created']} at commit {doc['git_commit']} on "
        f"{doc['machine']['cpu']} ({doc['machine']['cores']} cores, torch {doc['machine']['torch']}).\n\n"
        f"{table_md}\n"
    )
    return out / f"{name}.json"
