"""A private on-disk cache for the compiled kernels: nobody else may write into it.

The library is dlopen()ed into the user's process, so a file another local user could
plant or replace would run their code there.  Rules:

* the cache directory is created 0700 and refused when it is owned by another user or
  writable by its group or others (no silent repair: files inside may already be planted);
* a library is loaded only if it is a regular file (not a symlink) owned by the current
  user and not group- or world-writable;
* writes are atomic (a private temporary directory, then ``os.replace``).

Directory: ``$FLASHOT_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashot``, else
``~/.cache/flashot``; when that cannot be created or written, ``<tmp>/flashot-<uid>``
(which must pass the same checks: another user may have created it first).
"""

from __future__ import annotations

import os
import stat
import tempfile

__all__ = ["CacheDirError", "cache_dir", "private_cache_dir", "check_private_file"]


class CacheDirError(OSError):
    """The cache directory or a file in it could be written by another user."""


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def cache_dir() -> str:
    """The configured (preferred) cache directory; it may not exist yet."""
    d = os.environ.get("FLASHOT_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "flashot")
    return d


def _check_owner_mode(path: str, st: os.stat_result, what: str) -> None:
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        raise CacheDirError(
            f"{what} {path} is owned by uid {st.st_uid}, not by you (uid {uid}): refusing to "
            f"use it (another user could plant code there). Set FLASHOT_CACHE_DIR to a "
            f"directory of your own."
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDirError(
            f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
            f"refusing to use it (another user could plant code there). Remove it, or "
            f"'chmod 700' it if you trust its contents."
        )


def _ensure_private(d: str) -> str:
    if not os.path.isdir(d):
        parent = os.path.dirname(os.path.abspath(d))
        os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    st = os.stat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirError(f"cache directory {d} is not a directory")
    _check_owner_mode(d, st, "cache directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise PermissionError(f"cache directory {d} is not writable")
    return d


def private_cache_dir() -> str:
    """The cache directory, created 0700 and checked; the per-user temp fallback when the
    configured one cannot be created or written.  Raises :class:`CacheDirError` when a
    directory exists but another user could write into it (never falls back past that)."""
    d = cache_dir()
    try:
        return _ensure_private(d)
    except CacheDirError:
        raise
    except OSError:  # read-only home (CI, containers): a per-user temp dir
        uid = _uid()
        fallback = os.path.join(tempfile.gettempdir(), f"flashot-{uid if uid is not None else 'user'}")
        return _ensure_private(fallback)


def check_private_file(path: str) -> None:
    """Raise :class:`CacheDirError` unless ``path`` is a regular file (not a symlink) owned by
    the current user and not group- or world-writable."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CacheDirError(f"cached library {path} is not a regular file (a symlink?): refusing to load it")
    _check_owner_mode(path, st, "cached library")
