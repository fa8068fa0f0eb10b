"""``--device`` / ``--dtype`` on every command that runs a model: an absent GPU and unknown
names are one-line errors (exit 2) before anything is loaded."""

import pytest
import torch

from lowbit.cli import build_parser, main

COMMANDS = {
    "compare": ["compare", "smollm2-135m"],
    "eval": ["eval", "smollm2-135m"],
    "kv-stats": ["kv-stats", "smollm2-135m"],
    "quantize": ["quantize", "smollm2-135m", "--recipe", "fp8-dynamic", "--out", "{tmp}/out"],
    "plan": ["plan", "smollm2-135m", "--gpu", "h100"],
    "verify": ["verify", "{tmp}"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_cuda_without_a_gpu_is_refused(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = [a.format(tmp=tmp_path) for a in COMMANDS[command]] + ["--device", "cuda"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"lowbit {command}: error: device 'cuda': torch" in err and "sees no CUDA GPU" in err


@pytest.mark.parametrize("command", ["compare", "eval", "kv-stats", "quantize", "plan"])
def test_every_model_command_has_device_dtype_and_batch(command):
    p = build_parser()
    argv = [a.format(tmp="/tmp") for a in COMMANDS[command]] + ["--device", "auto", "--dtype", "bf16", "--batch", "4"]
    args = p.parse_args(argv)
    assert (args.device, args.dtype, args.batch) == ("auto", "bf16", 4)
    defaults = p.parse_args([a.format(tmp="/tmp") for a in COMMANDS[command]])
    assert (defaults.device, defaults.dtype, defaults.batch) == ("cpu", "fp32", None)


def test_verify_takes_a_device_but_not_a_dtype():
    p = build_parser()
    assert p.parse_args(["verify", "d", "--device", "cuda:1"]).device == "cuda:1"
    with pytest.raises(SystemExit):
        p.parse_args(["verify", "d", "--dtype", "bf16"])


def test_bad_dtype_and_batch_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "smollm2-135m", "--dtype", "fp64"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["eval", "smollm2-135m", "--batch", "0"])
    assert "expected a positive integer" in capsys.readouterr().err


def test_fp16_is_refused_for_a_model_that_overflows_it():
    """Gemma-3 gives NaN logits in fp16 (measured on gemma3-270m): refused by name; a Llama is not."""
    from lowbit.models.loading import _check_dtype

    class Cfg:
        model_type = "gemma3_text"

    with pytest.raises(ValueError, match="gemma3_text models overflow fp16"):
        _check_dtype(Cfg(), torch.float16, "gemma3-270m")
    Cfg.model_type = "llama"
    _check_dtype(Cfg(), torch.float16, "x")
