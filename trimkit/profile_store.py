"""Stored profiles: where they live, and reading and writing them safely.

A :class:`~trimkit.profile.Profile` is stored as JSON in the user cache folder
(:func:`cache_dir`: ``$TRIMKIT_CACHE_DIR``, else the platform's user cache folder for trimkit —
``$XDG_CACHE_HOME/trimkit`` or ``~/.cache/trimkit`` on Linux) under a file named by its key's
hash, written atomically, and reused by the next run with the same key.

A stored file is untrusted input: :func:`load_profile` reads only a regular file of at most
:data:`MAX_PROFILE_BYTES` (a FIFO or a device at the path never blocks it) and builds the
profile with :meth:`~trimkit.profile.Profile.from_dict`, which checks every field. A file that
is unusable is reported by one warning naming it, and ``load_profile`` returns None (so the
caller calibrates again). A cache folder that cannot be written only costs the reuse:
:func:`save_profile` warns once and the profile stays in memory.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import platformdirs

from trimkit.errors import ProfileError
from trimkit.profile import Profile, ProfileKey

__all__ = ["cache_dir", "profile_path", "load_profile", "save_profile", "MAX_PROFILE_BYTES", "STALE_TMP_S"]

log = logging.getLogger("trimkit")

#: a stored profile larger than this is refused unread (a real one is a few KiB)
MAX_PROFILE_BYTES = 16 * 1024 * 1024
#: a ``.profile-*.tmp`` file older than this is left over from a killed save and is removed
STALE_TMP_S = 60.0


def cache_dir() -> Path:
    """trimkit's cache folder: ``$TRIMKIT_CACHE_DIR`` when set, else the user cache folder
    (:func:`platformdirs.user_cache_dir`: ``$XDG_CACHE_HOME/trimkit``, else ``~/.cache/trimkit``
    on Linux; ``~/Library/Caches/trimkit`` on macOS; ``%LOCALAPPDATA%\\trimkit\\Cache`` on Windows)."""
    env = os.environ.get("TRIMKIT_CACHE_DIR")
    if env:
        return Path(env)
    return Path(platformdirs.user_cache_dir("trimkit", appauthor=False))


def profile_path(key: ProfileKey) -> Path:
    """Where the profile for ``key`` is stored: ``<cache_dir>/profiles/<key digest>.json``."""
    return cache_dir() / "profiles" / f"{key.digest()}.json"


def _stat(path: Path) -> os.stat_result | None:
    """The file's status, None when there is no file; ProfileError when it cannot be looked at."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as exc:  # permission denied, a name the OS refuses
        raise ProfileError(f"unreadable ({getattr(exc, 'strerror', None) or exc})") from None


def _read_json(path: Path, st: os.stat_result) -> Any:
    """The parsed JSON of the file at ``path`` (status ``st``); ProfileError when it is not a
    regular file, too large, not UTF-8 or not JSON. Never blocks: the type is checked before
    opening and the open is non-blocking (a FIFO swapped in between is caught by ``fstat``)."""
    if not stat.S_ISREG(st.st_mode):
        raise ProfileError("not a regular file")
    if st.st_size > MAX_PROFILE_BYTES:
        raise ProfileError(f"{st.st_size} bytes, over the {MAX_PROFILE_BYTES}-byte limit for a profile")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ProfileError(f"unreadable ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as fh:
        try:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise ProfileError("not a regular file")
            raw = fh.read(MAX_PROFILE_BYTES + 1)
        except OSError as exc:
            raise ProfileError(f"unreadable ({exc.strerror or exc})") from None
    if len(raw) > MAX_PROFILE_BYTES:
        raise ProfileError(f"over the {MAX_PROFILE_BYTES}-byte limit for a profile")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProfileError("not UTF-8 text") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, a 5000-digit int, [[[[…
        raise ProfileError(f"not JSON ({type(exc).__name__}: {str(exc)[:120]})") from None


#: (path, file identity, reason) of unusable profiles already warned about: one warning per file
_warned_unusable: set[tuple[Any, ...]] = set()
#: cache folders already warned about as unwritable (cleared when a save there succeeds)
_warned_unwritable: set[str] = set()
_warn_lock = threading.Lock()


def _first_time(seen: set[Any], mark: Any) -> bool:
    """Record ``mark`` in ``seen``; True the first time (one warning per file or folder)."""
    with _warn_lock:
        first = mark not in seen
        seen.add(mark)
    return first


def _warn_unusable(path: Path, ident: Any, reason: str) -> None:
    """One warning per unusable file (wrap() and the CLI may look at it twice before recalibrating)."""
    first = _first_time(_warned_unusable, (str(path), ident, reason))
    (log.warning if first else log.info)("stored profile %s is unusable: %s; calibrating again", path, reason)


def _clean_stale_tmp(folder: Path, now: float | None = None) -> None:
    """Remove ``.profile-*.tmp`` files older than :data:`STALE_TMP_S`: left by a save that was
    killed (SIGKILL, power loss) between writing and renaming. Best effort."""
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if not (entry.name.startswith(".profile-") and entry.name.endswith(".tmp")):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime > STALE_TMP_S:
                os.unlink(entry.path)
        except OSError:
            continue


def _warn_unwritable(folder: Path, exc: OSError) -> None:
    first = _first_time(_warned_unwritable, str(folder))
    (log.warning if first else log.debug)(
        "trimkit: cannot store the calibration profile in %s (%s); it is kept in memory only, so the next "
        "process calibrates again (set TRIMKIT_CACHE_DIR to a writable folder)", folder, exc.strerror or exc,
    )


def save_profile(profile: Profile, path: Path | None = None) -> Path | None:
    """Write ``profile`` as JSON atomically (temp file + rename). Returns the path.

    Without ``path`` it goes to the user cache (:func:`profile_path`); a cache folder that
    cannot be written (read-only, a file in the way, disk full) is then no error: one warning
    per folder is logged, the profile is kept in memory only, and None is returned. An explicit
    ``path`` that cannot be written raises the OSError. Leftover temp files of a killed save
    older than a minute are removed from the folder."""
    explicit = path is not None
    path = path or profile_path(profile.key)
    blob = json.dumps(profile.to_dict(), indent=1)  # fails (TypeError) before anything is written
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale_tmp(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(blob)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if explicit or not isinstance(exc, OSError):
            raise
        _warn_unwritable(path.parent, exc)
        return None
    with _warn_lock:
        _warned_unwritable.discard(str(path.parent))
    return path


def load_profile(key: ProfileKey, path: Path | None = None) -> Profile | None:
    """The stored profile for ``key``, or None when there is none, it was made under another
    key, or it is unusable: not a regular file, over :data:`MAX_PROFILE_BYTES`, not JSON, or
    any field missing, mistyped or out of range. An unusable file is reported by one warning
    naming it and what is wrong (the caller calibrates again and overwrites it)."""
    path = path or profile_path(key)
    st = None
    try:
        st = _stat(path)
        if st is None:
            return None
        profile = Profile.from_dict(_read_json(path, st))
    except ProfileError as exc:
        ident = None if st is None else (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        _warn_unusable(path, ident, str(exc))
        return None
    if profile.key != key:
        log.info("stored profile %s was made for another configuration; calibrating again", path)
        return None
    return profile
