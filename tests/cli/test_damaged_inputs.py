"""Damaged inputs (issue 20): each is one clear line on stderr, exit status 2, and no output
folder (nor a temporary one beside it).  ``lowbit quantize`` runs in-process on a tiny
model folder; a full disk is a real 1 MiB tmpfs where this runs as root, else a simulated
``ENOSPC``."""

import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.cli import main


def _quantize(tmp_path, model, *, recipe="w8a8-int8-static", corpus=None, out=None, cache=None, extra=()):
    out = out or tmp_path / "out"
    args = ["quantize", str(model), "--recipe", str(recipe), "--out", str(out), "--calib-windows", "2",
            "--windows", "2", "--cache", str(cache or tmp_path / "cache"), *extra]
    if corpus is not None:
        args += ["--corpus", str(corpus)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    lines = [line for line in err.getvalue().splitlines() if "lowbit quantize: error:" in line]
    return code, lines, out


def _refused(tmp_path, *a, expect: str, **k) -> str:
    code, lines, out = _quantize(tmp_path, *a, **k)
    assert code == 2 and len(lines) == 1, lines
    assert expect in lines[0], lines[0]
    assert "\n" not in lines[0]
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*")), "something was written"
    return lines[0]


@pytest.fixture
def model_copy(tiny_folder, tmp_path):
    def copy(name="m"):
        return Path(shutil.copytree(tiny_folder[0], tmp_path / name))

    return copy


def _edit_weights(folder: Path, fn) -> None:
    sd = load_file(str(folder / "model.safetensors"))
    fn(sd)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_truncated_safetensors(model_copy, tiny_folder, tmp_path):
    m = model_copy()
    raw = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(raw[: len(raw) * 2 // 3])
    _refused(tmp_path, m, corpus=tiny_folder[1], expect="not a complete safetensors file")


def test_config_with_a_wrong_shape(model_copy, tiny_folder, tmp_path):
    m = model_copy()
    cfg = json.loads((m / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (m / "config.json").write_text(json.dumps(cfg))
    _refused(tmp_path, m, corpus=tiny_folder[1], expect="has shape [128, 64] but config.json implies [96, 64]")


def test_pickle_checkpoint_is_refused_never_unpickled(model_copy, tiny_folder, tmp_path, monkeypatch):
    m = model_copy()
    sd = load_file(str(m / "model.safetensors"))
    (m / "model.safetensors").unlink()
    torch.save(sd, m / "pytorch_model.bin")
    import pickle

    def no_unpickling(*a, **k):
        raise AssertionError("a pickle was opened")

    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "Unpickler", no_unpickling)
    _refused(tmp_path, m, corpus=tiny_folder[1], expect="only pickle checkpoints (pytorch_model.bin)")


def _tiny_gguf(path: Path, byte_bpe_tokenizer) -> Path:
    spec = importlib.util.spec_from_file_location("_assets_tests", Path(__file__).parents[1] / "models" / "test_assets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod._write_tiny_gguf(path, byte_bpe_tokenizer(["the cat sat on the mat.\n\nA dog ran far, and the cat sat."] * 3))
    return path


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.97])
def test_truncated_gguf(tmp_path, byte_bpe_tokenizer, keep):
    g = _tiny_gguf(tmp_path / "full.gguf", byte_bpe_tokenizer)
    raw = g.read_bytes()
    t = tmp_path / "cut.gguf"
    t.write_bytes(raw[: int(len(raw) * keep)])
    _refused(tmp_path, t, recipe="w8a16-int8", extra=["--no-eval"], expect="GGUF file")
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_recipe_rule_matching_no_module(tiny_folder, tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text("weights: int8-channel\nrules:\n  - targets: ['*.mlp.fc9']\n    weights: int4-g128\n")
    _refused(tmp_path, tiny_folder[0], recipe=r, corpus=tiny_folder[1],
             expect="the rule for targets ['*.mlp.fc9'] matches no Linear")


@pytest.mark.parametrize("kind", ["empty-file", "empty-folder", "binary", "bad-jsonl"])
def test_corpus_empty_or_not_text(tiny_folder, tmp_path, kind):
    if kind == "empty-file":
        c = tmp_path / "c.txt"
        c.write_text("")
        expect = "no text"
    elif kind == "empty-folder":
        c = tmp_path / "c"
        c.mkdir()
        for i in range(5):
            (c / f"{i}.txt").write_text("  \n")
        expect = "no text"
    elif kind == "binary":
        c = tmp_path / "c.txt"
        c.write_bytes(bytes(range(128, 256)) * 20)
        expect = "not UTF-8 text"
    else:
        c = tmp_path / "c.jsonl"
        c.write_bytes(b'{"id": 1, "title": "a", "text": "b"}\n\x89PNG\r\n')
        expect = "not a JSON-lines file"
    _refused(tmp_path, tiny_folder[0], corpus=c, expect=expect)


@pytest.mark.parametrize("where", ["nan", "inf", "-inf"])
def test_non_finite_weights(model_copy, tiny_folder, tmp_path, where):
    m = model_copy()
    _edit_weights(m, lambda sd: sd["model.layers.1.mlp.down_proj.weight"].__setitem__((3, 5), float(where)))
    _refused(tmp_path, m, corpus=tiny_folder[1], expect="model.layers.1.mlp.down_proj: quantize: 1 of 8192 elements")


@contextlib.contextmanager
def _full_disk(tmp_path: Path, real: bool):
    """A 1 MiB tmpfs with 40 KiB free (``real``, root only), or None."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if not real or os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        yield None
        return
    try:
        with open(mnt / "filler", "wb") as fh:
            fh.write(b"\0" * (1024 * 1024 - 40 * 1024))
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("real", [True, False], ids=["tmpfs", "simulated"])
@pytest.mark.parametrize("what", ["output", "cache"])
def test_disk_full_during_a_write(tiny_folder, tmp_path, monkeypatch, what, real):
    with _full_disk(tmp_path, real) as mnt:
        if mnt is None:  # simulate: every write of a tensor file runs out of space
            from safetensors import SafetensorError

            def enospc(tensors, filename, metadata=None):  # what safetensors raises on a full disk
                Path(filename).write_bytes(b"\0" * 10)
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

            import safetensors.torch

            monkeypatch.setattr(safetensors.torch, "save_file", enospc)
            mnt = tmp_path / "sim"
            mnt.mkdir()
        out = mnt / "out" if what == "output" else tmp_path / "out"
        cache = mnt / "cache" if what == "cache" else tmp_path / "cache"
        line = _refused(tmp_path, tiny_folder[0], corpus=tiny_folder[1], out=out, cache=cache, expect="no space left")
        assert "nothing was written" in line
        left = [p for p in mnt.rglob("*") if p.is_file() and p.name != "filler"]
        assert not [p.name for p in left if p.name.startswith(".")], "temporary files left on the full disk"
        from lowbit.util.io import load_tensors

        for p in left:  # cache entries that fitted before the disk filled: complete ones only
            load_tensors(p)
