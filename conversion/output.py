"""Writing OUTPUT without ever losing what is there: the staging directory, publishing, stale partials.

A conversion writes into a staging directory beside OUTPUT and publishes it with one rename:

    OUTPUT.parent/.{OUTPUT.name}.partial-<16 hex digits>/   (a long name cut short, see partial_prefix)
        .selective-rope-convert.lock   our marker; the running conversion holds an flock on it
        model/                         the converted model, renamed to OUTPUT once everything succeeded
        previous/                      (only where no atomic exchange exists) the replaced OUTPUT, until the new
                                       model is in place

- OUTPUT must lie apart from the source: not the source, not inside it, not containing it, compared by identity
  (``st_dev``, ``st_ino``), so no bind mount or other alias gets past (:func:`refuse_overlap`). The source's model
  files must be regular files: a FIFO would block the read forever (:func:`refuse_special_files`).
- Publishing never replaces anything unless asked (``renameat2(RENAME_NOREPLACE)``): an OUTPUT that appeared while
  converting is left alone. ``overwrite`` swaps the old and the new model in one step (``RENAME_EXCHANGE``), so a
  kill at any instant leaves one of them at OUTPUT; the old one is deleted only once the new one is in place. It
  replaces only a folder this tool could have written (a ``config.json`` with a ``model_type``, model files, no
  subfolders) or an empty one, and never deletes across a mount point (:func:`refuse_replacing`, :func:`_remove`).
- A failure, or SIGINT / SIGTERM (which the command raises as ``KeyboardInterrupt``), removes the staging directory
  and the parent folders the run created. SIGKILL cannot be handled in the process: the next run for the same OUTPUT
  removes the partials whose lock no process holds, and only directories with our name *and* our marker.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock, so no way to tell a dead partial from a live one: they are left alone
    fcntl = None

logger = logging.getLogger(__name__)

MARKER = ".selective-rope-convert.lock"
TOOL = "selective-rope convert"


# ------------------------------------------------------------------------------------------------ source and output

# The files a model folder holds at its top level: what this tool writes (config, generation config, card, weights
# and their index, tokenizer files, the flat code bundle of modeling/remote_code.py) and what save_pretrained
# writes. `--overwrite` replaces nothing else, and the source's files of these names must be regular files.
TOKENIZER_FILES = re.compile(r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt|"
                             r"chat_template\..*|.*\.tiktoken|spiece\.model)$")
MODEL_FILES = re.compile(r"(config|generation_config)\.json|README\.md|"
                         r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)|"
                         r"(model\.safetensors|pytorch_model\.bin)\.index\.json|"
                         r"(configuration|modeling|kernels)_\w+\.py")


def is_model_file(name: str) -> bool:
    return MODEL_FILES.fullmatch(name) is not None or TOKENIZER_FILES.match(name) is not None


def _identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of what ``path`` reaches (symlinks followed), or None where nothing is there. One
    directory seen at two paths (a bind mount, a filesystem mounted twice, a case-insensitive name) has one
    identity, which path strings cannot tell."""
    try:
        status = os.stat(path)
    except (OSError, ValueError):
        return None
    return status.st_dev, status.st_ino


def _ancestry(path: str | os.PathLike) -> list[tuple[int, int]]:
    """The identities of ``path``'s existing ancestors (itself excluded), nearest first."""
    real = Path(os.path.realpath(path))  # `..` after a symlink goes where the kernel goes
    return [identity for parent in real.parents if (identity := _identity(parent)) is not None]


def refuse_overlap(source_dir: Path, output: Path) -> None:
    """``ValueError`` naming both unless ``output`` lies apart from the source: it must not be the source directory
    or a file the source reads (a Hub snapshot's files are links into the cache's ``blobs/``), contain one of them,
    or lie inside the source directory. ``--overwrite`` would otherwise delete the source. Directories are compared
    by identity, not by path, so no other path to the source (a symlink, a bind mount of it or of a folder above it,
    a filesystem mounted twice) gets past."""
    target, source = _identity(output), _identity(source_dir)
    relation = ("is" if target is not None and target == source
                else "contains" if target is not None and target in _ancestry(source_dir)
                else "lies inside" if source is not None and source in _ancestry(output) else None)
    if relation:
        raise ValueError(f"OUTPUT {output} {relation} the source {source_dir}: write the converted model somewhere "
                         "else (OUTPUT must not be, contain or lie inside SOURCE)")
    if target is None:
        return
    for file in source_dir.iterdir():
        if target == _identity(file) or target in _ancestry(file):
            real = Path(os.path.realpath(file))
            raise ValueError(f"OUTPUT {output} {'is' if target == _identity(file) else 'contains'} {real}, which the "
                             f"source {source_dir} reads ({file.name}): write the converted model somewhere else")


