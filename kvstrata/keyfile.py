"""A secret kept in a one-line file (an API key): read at start, never at import, never empty."""

from __future__ import annotations

from pathlib import Path


def read_key_file(path: str, option: str) -> str:
    """The file's one line, stripped; `option` names the flag in errors (FileNotFoundError names
    the file). On a shared host a file beats a flag: a command line is visible to every user."""
    key = Path(path).read_text().strip()
    if not key:
        raise ValueError(f"{option} {path}: the file is empty")
    return key
