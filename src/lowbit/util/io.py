"""Writing files so that nothing is lost: a temporary path, renamed when complete.

Cache entries of tensors (:func:`save_tensors`) also carry a checksum of their contents in
the safetensors metadata; :func:`load_tensors` verifies it, so a truncated, corrupted or
foreign file is never read back as valid (:class:`CorruptFile`: the owner deletes and
recomputes it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_write_text", "atomic_dir", "write_json", "refuse_existing", "save_tensors", "load_tensors",
           "CorruptFile", "CHECKSUM_KEY", "discard_corrupt", "write_safetensors"]

log = logging.getLogger(__name__)

#: the safetensors metadata key holding the sha256 of a cache entry's tensors
CHECKSUM_KEY = "lowbit.sha256"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def refuse_existing(path: Path | str | None, force: bool) -> None:
    """Raise ``FileExistsError`` if ``path`` exists and ``force`` is not set (checked before
    any work, so that a long run never ends in a refusal)."""
    if path is not None and Path(path).exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force to overwrite it")


def write_json(path: Path, data, *, force: bool = False) -> Path:
    """``data`` as indented JSON at ``path``, atomically; an existing file only with ``force``."""
    import json

    refuse_existing(path, force)
    atomic_write_text(Path(path), json.dumps(data, indent=2, default=_plain) + "\n")
    return Path(path)


def _plain(v):
    """JSON for values the standard encoder refuses: numpy scalars and arrays as numbers, the rest (paths, dtypes) as text."""
    if hasattr(v, "tolist"):
        return v.tolist()
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


@contextmanager
def atomic_dir(path: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; on success it replaces ``path``.

    An existing ``path`` is refused unless ``force``; on error the temporary folder is
    removed and ``path`` is untouched.
    """
    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class CorruptFile(ValueError):
    """A tensor file that cannot be read, is truncated, or fails its checksum."""


def _digest(tensors: dict) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes, in name order."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_safetensors(path: Path | str, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, with a full disk raised as ``OSError(ENOSPC)`` naming
    ``path`` (safetensors reports I/O errors as its own exception type).  Tensors on a GPU
    are copied to the CPU first."""
    import errno

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {k: v if v.device.type == "cpu" else v.cpu() for k, v in tensors.items()}
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        if "os error 28" in str(e) or "No space left" in str(e):
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from None
        raise


def save_tensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as safetensors at ``path`` atomically (a unique temporary file in the
    same folder, flushed to disk, then renamed), with their checksum in the metadata.

    Concurrent writers of one path each write their own temporary file; the last rename wins
    and every reader sees one complete file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous().cpu() for k, v in tensors.items()}  # the checksum reads CPU bytes
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write_safetensors(tmp, tensors, {**(metadata or {}), CHECKSUM_KEY: _digest(tensors)})
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_tensors(path: Path) -> tuple[dict, dict[str, str]]:
    """``(tensors, metadata)`` of a file written by :func:`save_tensors`, verified.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptFile: it is not a readable safetensors file, has no checksum, or its
            contents do not match the checksum.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(path)
    try:
        with safe_open(str(path), "pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CorruptFile(f"{path}: unreadable ({e})") from None
    want = metadata.pop(CHECKSUM_KEY, None)
    if want is None:
        raise CorruptFile(f"{path}: no checksum (written incompletely or by another tool)")
    if _digest(tensors) != want:
        raise CorruptFile(f"{path}: contents do not match their checksum")
    return tensors, metadata


def discard_corrupt(err: CorruptFile, path: Path) -> None:
    """Log a corrupt cache entry and delete it, so that the caller recomputes it."""
    log.warning("discarding a corrupt cache entry, recomputing it: %s", err)
    Path(path).unlink(missing_ok=True)