def _kind(mode: int) -> str:
    kinds = {stat.S_ISREG: "a file", stat.S_ISDIR: "a folder", stat.S_ISLNK: "a symlink", stat.S_ISFIFO: "a FIFO",
             stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return next((kind for test, kind in kinds.items() if test(mode)), "a special file")


def refuse_special_file(path: Path) -> None:
    """``ValueError`` unless ``path`` (symlinks followed) is a regular file or missing: opening a FIFO waits for a
    writer forever, a device reads without end."""
    with contextlib.suppress(OSError):
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path} is {_kind(mode)}, not a regular file: convert reads only regular files")


def refuse_special_files(source_dir: Path) -> None:
    """``ValueError`` naming the first of the source's model files (config, weights, tokenizer files, card; the
    names :func:`is_model_file` knows) that is not a regular file. Nothing else in the folder is ever opened."""
    for file in sorted(source_dir.iterdir()):
        if is_model_file(file.name):
            refuse_special_file(file)


def _is_empty_folder(path: Path) -> bool:
    """A real directory (not a link to one) with nothing in it."""
    if not path.is_dir() or path.is_symlink():
        return False
    with os.scandir(path) as entries:
        return next(entries, None) is None


def _model_type(config: Path) -> str | None:
    """The ``model_type`` of a regular ``config.json`` (not a link; opened without blocking, so a FIFO in its place
    cannot hang us), or None."""
    try:
        fd = os.open(config, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            content = json.loads(file.read())
        except ValueError:
            return None
    model_type = content.get("model_type") if isinstance(content, dict) else None
    return model_type if isinstance(model_type, str) and model_type else None


def _not_model_files(folder: Path) -> list[str]:
    """What in ``folder`` this tool never writes: subfolders (named with a trailing ``/``), links, FIFOs and other
    special files, and files whose names are not model files; sorted."""
    foreign = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                foreign.append(entry.name + "/")
            elif not (entry.is_file(follow_symlinks=False) and is_model_file(entry.name)):
                foreign.append(entry.name)
    return sorted(foreign)


def _listing(names: list[str], at_most: int = 8) -> str:
    shown = ", ".join(names[:at_most])
    return shown + (f" and {len(names) - at_most} more" if len(names) > at_most else "")


def refuse_replacing(output: Path) -> None:
    """``ValueError`` unless ``--overwrite`` may replace ``output``: missing, an empty folder, or a folder this tool
    could have written, with no mount point in it or at it: a ``config.json`` holding a ``model_type``, and at its
    top level only regular model files (weights, index, tokenizer files, card, generation config, code bundle), no
    subfolders. Anything else (a project with a ``config.json``, a training run with its checkpoints, a file, a
    link) is someone's: the message lists what would have been deleted."""
    if not os.path.lexists(output):
        return
    if os.path.islink(output) or not os.path.isdir(output):
        raise ValueError(f"OUTPUT {output} is {_kind(os.lstat(output).st_mode)}, not a model folder: --overwrite "
                         "only replaces a model folder; choose another OUTPUT, or remove it yourself")
    if _is_mount_point(output):
        raise ValueError(f"OUTPUT {output} is a mount point: --overwrite would delete what is mounted there; choose "
                         "another OUTPUT")
    if _is_empty_folder(output):
        return
    mounted = mount_points(output)
    if mounted:
        raise ValueError(f"OUTPUT {output} holds a mount point ({mounted[0]}): --overwrite would delete what is "
                         "mounted there; choose another OUTPUT")
    foreign = _not_model_files(output)
    if _model_type(output / "config.json") is None:
        reason = "a config.json with no model_type" if os.path.lexists(output / "config.json") else "no config.json"
        foreign = sorted(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else "")
                         for entry in os.scandir(output))  # all of it would go
    elif foreign:
        reason = "it holds more than model files"
    else:
        return
    raise ValueError(f"OUTPUT {output} is not a model folder ({reason}): --overwrite would delete {_listing(foreign)}"
                     "; it only replaces a folder this tool could have written (a config.json with a model_type and "
                     "model files, no subfolders): choose another OUTPUT, or remove them yourself")


