"""``lowbit verify FILE.gguf --engine llama.cpp``: the parts that need no llama.cpp build (the log
parser, the logits-file header, the refusal when the build is absent) run always; the end-to-end
checks on SmolLM2 run in the ``llamacpp`` tier, skipped with the reason when ``make llama-cpp``
has not been run."""

import json

import numpy as np
import pytest
import torch

from lowbit.engines import llama_cpp as L

KLD_LOG = """
kl_divergence: computing over 4 chunks, n_ctx=256, batch_size=256, n_seq=1
====== Perplexity statistics ======
Mean PPL(Q)                   :  17.512345 ±   0.812345
Mean PPL(base)                :  15.040000 ±   0.700000
Cor(ln(PPL(Q)), ln(PPL(base))):  97.12%
Mean ln(PPL(Q)/PPL(base))     :   0.152345 ±   0.010000

====== KL divergence statistics ======
Mean    KLD:   0.274450 ±   0.004000
Maximum KLD:   5.000000

====== Token probability statistics ======
RMS Δp    : 12.345 ± 0.321 %
Same top p: 73.410 ± 0.870 %
"""


def test_parse_kl_divergence_log():
    f = L.parse_perplexity(KLD_LOG)
    assert f["ppl"] == 17.512345 and f["ppl_err"] == 0.812345 and f["ppl_base"] == 15.04
    assert f["kld"] == 0.27445 and f["same_top_p"] == 73.41 and f["rms_dp"] == 12.345
    assert f["chunks"] == 4 and f["n_ctx"] == 256


def test_parse_base_log_and_garbage():
    f = L.parse_perplexity("perplexity: calculating perplexity over 8 chunks, n_ctx=512, batch_size=512, n_seq=1\n"
                           "[1]15.1,[2]15.3\nFinal estimate: PPL = 15.0412 +/- 0.61234\n")
    assert f["ppl"] == 15.0412 and f["chunks"] == 8 and "kld" not in f
    with pytest.raises(RuntimeError, match="no perplexity"):
        L.parse_perplexity("error: failed to load model\n")


