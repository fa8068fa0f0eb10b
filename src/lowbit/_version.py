"""The package version, in a module of its own so that any stage can read it without importing the package."""

__version__ = "0.1.0"


def source_digest() -> str:
    """A digest of lowbit's own source files: cache keys include it, so that results computed
    by other code (a changed quantizer, evaluator or simulator) are never read back."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]