# ---------------------------------------------------------------------------------------------------------- renames

AT_FDCWD, RENAME_NOREPLACE, RENAME_EXCHANGE = -100, 1, 2


def _load_renameat2():
    """Linux's ``renameat2`` (glibc >= 2.28), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_renameat2 = _load_renameat2()


def _rename_flagged(source: Path, target: Path, flags: int) -> bool:
    """``renameat2(source, target, flags)``; False where the kernel or the filesystem lacks it (the caller falls
    back), ``OSError`` for any other failure."""
    if _renameat2 is None:
        return False
    if _renameat2(AT_FDCWD, os.fsencode(source), AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(source), None, os.fspath(target))


def rename_no_replace(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target``; ``FileExistsError`` when anything is at ``target``, which is never replaced."""
    if _rename_flagged(source, target, RENAME_NOREPLACE):
        return
    if os.name == "nt":  # Windows' rename never replaces
        os.rename(source, target)
        return
    # POSIX rename replaces an empty directory (and a file, by a file): claim ``target`` first by creating it, which
    # is atomic and fails if anything is there, then rename onto that empty directory of ours.
    os.mkdir(target)
    try:
        os.rename(source, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(target)  # ours, unless something was put in it meanwhile
        raise


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block is done, then act on them as their handlers would, so that publishing
    and cleaning up never stop halfway.

    The handlers are replaced for the block rather than the signals blocked: a signal mask holds a signal for the
    calling thread only, and the kernel hands a process signal to any thread that does not block it (importing torch
    starts several), while Python runs every handler in the main thread. Only the main thread can set handlers: from
    another thread nothing is held (its code cannot be interrupted by them anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def hold(signum, frame) -> None:
        received.append(signum)

    previous = {signum: signal.signal(signum, hold) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(received):  # each signal once, in the order they came
            handler = previous[signum]
            if callable(handler):
                handler(signum, None)  # e.g. KeyboardInterrupt (SIGINT), or an outer block's `hold`
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)  # the default action, now that it is restored
            # SIG_IGN (or a handler not set from Python, None): ignored, as it would have been


# ---------------------------------------------------------------------------------------------------------- staging


def _mounted_paths() -> list[str] | None:
    """Every mount point of this process (Linux's ``/proc/self/mountinfo``, octal escapes decoded), or None."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
            fields = [line.split(" ")[4] for line in table if line.count(" ") >= 5]
    except OSError:
        return None
    return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path) for path in fields]


def mount_points(folder: Path) -> list[Path]:
    """The directories under ``folder`` (itself excluded) where a filesystem is mounted, a bind mount of someone's
    folder included: never descended into by :func:`_remove`, and never replaced by ``--overwrite``. From the mount
    table where there is one (a bind mount from the same filesystem has the same device number as its parent, so
    ``os.path.ismount`` cannot see it), and by device numbers while walking the tree."""
    root = os.path.realpath(folder)
    found = {Path(path) for path in _mounted_paths() or () if path.startswith(root.rstrip("/") + "/")}
    for directory, directories, _ in os.walk(root):  # (os.walk does not follow symlinks)
        for name in list(directories):
            path = Path(directory) / name
            if path in found or os.path.ismount(path):
                found.add(path)
                directories.remove(name)
    return sorted(found)


def _is_mount_point(path: Path) -> bool:
    """``path`` itself is a mount point, a bind mount from the same filesystem included (only the mount table shows
    those)."""
    return os.path.ismount(path) or os.path.realpath(path) in (_mounted_paths() or ())


def _remove(path: Path) -> None:
    """Remove a file, a symlink (not its target) or a directory tree, but never across a mount point: a tree holding
    one (a bind mount of someone's folder) raises ``OSError`` and keeps everything under it."""
    if not (path.is_dir() and not path.is_symlink()):
        path.unlink()
        return
    mounted = mount_points(path)
    if mounted:
        raise OSError(errno.EBUSY, f"not removed: {mounted[0]} is a mount point", os.fspath(path))
    shutil.rmtree(path)


def _remove_partial(partial: Path) -> bool:
    """Remove a staging directory, our marker last so that a partial interrupted here is still recognised as ours
    (SIGKILL cannot be deferred). False, with a warning, when something could not be removed (it stays marked)."""
    try:
        for entry in partial.iterdir():
            if entry.name != MARKER:
                with contextlib.suppress(FileNotFoundError):
                    _remove(entry)
        (partial / MARKER).unlink(missing_ok=True)
        partial.rmdir()
    except FileNotFoundError:  # already gone
        pass
    except OSError as error:
        logger.warning(f"could not remove {partial}: {error}")
        return False
    return True


def _abandoned_marker(marker: Path) -> int | None:
    """A descriptor holding the lock of ``marker`` when it is our marker and no process holds its lock, else None."""
    try:
        fd = os.open(marker, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:  # missing, a symlink, unreadable: not ours to judge
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while the conversion that wrote it runs
        ours = json.loads(os.read(fd, 4096)).get("tool") == TOOL
        # Its owner may have removed it (and finished) between our open and our lock: it must still be this file.
        same = os.stat(marker, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        if ours and same and stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except (OSError, ValueError, AttributeError):
        pass
    os.close(fd)
    return None


def _missing_or_claimed(output: Path) -> bool:
    """OUTPUT is missing, or an empty directory: where no atomic rename exists, publishing first creates OUTPUT empty
    to claim it (``rename_no_replace``), so a kill can leave it so with the replaced model still in ``previous/``."""
    if not os.path.lexists(output):
        return True
    try:
        return _is_empty_folder(output)
    except OSError:
        return False


def remove_stale_partials(output: str | os.PathLike) -> None:
    """Remove the staging directories of conversions into ``output`` that were killed (SIGKILL, power loss), saying
    so in one line each. One is stale when it has our name and our marker and no process holds the marker's lock;
    anything else is left alone. A partial that holds a replaced OUTPUT (``previous/``: a kill between the two
    renames of an overwrite where no atomic exchange exists) while OUTPUT is missing, or empty, gives it back first."""
    if fcntl is None:
        return
    output = Path(os.path.abspath(output))
    name = re.compile(rf"{re.escape(partial_prefix(output.name))}\.partial-[0-9a-f]{{16}}")
    try:
        entries = [entry for entry in os.scandir(output.parent)
                   if name.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for entry in entries:
        partial = Path(entry.path)
        fd = _abandoned_marker(partial / MARKER)
        if fd is None:
            continue
        try:
            with signals_deferred():
                previous = partial / "previous"
                if os.path.lexists(previous) and _missing_or_claimed(output):
                    with contextlib.suppress(FileNotFoundError):
                        os.rmdir(output)  # (empty: nothing is lost)
                    rename_no_replace(previous, output)
                    logger.warning(f"restored {output} from {partial}: an interrupted --overwrite had moved it there")
                if _remove_partial(partial):
                    logger.warning(f"removed {partial}: the partial output of an interrupted conversion (no running "
                                   "conversion holds its lock)")
        except OSError as error:
            logger.warning(f"could not clean up {partial}: {error}")
        finally:
            os.close(fd)


NAME_MAX = 255  # the longest file name, in bytes, on Linux's usual filesystems (ext4, xfs, btrfs, tmpfs)
PARTIAL_ROOM = NAME_MAX - len(".partial-") - 16  # for the staging name's prefix


def partial_prefix(name: str) -> str:
    """The start of the staging folder's name for an OUTPUT named ``name``: ``.<name>``, or where the staging name
    would exceed NAME_MAX (OUTPUT names of 230-255 bytes are legal), ``.<name cut short>~<digest of name>``: one
    prefix per OUTPUT name either way, which is how the next run finds the partials of a killed one."""
    prefix = f".{name}"
    if len(os.fsencode(prefix)) <= PARTIAL_ROOM:
        return prefix
    digest = "~" + hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    while len(os.fsencode(prefix + digest)) > PARTIAL_ROOM:
        prefix = prefix[:-1]  # whole characters, so the name stays valid text
    return prefix + digest


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    for path in (folder, *folder.parents):
        if os.path.lexists(path):
            break
        missing.append(path)
    return missing


class Staging:
    """A staging directory for ``output``, locked and marked as ours; :meth:`publish` moves its model to ``output``.

    Use through :func:`staged_output`, which removes it (and the folders it created) whatever happens.
    """

    def __init__(self, output: Path, overwrite: bool):
        self.output, self.overwrite = output, overwrite
        self.partial = output.parent / f"{partial_prefix(output.name)}.partial-{secrets.token_hex(8)}"
        self.directory = self.partial / "model"  # where the model is written
        self.previous = self.partial / "previous"
        self.missing = _missing_folders(output.parent)  # deepest first
        self.created: list[Path] = []  # those of them this run made (deepest first): removed unless published
        self.published = False
        self._lock: int | None = None

    def _create(self) -> None:
        for folder in reversed(self.missing):
            try:
                os.mkdir(folder)
            except FileExistsError:  # made by someone else meanwhile: not ours to remove
                continue
            self.created.insert(0, folder)
        os.mkdir(self.partial)
        # The marker becomes visible under its name only once locked, so that another run never sees it unlocked
        # while we live (the lock belongs to the file, and survives the rename).
        pending = self.partial / (MARKER + ".new")
        self._lock = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        if fcntl is not None:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
        os.write(self._lock, json.dumps({"tool": TOOL, "output": str(self.output), "pid": os.getpid(),
                                         "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode())
        os.rename(pending, self.partial / MARKER)
        os.mkdir(self.directory)

    def publish(self) -> None:
        """Rename the finished model to OUTPUT: without ``overwrite`` never over anything (``FileExistsError`` when
        OUTPUT appeared meanwhile); with it, swapping old and new in one step where the system allows."""
        with signals_deferred():
            while True:
                try:
                    rename_no_replace(self.directory, self.output)
                    break
                except FileExistsError:
                    if not self.overwrite:
                        raise FileExistsError(f"{self.output} appeared while converting and was left as it is; pass "
                                              "overwrite=True (--overwrite) to replace it") from None
                try:
                    self._replace()
                    break
                except FileNotFoundError:
                    if os.path.lexists(self.output):
                        raise
                    # OUTPUT vanished between the two calls: publish without replacing
            self.published = True

    def _replace(self) -> None:
        refuse_replacing(self.output)  # again: what is at OUTPUT now may have appeared while converting
        if _rename_flagged(self.directory, self.output, RENAME_EXCHANGE):
            return  # the old OUTPUT is now at self.directory, removed with the staging directory
        # No atomic exchange here (not Linux, or a filesystem without it): move the old OUTPUT aside, then the new one
        # in. A kill between the two renames leaves OUTPUT missing and the old model in this staging directory, which
        # the next run for OUTPUT puts back (remove_stale_partials).
        os.rename(self.output, self.previous)
        try:
            rename_no_replace(self.directory, self.output)
        except BaseException:
            rename_no_replace(self.previous, self.output)
            raise

    def close(self) -> None:
        """Remove the staging directory (holding nothing, or the replaced OUTPUT) and, unless the model was
        published, the folders this run created (those still empty)."""
        with signals_deferred():
            if self._lock is not None:
                _remove_partial(self.partial)
                os.close(self._lock)  # after the removal: until then the directory is visibly alive
                self._lock = None
            elif os.path.isdir(self.partial):  # _create failed before the marker existed
                shutil.rmtree(self.partial, ignore_errors=True)
            if not self.published:
                for folder in self.created:
                    try:
                        os.rmdir(folder)
                    except OSError:  # not empty: someone else's files are in it
                        break

    def write_error(self, error: OSError) -> OSError | None:
        """``error`` said as a failure to write OUTPUT when it is one (full disk, read-only filesystem, ...): it
        concerns the staging directory or a folder this run creates, or names no file."""
        if error.errno is None:
            return None
        if error.filename is not None:
            path = Path(os.path.abspath(error.filename))
            if path not in self.missing and path != self.partial and self.partial not in path.parents:
                return None
        existing = os.path.lexists(self.output) and not self.published
        return OSError(error.errno, f"cannot write {self.output}: {error.strerror or error}; "
                                    + (f"the existing {self.output} is unchanged" if existing
                                       else "nothing was left behind"))


@contextlib.contextmanager
def staged_output(output: str | os.PathLike, overwrite: bool) -> Iterator[Staging]:
    """A :class:`Staging` for ``output``: write the model into its ``directory``, then call its ``publish()``.
    Whatever happens, the staging directory is removed on exit, and on failure so are the parent folders it created;
    write failures are re-raised as one ``OSError`` naming OUTPUT."""
    output = Path(os.path.abspath(output))
    staging = Staging(output, overwrite)
    try:
        with signals_deferred():
            staging._create()
        yield staging
    except KeyboardInterrupt as interrupt:  # the command says whether OUTPUT holds the new model
        interrupt.published = staging.published
        raise
    except OSError as error:
        translated = staging.write_error(error)
        if translated is None:
            raise
        raise translated from error
    finally:
        staging.close()
