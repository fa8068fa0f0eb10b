"""`lowbit plan` input errors: each is one clear line, exit status 2, before any model is loaded
(the model name given does not exist, so loading it would fail differently)."""

import pytest

from lowbit.cli import main

NO_MODEL = "no-such-model-anywhere"


@pytest.mark.parametrize("extra, message", [
    (["--gpu", "h900"], "unknown GPU 'h900'; known: a100"),
    (["--gpu", "h100", "--recipes", "fp8-dynamic,fp9"], "unknown recipe 'fp9'"),
    (["--gpu", "h100", "--recipes", "fp8-dynamic+w4a16-gptq-g128"], "must be a KV-cache-only recipe"),
    (["--gpu", "h100", "--recipes", "kv-fp8-k"], "the simulator models 8-bit (FP8) or 16-bit KV caches"),
    (["--gpu", "h100", "--max-loss", "two"], "--max-loss: expected a perplexity increase in percent"),
    (["--gpu", "h100", "--max-loss=-1%"], "--max-loss"),
    (["--gpu", "h100", "--max-kl", "lots"], "--max-kl: expected a number"),
    (["--gpu", "h100", "--serve-as", "llama-9"], "unknown model 'llama-9'"),
    (["--gpu", "h100", "--prompt", "ten"], "expected N or LOW:HIGH"),
])
def test_bad_input_is_one_clear_error(extra, message, capsys):
    assert main(["plan", NO_MODEL, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowbit plan: error: ") and message in err and err.count("\n") == 1


def test_existing_outputs_are_refused_without_force(tmp_path, capsys):
    (tmp_path / "rep").mkdir()
    assert main(["plan", NO_MODEL, "--gpu", "h100", "--report", str(tmp_path / "rep")]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    (tmp_path / "p.json").write_text("{}")
    assert main(["plan", NO_MODEL, "--gpu", "h100", "--json", str(tmp_path / "p.json")]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
