"""Build a tiny random Llama model plus a byte-level BPE tokenizer into a folder, in seconds.

No hub access is needed: the tokenizer is trained on generated words and the weights are random
(seeded, so every build of the same size is identical). Used by the vLLM end-to-end tests and by
`scripts/bench_vllm.py`.

    python tests/integration/tiny_model.py OUT_DIR [--hidden 256 --layers 2]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

VOCAB_SIZE = 2048


def _corpus(n_words: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(n_words)]
    return [" ".join(words[i:i + 12]) for i in range(0, len(words), 12)]


def build_tiny_model(out_dir: str | Path, *, hidden_size: int = 256, num_layers: int = 2, num_heads: int = 4,
                     num_kv_heads: int = 2, intermediate_size: int | None = None, max_positions: int = 4096,
                     seed: int = 0, extra_config: dict | None = None) -> Path:
    """Write a random `LlamaForCausalLM` (float32) and its tokenizer to `out_dir`; returns the path.

    `extra_config`: more fields of the model's config.json (e.g. `layer_types` and
    `sliding_window`, which vLLM's Llama reads: a hybrid model with two KV-cache groups).
    Reuses the folder when it already holds a model built with the same arguments."""
    out = Path(out_dir)
    stamp = {"hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
             "num_kv_heads": num_kv_heads, "intermediate_size": intermediate_size,
             "max_positions": max_positions, "seed": seed, "vocab": VOCAB_SIZE, **({"extra": extra_config}
                                                                                      if extra_config else {})}
    stamp_file = out / "kvtier_tiny_model.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 3, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="float32", **(extra_config or {}),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a wider spread than the default init, so greedy outputs depend on the context
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    stamp_file.write_text(json.dumps(stamp))
    return out


def random_prompt(n_words: int, seed: int) -> str:
    """A prompt of `n_words` random lowercase words (roughly 1.5-2 tokens per word)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(n_words))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    args = parser.parse_args()
    print(build_tiny_model(args.out_dir, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                           num_kv_heads=args.kv_heads))
