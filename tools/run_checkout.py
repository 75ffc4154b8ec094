"""Run the `specdecode` command line of another checkout (a git worktree of an earlier commit) instead of the
editable install, which every script otherwise imports whatever its working directory: for a whole benchmark
before and after a change on the same machine, one right after the other.

    git worktree add /tmp/before 1809d30
    python tools/run_checkout.py /tmp/before bench serving --drafter default --repeats 2 --out /tmp/b --name before
"""

import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 2 or not (Path(sys.argv[1]) / "specdecode" / "cli.py").is_file():
        raise SystemExit("usage: run_checkout.py CHECKOUT [specdecode arguments...] (CHECKOUT holds specdecode/cli.py)")
    checkout = str(Path(sys.argv[1]).resolve())
    sys.meta_path[:] = [finder for finder in sys.meta_path if "editable" not in type(finder).__name__.lower()]
    sys.path.insert(0, checkout)
    import specdecode
    from specdecode.cli import main as cli

    if not specdecode.__file__.startswith(checkout):
        raise SystemExit(f"imported {specdecode.__file__}, not the checkout's package")
    sys.argv = ["specdecode", *sys.argv[2:]]
    cli()


if __name__ == "__main__":
    main()