@pytest.mark.parametrize("first_rc, calls", [(-11, 2), (0, 1), (1, 1)])
def test_a_crashed_run_is_repeated_once_without_repacking(tmp_path, monkeypatch, first_rc, calls):
    """llama.cpp's repacked CPU kernels crash (SIGSEGV) on some machines (AMX CPUs in a 2-vCPU VM): a run
    killed by a signal is repeated once with ``--no-repack``, and the log's command line says so; an
    ordinary failure is not repeated."""
    import subprocess
    from types import SimpleNamespace

    seen = []

    def run(cmd, **kw):
        seen.append(list(cmd))
        rc = first_rc if len(seen) == 1 else 0
        return SimpleNamespace(returncode=rc, stdout="Final estimate: PPL = 15.0 +/- 0.5\n" if rc == 0 else "",
                               stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(L, "find_llama_cpp", lambda: tmp_path / "llama-perplexity")
    log = tmp_path / "run.log"
    args = (tmp_path / "m.gguf", tmp_path / "t.txt", 256, 4, tmp_path / "b.kld")
    if first_rc > 0:
        with pytest.raises(RuntimeError, match="exit 1"):
            L._run_perplexity(*args, write_base=True, threads=2, log_path=log)
    else:
        assert L._run_perplexity(*args, write_base=True, threads=2, log_path=log).figures["ppl"] == 15.0
    assert len(seen) == calls
    assert ("--no-repack" in seen[-1]) == (calls == 2) == ("--no-repack" in log.read_text().splitlines()[0])
    assert "--no-repack" not in seen[0]


def test_base_tokens_header(tmp_path):
    toks = np.arange(2 * 8, dtype=np.int32)
    p = tmp_path / "base.kld"
    p.write_bytes(b"_logits_" + np.array([8, 49152, 2], dtype=np.int32).tobytes() + toks.tobytes() + b"\0" * 64)
    assert torch.equal(L.base_tokens(p, 8), torch.arange(16).reshape(2, 8))
    with pytest.raises(ValueError, match="n_ctx=8"):
        L.base_tokens(p, 64)
    p.write_bytes(b"_logits_" + np.array([8, 49152, 9], dtype=np.int32).tobytes() + toks.tobytes())
    with pytest.raises(ValueError, match="truncated"):
        L.base_tokens(p, 8)
    p.write_bytes(b"garbage!" + toks.tobytes())
    with pytest.raises(ValueError, match="_logits_"):
        L.base_tokens(p, 8)


def test_base_logprobs_decode_llama_cpps_rows(tmp_path):
    """Rows of fp32 scale, fp32 min and n_vocab uint16 codes (padded to even), ctx−1−ctx//2 rows per chunk."""
    ctx, n_vocab, n_chunk = 8, 5, 2
    rows, nv = ctx - 1 - ctx // 2, 2 * ((n_vocab + 1) // 2) + 4
    rng = np.random.default_rng(0)
    want, body = [], b""
    for _ in range(n_chunk):
        codes = rng.integers(0, 65536, size=(rows, n_vocab), dtype=np.uint16)
        scale, mn = np.float32(16 / 65535), np.float32(-20.0)
        raw = np.zeros((rows, nv), dtype=np.uint16)
        raw[:, :4] = np.array([scale, mn], dtype=np.float32).view(np.uint16)
        raw[:, 4:4 + n_vocab] = codes
        body += raw.tobytes()
        want.append(float(mn) + float(scale) * codes.astype(np.float64))
    p = tmp_path / "base.kld"
    p.write_bytes(b"_logits_" + np.array([ctx, n_vocab, n_chunk], dtype=np.int32).tobytes()
                  + np.zeros(n_chunk * ctx, dtype=np.int32).tobytes() + body)
    got = list(L.base_logprobs(p, ctx))
    assert len(got) == n_chunk and got[0].shape == (rows, n_vocab)
    for g, w in zip(got, want):
        assert torch.allclose(g, torch.from_numpy(w), atol=1e-9)


def test_aligned_share_costs_one_token_per_merge():
    """llama.cpp merging two tokens into one (its ``\\n\\n``) costs that token, not the rest of the stream."""
    hf = torch.arange(100)
    engine = torch.cat([hf[:10], torch.tensor([999]), hf[12:100]])      # tokens 10, 11 merged into one
    assert (engine == hf[: engine.numel()]).double().mean() < 0.2         # position by position: shifted
    assert L.aligned_share(engine, hf) == pytest.approx(98 / 99)
    assert L.aligned_share(hf, hf) == 1.0


def test_missing_build_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWBIT_LLAMA_CPP", str(tmp_path))
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(L, "_REPO_BUILD", tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="make llama-cpp"):
        L.find_llama_cpp()


def _tool(d, name="llama-perplexity"):
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text("#!/bin/sh\n")
    (d / name).chmod(0o755)
    return d / name


def test_search_order_env_then_machine_cache_then_checkout(monkeypatch, tmp_path):
    """$LOWBIT_LLAMA_CPP first, then the per-machine cache ``make llama-cpp`` builds into, then the
    checkout's build folder; a file that is not executable does not count."""
    env, checkout = tmp_path / "env", tmp_path / "checkout"
    cached = tmp_path / "cache" / "llama.cpp" / L.VERSION / "bin"
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(L, "_REPO_BUILD", checkout)
    monkeypatch.delenv("LOWBIT_LLAMA_CPP", raising=False)
    assert L.llama_cpp_dirs() == [cached, checkout]
    made = _tool(checkout)
    assert L.find_llama_cpp() == made
    made = _tool(cached)
    assert L.find_llama_cpp() == made
    monkeypatch.setenv("LOWBIT_LLAMA_CPP", str(env))
    assert L.llama_cpp_dirs() == [env, cached, checkout]
    assert L.find_llama_cpp() == cached / "llama-perplexity"  # the variable's folder lacks the tool
    env.mkdir()
    (env / "llama-perplexity").write_text("not executable")
    assert L.find_llama_cpp() == cached / "llama-perplexity"
    made = _tool(env)
    assert L.find_llama_cpp() == made


def test_makefile_builds_the_version_looked_for():
    from pathlib import Path

    make = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert f"LLAMA_VERSION := {L.VERSION}\n" in make
    assert "$(HOME)/.cache/lowbit)/llama.cpp/$(LLAMA_VERSION)" in make
    ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    assert ci.index("make llama-cpp") < ci.index("make test")


def _have_build() -> bool:
    try:
        L.find_llama_cpp()
        L.find_llama_cpp("llama-quantize")
        return True
    except FileNotFoundError:
        return False


@pytest.mark.llamacpp
@pytest.mark.skipif(not _have_build(), reason="llama.cpp is not built: run `make llama-cpp` (about 8.5 min on 2 cores)")
def test_q4_0_and_q4_k_files_end_to_end(tmp_path):
    """lowbit writes SmolLM2 as Q4_0 and Q4_K; llama.cpp loads and scores both on 4 chunks of 256,
    against its F32 run of the same weights, beside lowbit's prediction.

    Asserted: what was measured (benchmarks/RESULTS.md, 8 × 512, the prediction modelling
    llama.cpp's 8-bit activation blocks: PPL within 0.25% / 0.09%, KLD within 0.3% / 2%; token by
    token KL(llama.cpp ‖ lowbit) 3.8e-3 / 5.1e-3, the level float noise alone reaches through that
    rounding). The issue's target — |ΔPPL| within twice the F32 noise floor — is missed and cannot
    be met by a reimplementation (RESULTS: 1e-7 relative noise before the rounding gives KL 4e-3);
    ``ppl_ok`` is reported, not asserted."""
    from lowbit.workflows.gguf import quantize_to_gguf

    files = [quantize_to_gguf("smollm2-135m", r, tmp_path / f"{r}.gguf", evaluate=False, progress=False).path
             for r in ("gguf-q4_0", "gguf-q4_k")]
    res = L.verify_gguf(files, ctx=256, chunks=4, cache=None)
    print("smollm2-135m:", json.dumps(res.to_dict()))  # the figures, for the log (pytest -s)
    n = res.noise
    assert n["tokens_as_transformers"] > 0.99
    assert n["kl_engine_f32_vs_lowbit"] < 1e-3 and n["same_top_engine_f32_vs_lowbit"] > 0.99
    assert abs(n["engine_ppl"] / n["lowbit_ppl"] - 1) < 1e-4            # the floor: F32 in llama.cpp = fp32 here
    for c in res.checks:
        assert abs(c.delta_ppl) / c.lowbit["ppl"] < 0.02, (c.file, c.delta_ppl)
        assert c.engine["kld"] == pytest.approx(c.lowbit["kl"], rel=0.15)
        assert c.engine["same_top_p"] / 100 == pytest.approx(c.lowbit["same_top"], abs=0.03)
        w = c.lowbit["weights_only"]
        assert c.lowbit["ppl"] != w["ppl"]  # the activation rounding is in the prediction
        # token by token against llama.cpp's own log-probabilities of the file: at the level of the
        # rounding noise (~4e-3 at 8 x 512), far below the file's own KL from the reference
        for v in (c.lowbit["vs_engine"], w["vs_engine"]):
            assert v["kl"] < 0.25 * c.engine["kld"] and v["same_top"] > 0.9, (c.file, v)


def test_report_shows_the_weights_only_prediction_beside():
    """The table and the one-line summary carry the activation-modelled prediction and the
    weights-only one; a check without the latter (``predict=False``) renders a dash."""
    from rich.console import Console

    from lowbit.report import verify as render

    pred = {"ppl": 16.4001, "kl": 0.2680, "same_top": 0.7461, "tokens": 2040, "vs_engine": {"kl": 4.2e-4, "same_top": 0.99},
            "weights_only": {"ppl": 16.4025, "kl": 0.2671, "same_top": 0.7466, "tokens": 2040,
                             "vs_engine": {"kl": 3.1e-3, "same_top": 0.97}}}
    checks = [L.GGUFCheck("/x/a.gguf", {"ppl": 16.379, "kld": 0.2687, "same_top_p": 74.61}, pred, -0.0211, 3e-5, 47.0,
                          91726144),
              L.GGUFCheck("/x/b.gguf", {"ppl": 16.0, "kld": 0.1, "same_top_p": 80.0},
                          {"ppl": float("nan"), "kl": None, "same_top": None, "tokens": 0}, float("nan"), 3e-5, 40.0, 1)]
    v = L.GGUFVerification("smollm2-135m", "wiki", 512, 8, 2040,
                           {"engine_ppl": 13.999, "lowbit_ppl": 13.99899, "delta_ppl": 1.4e-5,
                            "kl_engine_f32_vs_lowbit": 3.5e-7, "same_top_engine_f32_vs_lowbit": 0.9995,
                            "engine_seconds": 63.0}, checks)
    line = render.gguf_check_line(checks[0])
    assert "lowbit 16.4001" in line and "weights only: PPL 16.4025, KLD 0.2671" in line
    assert "KL(llama.cpp ‖ lowbit) 4.20e-04 (weights only 3.10e-03)" in line
    assert "target ≤ 3e-05: MISS" in line  # a floor of ~1e-5 is printed, not rounded to 0.0000
    console = Console(width=400, record=True)
    console.print(render.gguf_table(v))
    text = console.export_text()
    assert "16.4025 / 0.2671" in text and "8-bit activation blocks" in text and "4.20e-04 / 3.10e-03" in text
    assert "weights only" not in render.gguf_check_line(checks[1])


def test_predict_pairs_scores_each_source_once_per_chunk(tiny_llama):
    """One forward per model (and per activation-rounded model) per chunk, every pair scored from
    them: a model against its own stored log-probabilities has KL 0; against itself with
    llama.cpp's 8-bit activations, KL > 0; the one-pair helper gives the same numbers."""
    m = tiny_llama
    chunks = torch.randint(0, m.config.vocab_size, (3, 32), generator=torch.Generator().manual_seed(2))
    types = {n: "q8_0" for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}
    calls = []
    h = m.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(1), with_kwargs=True)
    with torch.no_grad():
        own = [torch.log_softmax(m(c[None]).logits[0, 16:-1].double(), -1) for c in chunks]
    calls.clear()
    preds = L._predict_pairs({"w": m, "act": (m, types), "stored": own},
                             [("w", None), ("act", "w"), ("w", "stored"), ("act", "stored")], chunks)
    h.remove()
    assert len(calls) == 2 * len(chunks)  # "w" and "act" once per chunk each, whatever the pairs
    plain, act_vs_w, w_vs_stored, act_vs_stored = preds
    assert plain.kl is None and plain.tokens == 3 * 15
    assert w_vs_stored.kl == pytest.approx(0, abs=1e-12) and w_vs_stored.same_top == 1.0
    assert w_vs_stored.ppl == pytest.approx(plain.ppl, rel=1e-12)
    assert act_vs_w.kl > 1e-7 and act_vs_stored.kl == pytest.approx(act_vs_w.kl, rel=1e-6)
    one = L._predict(m, None, chunks)
    assert one.ppl == pytest.approx(plain.ppl, rel=1e-12)
