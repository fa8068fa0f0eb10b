"""Parse every exported folder's quantization_config with the compressed-tensors installed
in *this* interpreter (run it from a throwaway venv holding another version).

    python scripts/ct_parse.py DIR [DIR ...]    # exit status 1 if any config is refused
"""

import json
import sys
from pathlib import Path

from compressed_tensors import __version__
from compressed_tensors.quantization import QuantizationConfig


def main(dirs: list[str]) -> int:
    bad = 0
    for d in dirs:
        qc = json.loads((Path(d) / "config.json").read_text())["quantization_config"]
        try:
            QuantizationConfig.model_validate(qc)
            print(f"compressed-tensors {__version__}: OK      {d}")
        except Exception as e:  # noqa: BLE001 - report every refusal, keep going
            bad += 1
            print(f"compressed-tensors {__version__}: REFUSED {d}: {str(e).splitlines()[0]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
