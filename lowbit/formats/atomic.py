"""Write outputs to a temporary sibling and rename into place only when complete.

A crash or a bad input mid-way leaves nothing behind under the final name, and an existing
output is only replaced when the caller says so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from lowbit.errors import UsageError


def check_output_path(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise UsageError(f"output {path} already exists (pass --overwrite to replace it)")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _temp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_dir(path: str | os.PathLike, overwrite: bool = False) -> contextlib.AbstractContextManager[Path]:
    """Yield an empty temporary directory that becomes `path` when the block succeeds."""
    return _atomic(Path(path), overwrite, directory=True)


def atomic_file(path: str | os.PathLike, overwrite: bool = False) -> contextlib.AbstractContextManager[Path]:
    """Yield a temporary file path that becomes `path` when the block succeeds."""
    return _atomic(Path(path), overwrite, directory=False)


@contextlib.contextmanager
def _atomic(path: Path, overwrite: bool, directory: bool) -> Iterator[Path]:
    check_output_path(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(path)
    if directory:
        tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    _replace(tmp, path)


def _replace(tmp: Path, path: Path) -> None:
    if path.exists():
        # Move the old output aside first so the final name is never missing for long.
        old = _temp_sibling(path)
        os.replace(path, old)
        os.replace(tmp, path)
        _remove(old)
    else:
        os.replace(tmp, path)
