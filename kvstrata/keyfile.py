"""A secret kept in a one-line file (an API key): read at start, never at import, never empty,
never with whitespace around it."""

from __future__ import annotations

import stat
import sys
from pathlib import Path


def read_key_file(path: str, option: str) -> str:
    """The file's one line (its line end dropped); `option` names the flag in errors
    (FileNotFoundError names the file). On a shared host a file beats a flag: a command line is
    visible to every user. A file that group or others may read is used, with one warning line
    on stderr (the operator may share it on purpose, e.g. with a service group)."""
    p = Path(path)
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(
            f"kvstrata: warning: {option} {path}: group/others may access it (mode {mode:o}); "
            "chmod 600",
            file=sys.stderr,
            flush=True,
        )
    text = p.read_text()
    line = text.removesuffix("\n").removesuffix("\r")
    if "\n" in line:
        raise ValueError(f"{option} {path}: the file holds more than one line")
    return check_key_text(line, f"{option} {path}")


def check_key_text(key: str, source: str) -> str:
    """`key` unchanged; ValueError naming `source` if it is empty, has whitespace at either end
    (trimmed silently, it would be a different key than the operator typed or shared) or holds
    a control character (a newline inside: no client could send it)."""
    if not key:
        raise ValueError(f"{source}: the key is empty")
    if key != key.strip():
        raise ValueError(
            f"{source}: the key has leading or trailing whitespace; remove it (keys are "
            "compared exactly)"
        )
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        raise ValueError(f"{source}: the key holds a control character (no header can carry it)")
    return key
