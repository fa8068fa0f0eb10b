"""--calib-corpus and --loss-on reach the workbench from every command that calibrates."""

from __future__ import annotations

import pytest
import torch

from lowbit.cli import build_parser, main
from lowbit.evaluation.workbench import Workbench
from lowbit.models.loading import ModelInfo


class _Stop(Exception):
    pass


@pytest.mark.parametrize("argv", [
    ["compare", "smollm2-135m", "--recipes", "w4a16-gptq-g128"],
    ["eval", "smollm2-135m", "--recipe", "w4a16-gptq-g128"],
    ["plan", "smollm2-135m", "--gpu", "h100", "--recipes", "w4a16-int4-g128"],
    ["search", "smollm2-135m", "--budget-bits", "4.5", "--candidates", "nvfp4"],
])
def test_the_flags_reach_workbench_load(monkeypatch, argv):
    seen = {}

    def load(model, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr(Workbench, "load", load)
    with pytest.raises(_Stop):
        main(argv + ["--corpus", "chats.jsonl", "--calib-corpus", "wiki+code", "--loss-on", "assistant"])
    assert seen["corpus"] == "chats.jsonl" and seen["calib_corpus"] == "wiki+code" and seen["loss_on"] == "assistant"
    with pytest.raises(_Stop):
        main(argv)
    assert seen["corpus"] == "wiki" and seen["calib_corpus"] is None and seen["loss_on"] == "all"  # as before


def test_quantize_passes_the_calibration_corpus(monkeypatch, tmp_path):
    import lowbit.workflows as wf

    seen = {}

    def fake(model, recipe, out, options, **kw):
        seen.update(vars(options), **kw)
        raise _Stop

    monkeypatch.setattr(wf, "quantize_to_folder", fake)
    monkeypatch.setattr(wf, "quantize_streaming", fake)
    with pytest.raises(_Stop):
        main(["quantize", "smollm2-135m", "--recipe", "w4a16-gptq-g128", "--out", str(tmp_path / "o"),
              "--calib-corpus", "code", "--loss-on", "assistant"])
    assert seen["calib_corpus"] == "code" and seen["corpus"] == "wiki" and seen["loss_on"] == "assistant"
    seen.clear()
    with pytest.raises(_Stop):
        main(["quantize", "smollm2-135m", "--recipe", "w4a16-gptq-g128", "--out", str(tmp_path / "o"),
              "--calib-corpus", "code", "--low-memory", "--no-eval"])
    assert seen["calib_corpus"] == "code" and "loss_on" not in seen  # the streaming path only calibrates


def test_loss_on_is_checked(tiny_llama, tmp_path, byte_bpe_tokenizer):
    from transformers import PreTrainedTokenizerFast

    text = tmp_path / "prose"
    text.mkdir()
    for i in range(5):
        (text / f"{i}.txt").write_text(f"Plain prose number {i} with no conversation in it at all. " * 40)
    tok = PreTrainedTokenizerFast(tokenizer_object=byte_bpe_tokenizer([(text / "0.txt").read_text()]),
                                  eos_token="</s>")
    loader = lambda name, cache=None: (tiny_llama, tok, ModelInfo("tiny", tmp_path, False, ""))  # noqa: E731
    kw = dict(corpus=str(text), windows=2, seq_len=8, calib_windows=0, cache=tmp_path, loader=loader, progress=False)
    with pytest.raises(ValueError, match="conversations"):
        Workbench.load("tiny", loss_on="assistant", **kw)
    with pytest.raises(ValueError, match="loss_on must be one of all, assistant"):
        Workbench.load("tiny", loss_on="user", **kw)
    bench = Workbench.load("tiny", calib_corpus=str(text), **{**kw, "calib_windows": 2})
    assert bench.loss_mask is None and bench.calib_windows.shape == (2, 8) and bench.windows.dtype == torch.int64
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compare", "--loss-on", "user"])


def test_assets_list_names_the_code_corpus(capsys):
    assert main(["assets", "list"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("code "))
    assert "built in" in line and "standard library" in line
