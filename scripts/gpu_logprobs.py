"""Helper of scripts/gpu_check.sh: prompt-token log-probabilities from lowbit's reading of
an exported folder, and their comparison with vLLM's.

    python scripts/gpu_logprobs.py lowbit DIR PROMPTS.txt OUT.json
    python scripts/gpu_logprobs.py compare LOWBIT.json VLLM.json [--tol 0.1]

lowbit's side reads every weight back through compressed-tensors' decompressors
(``lowbit.models.loading.read_into``) and runs the model in fp32 without activation
quantization, so W8A8/W4A4 folders are expected to differ more than weight-only ones.
"""

import json
import sys

import torch


def lowbit_logprobs(folder: str, prompts_file: str, out: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lowbit.models.loading import read_into

    cfg = AutoConfig.from_pretrained(folder)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = read_into(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(), folder)
    tok = AutoTokenizer.from_pretrained(folder)
    rows = []
    for prompt in open(prompts_file).read().splitlines():
        if not prompt.strip():
            continue
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        rows.append({"prompt": prompt, "ids": ids[0].tolist(),
                     "logprobs": lp.gather(1, ids[0, 1:, None])[:, 0].tolist()})
    json.dump(rows, open(out, "w"))


def compare(ours_file: str, vllm_file: str, tol: float) -> int:
    ours, theirs = json.load(open(ours_file)), json.load(open(vllm_file))
    diffs = []
    for a, b in zip(ours, theirs):
        n = min(len(a["logprobs"]), len(b["logprobs"]))
        if a["ids"][:n + 1] != b["ids"][:n + 1]:
            print(f"token ids differ for prompt {a['prompt'][:40]!r}: tokenizers disagree")
            return 1
        diffs += [abs(x - y) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n])]
    mean = sum(diffs) / max(len(diffs), 1)
    print(f"{len(diffs)} prompt tokens: mean |Δ log p| {mean:.4f}, max {max(diffs, default=0):.4f} (tolerance {tol})")
    return 0 if mean <= tol else 1


if __name__ == "__main__":
    if sys.argv[1] == "lowbit":
        lowbit_logprobs(*sys.argv[2:5])
    else:
        tol = float(sys.argv[sys.argv.index("--tol") + 1]) if "--tol" in sys.argv else 0.1
        sys.exit(compare(sys.argv[2], sys.argv[3], tol))
