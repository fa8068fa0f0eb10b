"""The ``code`` corpus: the running interpreter's standard library, deterministic file list."""

from __future__ import annotations

import pytest

from lowbit.data.windows import split_documents
from lowbit.models.assets import load_documents
from lowbit.models.pycode import STDLIB_EXCLUDED, stdlib_documents


def test_file_list_is_sorted_filtered_and_reproducible(tmp_path):
    root = tmp_path / "lib"
    for rel, text in {"b.py": "import os\n", "a.py": "x = 1\n", "pkg/__init__.py": "", "pkg/m.py": "def f(): pass\n",
                      "test/test_a.py": "assert 1\n", "pkg/tests/t.py": "assert 1\n", "site-packages/x.py": "y = 2\n",
                      "notes.txt": "not code", "blank.py": "  \n\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "latin.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))  # not UTF-8: left out
    docs = stdlib_documents(root)
    assert [d.id for d in docs] == ["a.py", "b.py", "pkg/m.py"]  # empty, excluded folders, non-.py, non-UTF-8 gone
    assert docs[2].text == "def f(): pass" and docs[2].title == "pkg/m.py"
    assert stdlib_documents(root) == docs
    with pytest.raises(FileNotFoundError, match="no standard library"):
        stdlib_documents(tmp_path / "missing")


def test_packaged_code_corpus_is_this_interpreters_stdlib():
    docs = load_documents("code")
    ids = [d.id for d in docs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert {"os.py", "json/decoder.py", "asyncio/base_events.py"} <= set(ids)
    assert not any(STDLIB_EXCLUDED.intersection(i.split("/")[:-1]) for i in ids)
    assert all(d.text and d.text == d.text.strip() for d in docs)
    import os
    assert next(d for d in docs if d.id == "os.py").text == open(os.__file__, encoding="utf-8").read().strip()
    test = split_documents(docs, "test")
    assert [d.id for d in test] == ids[4::5]
