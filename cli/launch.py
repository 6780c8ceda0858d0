"""The console script's entry point: ``txmq --version`` answers before the CLI is loaded.

Loading the app (Typer, rich and every command module) takes about 0.25 s of
CPU; the version needs none of it, and it is what scripts, installers and the
single executable's warm-start check ask most often. Everything else goes to
``txmq.cli.main.main``.
"""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] == ["__frontend-worker"]:  # a broker's front-end worker process (broker/workers/worker.py), no CLI
        from txmq.broker.workers.worker import main as worker

        worker(sys.argv[2:])
        return
    if sys.argv[1:] == ["--version"]:
        from txmq import __version__

        sys.stdout.write(f"txmq {__version__}\n")
        return
    from .main import main as run

    run()


if __name__ == "__main__":
    main()
