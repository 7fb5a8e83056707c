"""A tiny Llama (an architecture stock SGLang already runs) with the tiny DeepSeek-V4 tokenizer.

It isolates the platform from our model: if it serves, the CPU platform works; if the DeepSeek-V4
test then fails, the fault is in the model or its backend.
"""

from __future__ import annotations

import os


def write_tiny_llama(out_dir: str, seed: int = 0) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sglang_dsv4_ascend.tools.make_tiny_checkpoint import PRESETS, write_checkpoint

    # Borrow the tokenizer files from the DSV4 tool (deterministic), then replace the model.
    write_checkpoint(out_dir, "flash", "nextn", seed)
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(out_dir, f))
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=PRESETS["flash"].vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


if __name__ == "__main__":
    import sys

    write_tiny_llama(sys.argv[1])
