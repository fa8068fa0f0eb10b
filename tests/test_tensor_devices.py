"""Every tensor lowbit creates follows its input's device: a call of a torch factory
(``torch.zeros``, ``ones``, ``empty``, ``full``, ``arange``, ``tensor``, ``eye``, ``randn``, ...)
without ``device=`` is refused, unless its enclosing function is on the list below, which
says why a CPU tensor is right there.  (``*_like`` factories follow their argument and are
not checked.)  A cheap static check: a factory added to a GPU path without a device fails
here, before anyone runs it on a GPU."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "lowbit"

FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "eye", "randn", "rand",
             "randint", "randperm", "linspace", "logspace", "normal", "empty_strided", "sparse_coo_tensor"}

#: (path under src/lowbit, enclosing function) → why a CPU tensor is right
ALLOWED: dict[tuple[str, str], str] = {
    ("data/windows.py", "token_stream"): "token ids are built on the CPU; forward() moves each batch to the model",
    ("data/windows.py", "_with_bos"): "token ids (CPU), as above",
    ("data/windows.py", "calibration_windows"): "token ids (CPU) from a seeded CPU generator: the same windows "
                                                "on every device",
    ("numerics/formats.py", "_tables"): "value tables built once on the CPU; _tables_on() copies them per device",
    ("numerics/lessons.py", "synthetic_weight"): "`lowbit formats --error`: a seeded synthetic weight on the CPU",
    ("numerics/lessons.py", "_student_t"): "the same synthetic weight",
    ("quantization/algorithms/rotation.py", "random_hadamard"): "rotation matrices are built once on the CPU "
                                                                "(seeded) and moved to the weight's device",
    ("quantization/algorithms/rotation.py", "_paley"): "the Hadamard construction, as above",
    ("quantization/algorithms/rotation.py", "_sylvester"): "the Hadamard construction, as above",
    ("quantization/algorithms/awq.py", "_subsample"): "a seeded CPU generator (the same sample on every device); "
                                                      "the index is moved to the tensor's device",
    ("evaluation/workbench.py", "window_bytes"): "a 0-d tensor read for its element size only",
    ("models/loading.py", "model_bytes"): "a 0-d tensor read for its element size only",
    ("checkpoint/gguf.py", "rope_row_order"): "a row permutation for the file writer, which works on the CPU",
    ("data/chat.py", "chat_stream"): "token ids and their mask are built on the CPU, as token_stream's",
    ("engines/llama_cpp.py", "prepare"): "token ids (CPU) of the text llama.cpp is given",
    ("numerics/ggml_pack.py", "_k_scales"): "GGUF bytes are packed on the CPU for the file writer",
    ("numerics/ggml_pack.py", "pack"): "GGUF bytes are packed on the CPU for the file writer",
    ("planning/scores.py", "fisher_scores"): "per-candidate score sums of one window, read back as CPU floats",
    ("quantization/calibrate.py", "save"): "a token count written to the statistics file (CPU)",
}


def _calls_without_device(path: Path) -> list[tuple[str, int, str]]:
    """``(enclosing function, line, call)`` of every torch factory call without ``device=``."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in FACTORIES and isinstance(child.func.value, ast.Name)
                    and child.func.value.id == "torch"
                    and not any(k.arg == "device" for k in child.keywords)):
                found.append((name, child.lineno, ast.unparse(child)[:80]))
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_every_tensor_factory_names_a_device_or_is_justified():
    bad, used = [], set()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for func, line, call in _calls_without_device(path):
            if (rel, func) in ALLOWED:
                used.add((rel, func))
            else:
                bad.append(f"{rel}:{line} in {func}(): {call}")
    assert not bad, ("torch factories without device= (pass the input's device, or add the function to ALLOWED "
                     "with the reason):\n" + "\n".join(bad))
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED lists functions that no longer create CPU tensors: {stale}"


def test_the_check_finds_a_factory_without_a_device(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch\n\ndef g(x):\n    a = torch.zeros(3, device=x.device)\n"
                 "    return torch.arange(4) + a.sum()\n")
    assert [(fn, line) for fn, line, _ in _calls_without_device(f)] == [("g", 5)]
