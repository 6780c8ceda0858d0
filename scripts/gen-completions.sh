#!/bin/sh
# Regenerate the shell completion scripts in completions/ from the app
# (`txmq completion SHELL` for each shell).
# tests/test_cli_completion.py fails when they are out of date.
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
mkdir -p completions
for pair in bash:txmq.bash zsh:_txmq fish:txmq.fish; do
    shell="${pair%%:*}"
    file="completions/${pair#*:}"
    "$PY" -m txmq completion "$shell" > "$file.tmp"
    mv "$file.tmp" "$file"
    echo "$file"
done
