#!/bin/sh
# Regenerate the shell completion scripts in completions/ from the app.
# tests/test_cli_completion.py fails when they are out of date.
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
exec "$PY" -m txmq.cli.commands.completion completions
