"""The ``code`` corpus: the running interpreter's own standard library sources, as documents.

Real code on every machine, with no download. The file list and the split are deterministic
for one Python version: files sorted by relative path, then the protocol's split (document
``i`` is a test document when ``i % 5 == 4``, :mod:`lowbit.data.windows`).
"""

from __future__ import annotations

from pathlib import Path

from .corpora import Document

__all__ = ["stdlib_documents", "STDLIB_EXCLUDED"]


#: folders whose files are not part of the code corpus: installed packages, the test suites
#: (data files and generated cases more than code people write), bytecode caches
STDLIB_EXCLUDED = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_documents(root: Path | None = None) -> list[Document]:
    """The ``code`` corpus: every ``*.py`` file under the standard library folder ``root``
    (default: ``sysconfig.get_paths()["stdlib"]`` of the running interpreter), one document per
    file, sorted by its POSIX path relative to ``root`` (the id and title).

    Files under a folder named in :data:`STDLIB_EXCLUDED`, files that are empty or only
    whitespace, and files that are not UTF-8 are left out; the text is the file as written,
    stripped at both ends. The same Python version gives the same documents; another version
    has other files and other text (the token cache is keyed by the documents, so it notices).

    Raises:
        FileNotFoundError: ``root`` is not a folder.
    """
    import sysconfig

    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no standard library folder for the code corpus")
    docs = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if STDLIB_EXCLUDED.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        try:
            text = path.read_bytes().decode("utf-8").strip()
        except UnicodeDecodeError:
            continue
        if text:
            docs.append(Document(rel.as_posix(), rel.as_posix(), text))
    return sorted(docs, key=lambda d: d.id)
