"""The frozen executable's entry point (scripts/binary/build.py): the `txmq` CLI."""

from txmq.cli.main import main

if __name__ == "__main__":
    main()
