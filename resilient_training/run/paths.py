"""Whether a path the user named can be written, found out without writing anything.

Every command that writes checks its output paths here first, so bad input (a parent that is
a file, an unwritable or read-only parent, a name longer than the file system allows, a
directory where a file was asked for) is one clear ``ValueError`` before anything is created.
"""

from __future__ import annotations

import errno
import os
import re
import unicodedata
from pathlib import Path

# C0, DEL and C1 (category Cc: U+0085 is a newline to some readers).
_CONTROL = frozenset({chr(c) for c in range(32)} | {chr(c) for c in range(0x7F, 0xA0)})


# Less free space than this where a checkpoint is written is named when a writer dies unexplained.
LOW_SPACE_BYTES = 1 << 30


def low_space(paths: list[Path]) -> str:
    """" (DIR has N MiB free)" for each of ``paths`` (existing directories) with less than
    :data:`LOW_SPACE_BYTES` free, else "": a writer that died of ENOSPC often cannot write why
    (a 1.3B run's writer on one H200, 2026-12-02: "exited with code 1", the disk at 0 bytes).
    """
    import shutil

    notes = []
    for path in paths:
        try:
            free = shutil.disk_usage(path).free
        except OSError:
            continue
        if free < LOW_SPACE_BYTES:
            notes.append(f"{path} has {free >> 20} MiB free")
    return f" ({'; '.join(notes)}: a full disk?)" if notes else ""


def has_control(text: str) -> bool:
    """A control character (a pasted newline, a tab, C1's U+0085), an invisible format character (a
    bidi override such as U+202E, a zero-width space, category Cf) or a lone surrogate (bytes that are
    not UTF-8, which Python decodes with surrogateescape): a mistake in a path, name or setting, never
    data (stranger trial: each reached a KFP server as a name that looks like another, or cannot be read).
    """
    return any(ch in _CONTROL or unicodedata.category(ch) in ("Cf", "Cs") for ch in text)


def control_note(text: str) -> str:
    """What :func:`has_control` found first in ``text``, for a message: "a control character (a newline?)",
    "bytes that are not UTF-8" or "an invisible format character (U+202E)"; "" when none.
    """
    for ch in text:
        if ch in _CONTROL:
            return "a control character (a newline?)"
        category = unicodedata.category(ch)
        if category == "Cs":
            return "bytes that are not UTF-8"
        if category == "Cf":
            return f"an invisible format character (U+{ord(ch):04X}, {unicodedata.name(ch, 'unnamed')})"
    return ""


def input_problem(path: str | os.PathLike[str], what: str) -> str | None:
    """Why a path named as input cannot even be looked up (one line), else None: a control
    character, a name past the file system's limit, a loop of symbolic links. Each of these was a
    traceback in a stranger trial; a path that merely does not exist is the caller's to say.
    """
    text = os.fspath(path)
    if not text.strip():  # an unset variable: "" would be read as the current directory
        return f"{what} is empty"
    if has_control(text):
        return f"{what} {text!r} contains a control character (a newline?): give the path without it"
    try:
        os.stat(text)
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            longest = max(Path(text).parts or [text], key=lambda part: len(os.fsencode(part)))
            return (f"{what}: the name {longest[:24]}... ({len(os.fsencode(longest))} bytes) is longer than the file "
                    "system allows")
        if exc.errno == errno.ELOOP:
            return f"{what} {text}: too many levels of symbolic links (a loop?)"
    except ValueError as exc:  # an embedded NUL
        return f"{what} {text!r}: {exc}"
    return None


def check_writable(path: str | os.PathLike[str], what: str, *, directory: bool) -> Path:
    """The absolute path, or ``ValueError`` when it cannot be created or written as given.

    ``directory``: the path is a directory to create or write into; else a file to (re)write.
    """
    text = os.fspath(path)
    if not text.strip():
        raise ValueError(f"{what} is empty")
    if has_control(text):
        raise ValueError(f"{what} {text!r} contains a control character (a newline?)")
    if text != text.strip():  # as promote's DEST: "runs/x " made a directory whose name ends in a space
        raise ValueError(f"{what} {text!r} has leading or trailing whitespace: remove it")
    if text[:3].lower() == "s3:" or re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", text):
        # A stranger trial: `report -o s3://bucket/r.html` wrote ./s3:/bucket/r.html, and said "wrote s3://...".
        kind = "an s3:// URL" if text[:3].lower() == "s3:" else "a URL"
        hint = "" if "://" in text else f" (a local name that starts with s3:? write ./{text})"
        raise ValueError(f"{what} takes a local path, not {kind}: {text}{hint}")
    target = Path(os.path.abspath(text))
    ancestor = target
    while not os.path.exists(ancestor):  # os.path: False (not an error) for a name too long to stat
        if os.path.islink(ancestor) and (directory or ancestor != target):  # creating it fails "File exists"
            raise ValueError(f"{what} {text}: {ancestor} is a symbolic link to {os.readlink(ancestor)}, "
                             "which leads nowhere (a dangling link or a loop)")
        ancestor = ancestor.parent
    if ancestor != target and not ancestor.is_dir():
        raise ValueError(f"{what} {text}: {ancestor} is a file, not a directory")
    name_max = os.pathconf(ancestor if ancestor.is_dir() else ancestor.parent, "PC_NAME_MAX")
    path_max = os.pathconf(ancestor if ancestor.is_dir() else ancestor.parent, "PC_PATH_MAX")
    if len(os.fsencode(str(target))) >= path_max:
        raise ValueError(f"{what} is {len(os.fsencode(str(target)))} bytes long, past the system's limit ({path_max})")
    for part in target.relative_to(ancestor).parts:
        if len(os.fsencode(part)) > name_max:
            raise ValueError(f"{what}: the name {part[:24]}... is {len(os.fsencode(part))} bytes, longer than "
                             f"the file system allows ({name_max})")
    if target.is_dir() and not directory:
        raise ValueError(f"{what} {text} is a directory: name a file")
    if not directory and os.path.islink(target):
        # A file is replaced through a temporary one beside it: that replaces the link, not what it
        # leads to (a stranger trial's `report -o /dev/stdout`, as root, made /dev/stdout a file).
        raise ValueError(f"{what} {text} is a symbolic link (to {os.readlink(target)}): name the file itself")
    if not directory and target.exists() and not target.is_file():
        raise ValueError(f"{what} {text} is not a regular file (a device, pipe or socket): name a file")
    if target.exists() and not target.is_dir() and directory:
        raise ValueError(f"{what} {text} exists and is not a directory")
    # What gets written into: the directory itself, else the file's directory (files are replaced via a
    # temporary file beside them), else the deepest directory that exists (where creation starts).
    into = target if target == ancestor and directory else target.parent if target == ancestor else ancestor
    if not os.access(into, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {text}: {into} is not writable")
    return target


def probe_writable(path: str | os.PathLike[str], what: str) -> None:
    """``ValueError`` unless a file can be made where ``path`` (a file) will be written, found out by making
    one: an anonymous temporary file in its directory, or in the deepest directory that exists.

    For the last check before writing, after every check that writes nothing (the probe is gone at
    once, but may touch the directory's times): :func:`check_writable`'s ``access()`` test says yes
    to root on /proc, where no file can be created.
    """
    import tempfile

    into = Path(os.path.abspath(os.fspath(path))).parent
    while not into.is_dir():
        into = into.parent
    try:
        with tempfile.TemporaryFile(dir=into):
            pass
    except OSError as exc:
        raise ValueError(f"{what} {os.fspath(path)}: cannot create a file in {into} ({exc.strerror or exc})") from None
