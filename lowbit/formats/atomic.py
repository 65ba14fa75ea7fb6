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

from lowbit.errors import LowbitError, UsageError


def check_output_path(path: Path, overwrite: bool, directory: bool = True) -> None:
    """Refuse, in one line and before any work, an output that cannot or must not be written:
    a path that names no new entry ('.', '..', the current folder or one above it), one under a
    file, an existing one without --overwrite, and with --overwrite anything that is not a
    replaceable output (a folder must look like a checkpoint: --overwrite never deletes a folder
    of other things)."""
    path = Path(path)
    resolved = path.expanduser().resolve()
    if path.name in ("", ".", "..") or resolved == Path.cwd().resolve() or resolved in Path.cwd().resolve().parents:
        raise UsageError(f"output {str(path)!r} is a folder that exists around you, not a new output: "
                         "give a name such as ./smollm2-int4")
    for parent in resolved.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"cannot create output {path}: {parent} is a file, not a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UsageError(f"cannot create output {path}: {parent} is not writable")
            break
    if not (path.exists() or path.is_symlink()):
        return
    if not overwrite:
        raise UsageError(f"output {path} already exists (pass --overwrite to replace it)")
    if path.is_dir() and not path.is_symlink():
        if not directory:
            raise UsageError(f"--overwrite would replace the folder {path} with a file; remove it yourself if that is meant")
        entries = sorted(p.name for p in path.iterdir())
        if entries and not any(marker in entries for marker in CHECKPOINT_MARKERS):
            raise UsageError(f"--overwrite refuses to delete {path}: it does not look like a checkpoint (no config.json); "
                             f"it holds {entries[0]}{f' and {len(entries) - 1} more' if len(entries) > 1 else ''}")
    elif directory:
        raise UsageError(f"--overwrite would replace the file {path} with a folder; remove it yourself if that is meant")


# A folder holding one of these is a checkpoint that lowbit (or Hugging Face tooling) wrote.
CHECKPOINT_MARKERS = ("config.json", "model.safetensors", "model.safetensors.index.json")


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
    check_output_path(path, overwrite, directory)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_siblings(path)
        tmp = _temp_sibling(path)
        if directory:
            tmp.mkdir()
    except OSError as exc:
        raise LowbitError(f"cannot write output {path}: {exc.strerror or exc}") from None
    try:
        yield tmp
        _apply_umask(tmp)
        _replace(tmp, path)
    except OSError as exc:
        _remove(tmp)
        # Name the output the user asked for, not the temporary sibling it was being written to.
        if str(tmp) in str(getattr(exc, "filename", "") or "") or str(tmp) in str(exc):
            raise LowbitError(f"cannot write output {path}: {exc.strerror or type(exc).__name__}") from None
        raise
    except BaseException:
        _remove(tmp)
        raise


def _remove_stale_siblings(path: Path) -> None:
    """Temporary siblings of earlier runs that were killed (SIGKILL, power loss) before cleaning up:
    their process is gone, so nothing will ever rename them; a run still alive keeps its own."""
    for stale in path.parent.glob(f".{glob_escape(path.name)}.tmp-*"):
        pid = stale.name[len(path.name) + 6:].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            _remove(stale)


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _apply_umask(tmp: Path) -> None:
    """safetensors (and tempfile) create files as 0600; an output gets the modes the umask gives any
    other file the user writes, so a checkpoint shared on a server is readable like its config.json."""
    mask = os.umask(0)
    os.umask(mask)
    paths = [tmp, *tmp.rglob("*")] if tmp.is_dir() else [tmp]
    for entry in paths:
        if entry.is_symlink():
            continue
        os.chmod(entry, (0o777 if entry.is_dir() else 0o666) & ~mask)


def _replace(tmp: Path, path: Path) -> None:
    if path.exists():
        # Move the old output aside first so the final name is never missing for long.
        old = _temp_sibling(path)
        os.replace(path, old)
        os.replace(tmp, path)
        _remove(old)
    else:
        os.replace(tmp, path)
