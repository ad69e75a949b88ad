"""A file store's directory: made once however many ranks open it at the same moment."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvstrata.storage.file_dirs import resolve_dir


def _open_at_once(url: str, n: int) -> list[BaseException]:
    """`n` threads released together all resolve `url` (create on); the errors they raised."""
    gate, errors = threading.Barrier(n), []

    def one() -> None:
        gate.wait(timeout=10)
        try:
            resolve_dir(url, create=True)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return errors


def test_ranks_opening_a_new_store_at_once_all_succeed(tmp_path: Path) -> None:
    """Ranks open one new store together (the CI failure: one read the directory another had just
    made as "exists and is not a directory")."""
    for i in range(300):
        url = str(tmp_path / f"storage-{i}")
        assert _open_at_once(url, 4) == []
        assert Path(url).is_dir()


def test_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        resolve_dir(str(tmp_path / "f"), create=True)


def test_missing_directory_with_create_off_or_no_parent(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist \\(create_dir is off\\)"):
        resolve_dir(str(tmp_path / "new"), create=False)
    with pytest.raises(ValueError, match="parent directory"):
        resolve_dir(f"file://{tmp_path}/a/b", create=True)
    assert resolve_dir(f"file://{tmp_path}/c", create=True) == tmp_path / "c"
