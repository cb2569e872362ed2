"""Give a training kit's models (python -m sglang_ddtree_tools.trainkit) a tokenizer, so they serve text as a real model does.

The kit's models speak a synthetic vocabulary of token ids and ship no tokenizer; SGLang then needs
--skip-tokenizer-init and ids-only requests, and sglang-router finds no tokenizer at registration. For the GPU lab,
where `fab deploy` serves the kit through the real unit, router and gate, each model folder gets a word-level
tokenizer over that vocabulary: token i is the word `t<i>` (0 `<unk>`, 1 `<s>`, 2 `</s>`, the kit's special ids), so
any text encodes (unknown words to <unk>) and every generated id decodes.

    python3 benchmarks/h200/kit_tokenizer.py MODEL_DIR...      (needs the `tokenizers` package)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIAL = {0: "<unk>", 1: "<s>", 2: "</s>"}


def words(vocab_size: int) -> dict[str, int]:
    return {SPECIAL.get(i, f"t{i}"): i for i in range(vocab_size)}


def write(model_dir: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    cfg = json.loads((model_dir / "config.json").read_text())
    n = int(cfg["vocab_size"])
    tok = Tokenizer(models.WordLevel(words(n), unk_token=SPECIAL[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": SPECIAL[0], "bos_token": SPECIAL[1],
        "eos_token": SPECIAL[2], "model_max_length": 32768, "clean_up_tokenization_spaces": False}, indent=1) + "\n")
    return n


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    for d in argv:
        print(f"{d}: tokenizer over {write(Path(d))} token ids")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
