"""Where a file store lives: its URL parsed to a directory, checked and created if allowed."""

from __future__ import annotations

import stat
from pathlib import Path


def parse_file_url(url: str) -> Path:
    """`file:///abs/dir`, `file://rel/dir` or a plain path -> Path."""
    path = url[len("file://") :] if url.lower().startswith("file://") else url
    if not path:
        raise ValueError(f"storage url {url!r} names no directory")
    return Path(path)


def resolve_dir(url: str, create: bool, mode: int = 0o700) -> Path:
    """The store directory of `url`, created (with `mode`) if allowed; one-line ValueError
    otherwise."""
    try:
        return _make_dir(url, create, mode)
    except OSError as exc:
        raise ValueError(f"storage url {url!r}: cannot create the directory: {exc}") from None


def _make_dir(url: str, create: bool, mode: int) -> Path:
    root = parse_file_url(url)
    try:  # one stat: with is_dir() then exists(), a rank creating it between the two reads
        # as "exists and is not a directory" (ranks open the same store at once)
        if stat.S_ISDIR(root.stat().st_mode):
            return root
        raise ValueError(f"storage url {url!r}: {root} exists and is not a directory")
    except FileNotFoundError:
        pass
    if not create:
        raise ValueError(
            f"storage url {url!r}: directory {root} does not exist (create_dir is off)"
        )
    if not root.parent.is_dir():
        raise ValueError(
            f"storage url {url!r}: parent directory {root.parent} of {root} does not exist"
        )
    root.mkdir(mode, exist_ok=True)  # another rank may have made it meanwhile: fine
    return root


def refuse_whole_page_dir(url: str, commits: str = "commits", suffix: str = ".kvp") -> None:
    """ValueError if `url` is a store of whole pages written before the unit layout.

    Every unit store creates its commits directory when it opens, before any unit is written,
    so page files with no commits directory beside them can only be whole pages of the older
    layout (one file per page key): a unit store would silently miss every one of them.
    """
    root = parse_file_url(url)
    if not root.is_dir() or (root / commits).is_dir():
        return
    for sub in root.iterdir():
        if len(sub.name) == 2 and sub.is_dir() and next(sub.glob(f"*{suffix}"), None):
            raise ValueError(
                f"storage url {url!r}: {root} holds whole-page files of the layout before "
                "kvstrata-unit-v1 (no commits/ directory); they are not read: use a new "
                "directory or delete this one"
            )
