"""The frozen executable's entry point (scripts/binary/build.py): the `txmq` CLI."""

from txmq.cli.launch import main

if __name__ == "__main__":
    main()
