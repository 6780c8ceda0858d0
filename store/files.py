"""Small file helpers: atomic replace, fsync of directories, 20-digit file names."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from .errors import StoreError

NAME_DIGITS = 20


def offset_name(offset: int) -> str:
    """The 20-digit file name of a segment or consume-queue file starting at offset."""
    return f"{offset:020d}"


def list_numbered(directory: str | os.PathLike) -> list[int]:
    """Sorted starts of the 20-digit-named files in directory (other names are ignored)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    # ASCII digits only (int() takes other scripts' digits too), and files only (a directory of that name is not one)
    return sorted(int(n) for n in names if len(n) == NAME_DIGITS and n.isascii() and n.isdigit()
                  and os.path.isfile(os.path.join(directory, n)))


def fsync_dir(directory: str | os.PathLike) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace path with data: write a temp file, fsync it, rename it over path, fsync the directory."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Replace path with obj as JSON, atomically and durably (see atomic_write_bytes)."""
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode() + b"\n")


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """The JSON in path, or default when the file does not exist.

    A file that exists but is not valid JSON raises StoreError: atomic writes
    never leave one behind, so it was damaged from outside and silently
    falling back to the default could lose state (consumer offsets).
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return default
    try:
        return json.loads(data)
    except ValueError as exc:
        raise StoreError(f"corrupt JSON in {path}: {exc}") from exc


def move_aside(path: str | os.PathLike) -> Path:
    """Rename a damaged file to ``<name>.corrupt-<UTC time>`` beside it, kept for a person to look at; the new path."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while dest.exists():
        dest = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    os.replace(path, dest)
    fsync_dir(path.parent)
    return dest
