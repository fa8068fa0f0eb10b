"""Split, token stream, evaluation and calibration windows: the protocol, property by property."""

from __future__ import annotations

import pytest
import torch

from lowbit.data import windows as data
from lowbit.models.assets import Document
from lowbit.data.windows import calibration_windows, eval_windows, split_documents, token_stream, windows_for


def _docs(n: int) -> list[Document]:
    return [Document(f"{i:03d}", f"t{i}", f"Document number {i}. The cat sat on the mat.")
            for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer(byte_bpe_tokenizer):
    from transformers import PreTrainedTokenizerFast

    # Prepends BOS by default, so the tests see that token_stream asks for no special tokens.
    tok = byte_bpe_tokenizer(["Document number 1. The cat sat on the mat.\n\n"] * 4, add_bos=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def test_split_is_every_fifth_document():
    docs = _docs(23)
    test, train = split_documents(docs, "test"), split_documents(docs, "train")
    assert [d.id for d in test] == ["004", "009", "014", "019"]
    assert len(train) == 19 and not set(test) & set(train)
    assert sorted(test + train, key=lambda d: d.id) == docs
    assert split_documents(docs, "test") == test  # deterministic
    with pytest.raises(ValueError, match="'train' or 'test'"):
        split_documents(docs, "validation")


def test_token_stream_joins_and_adds_no_special_tokens(tokenizer):
    docs = _docs(3)
    stream = token_stream(tokenizer, docs)
    expected = tokenizer("\n\n".join(d.text for d in docs), add_special_tokens=False)["input_ids"]
    assert stream.dtype == torch.int64 and stream.ndim == 1
    assert stream.tolist() == expected and tokenizer.bos_token_id not in stream.tolist()
    assert tokenizer.decode(stream) == "\n\n".join(d.text for d in docs)


def test_eval_windows_are_consecutive_and_drop_the_partial_one():
    tokens = torch.arange(10, 1010)
    windows = eval_windows(tokens, seq_len=64)
    assert windows.shape == (15, 64) and windows.dtype == torch.int64
    assert torch.equal(windows.flatten(), tokens[: 15 * 64])
    assert torch.equal(eval_windows(tokens, seq_len=64, n_windows=3), windows[:3])


def test_eval_windows_with_bos_keep_seq_len():
    tokens = torch.arange(10, 1010)
    windows = eval_windows(tokens, seq_len=64, bos_token_id=1)
    assert windows.shape == (15, 64)  # 1000 // 63 = 15
    assert (windows[:, 0] == 1).all()
    assert torch.equal(windows[:, 1:].flatten(), tokens[: 15 * 63])


def test_eval_windows_too_many_says_how_many_exist():
    with pytest.raises(ValueError, match="only 15 exist"):
        eval_windows(torch.arange(1000), seq_len=64, n_windows=16)
    with pytest.raises(ValueError, match="no room"):
        eval_windows(torch.arange(1000), seq_len=1, bos_token_id=0)


def test_calibration_windows_are_seeded_slices():
    tokens = torch.arange(5000)
    a = calibration_windows(tokens, n=16, seq_len=32, seed=0)
    assert a.shape == (16, 32) and a.dtype == torch.int64
    assert torch.equal(a, calibration_windows(tokens, n=16, seq_len=32, seed=0))
    assert not torch.equal(a, calibration_windows(tokens, n=16, seq_len=32, seed=1))
    # Each window is the contiguous slice at the start drawn from the documented generator.
    starts = torch.randint(0, 5000 - 32 + 1, (16,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(a[:, 0], starts)
    assert torch.equal(a, a[:, :1] + torch.arange(32))


def test_calibration_windows_with_bos_and_edges():
    tokens = torch.arange(100, 200)
    b = calibration_windows(tokens, n=500, seq_len=100, bos_token_id=7)
    assert (b[:, 0] == 7).all() and set(b[:, 1].tolist()) == {100, 101}  # both valid starts drawn
    with pytest.raises(ValueError, match="cannot fill one window"):
        calibration_windows(tokens, n=1, seq_len=101)


def test_windows_for_caches_the_token_stream(tokenizer, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for d in _docs(10):
        (corpus / f"{d.id}.txt").write_text(d.text * 20)
    cache = tmp_path / "cache"
    windows = windows_for(tokenizer, str(corpus), "test", seq_len=16, cache=cache)
    docs = [d for d in data.load_documents(str(corpus)) if d.id in ("004.txt", "009.txt")]
    assert torch.equal(windows, eval_windows(token_stream(tokenizer, docs), 16))
    cached = list((cache / "tokens").glob("*-test-*.safetensors"))
    assert len(cached) == 1

    expected = eval_windows(token_stream(tokenizer, docs), 16, 2, bos_token_id=1)
    monkeypatch.setattr(data, "token_stream", lambda *a: pytest.fail("retokenized"))
    again = windows_for(tokenizer, str(corpus), "test", seq_len=16, n_windows=2, bos_token_id=1,
                        cache=cache)
    assert torch.equal(again, expected)
    monkeypatch.undo()

    (corpus / "009.txt").write_text("Changed text. " * 40)
    windows_for(tokenizer, str(corpus), "test", seq_len=16, cache=cache)
    assert len(list((cache / "tokens").glob("*-test-*.safetensors"))) == 2


def test_tokenizer_fingerprint_tracks_the_tokenizer(tokenizer):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    copy = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    other = PreTrainedTokenizerFast(tokenizer_object=copy, bos_token="<s>")
    assert data.tokenizer_fingerprint(other) == data.tokenizer_fingerprint(tokenizer)
    other.backend_tokenizer.post_processor = None
    assert data.tokenizer_fingerprint(other) != data.tokenizer_fingerprint(tokenizer)


def _corpus(root, name: str, text: str, n: int = 10):
    folder = root / name
    folder.mkdir()
    for i in range(n):
        (folder / f"{i:03d}.txt").write_text(f"{text} {i}. " * 30)
    return str(folder)


def test_calibration_for_one_corpus_is_the_old_calibration(tokenizer, tmp_path):
    a = _corpus(tmp_path, "a", "The cat sat on the mat")
    cache = tmp_path / "cache"
    got = data.calibration_for(tokenizer, a, 6, 16, seed=3, cache=cache)
    expected = calibration_windows(data.stream_for(tokenizer, a, "train", cache=cache), 6, 16, 3)
    assert torch.equal(got, expected)


def test_calibration_mixture_takes_equal_parts_in_order(tokenizer, tmp_path):
    a = _corpus(tmp_path, "a", "The cat sat on the mat")
    b = _corpus(tmp_path, "b", "Document number one")
    cache = tmp_path / "cache"
    mix = data.calibration_for(tokenizer, f"{a}+{b}", 5, 16, seed=0, bos_token_id=1, cache=cache)
    assert mix.shape == (5, 16) and (mix[:, 0] == 1).all()
    assert torch.equal(mix[:3], data.calibration_for(tokenizer, a, 3, 16, seed=0, bos_token_id=1, cache=cache))
    assert torch.equal(mix[3:], data.calibration_for(tokenizer, b, 2, 16, seed=0, bos_token_id=1, cache=cache))
    assert data.corpus_parts("wiki+brown+code") == ["wiki", "brown", "code"]
    plus = tmp_path / "c+d.txt"
    plus.write_text("a file whose name has a plus")
    assert data.corpus_parts(str(plus)) == [str(plus)]  # an existing path is one corpus
    with pytest.raises(ValueError, match="empty part"):
        data.corpus_parts("wiki+")
