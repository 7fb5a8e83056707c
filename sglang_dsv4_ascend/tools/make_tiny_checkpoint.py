"""Write a tiny DeepSeek-V4 checkpoint in the released on-disk format.

    python -m sglang_dsv4_ascend.tools.make_tiny_checkpoint OUT_DIR [--preset flash|pro] [--draft dspark|nextn]

What is "real" about it: `config.json` uses the field names of the published DeepSeek-V4 configs
(`compress_ratios`, `num_hash_layers`, `index_*`, `hc_*`, `o_groups`, `dspark_*`, ...), and the
safetensors use the released tensor names (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.ffn.experts.E.w1.weight`, `mtp.K.*`, ...) with the released dtypes (bf16 weights, fp32
`hc_*`, `attn_sink`, `ape` and `gate.bias`, int64 `tid2eid`). HF transformers loads it through its
own conversion mapping, which is the independent check that the format is right.

What is tiny: every width, so that a real SGLang server answers in seconds on two CPU cores. The
compression ratios stay the real 4 and 128 (transformers only maps those), so the sliding window is
shrunk instead (16) to let short prompts cross it.

The draft weights: `--draft dspark` (default) writes the three DSpark stages `mtp.0..2` with
`main_proj`, Markov and confidence heads, like the 0731 checkpoints; `--draft nextn` writes one
NextN/MTP block `mtp.0` like the preview checkpoints. The released names overlap (`mtp.0`), so one
checkpoint carries one kind of draft, as the real ones do.

A fixed seed gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field

from ..checkpoint import write_index
from ..names import DSV4_ARCH

SPECIAL_TOKENS = [
    "<｜begin▁of▁sentence｜>",  # 0 = bos, as in the released tokenizer
    "<｜end▁of▁sentence｜>",  # 1 = eos
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜dspark_noise｜>",  # DSpark's placeholder token for block rows 2..γ
    # The rest of the DeepSeek-V4 chat vocabulary: SGLang's DSV4 chat encoder (deepseek-recipe)
    # refuses a tokenizer that lacks any of them.
    "<think>",
    "</think>",
    "<｜System｜>",
    "<｜latest_reminder｜>",
    "｜DSML｜",
    "<｜image｜>",
    "<｜deepseek_image｜>",
    "<｜ref｜>",
    "<｜/ref｜>",
    "<｜box｜>",
    "<｜/box｜>",
    "<｜point｜>",
    "<｜/point｜>",
    "<｜polygon｜>",
    "<｜/polygon｜>",
]

# Built-in training text for the tokenizer: the checkpoint must not depend on files outside the
# package, and byte-level BPE falls back to bytes for anything this text lacks.
_CORPUS = """
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Complex is better than complicated. Flat is better than nested. Sparse is better than dense.
Readability counts. Special cases aren't special enough to break the rules. Although practicality
beats purity. Errors should never pass silently. Unless explicitly silenced. In the face of
ambiguity, refuse the temptation to guess. There should be one-- and preferably only one --obvious
way to do it. Now is better than never. Although never is often better than *right* now.
Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for
her friends every day with four. She sells the remainder at the farmers' market daily for $2 per
fresh duck egg. How much in dollars does she make every day at the farmers' market?
def has_close_elements(numbers: List[float], threshold: float) -> bool:
    for idx, elem in enumerate(numbers):
        for idx2, elem2 in enumerate(numbers):
            if idx != idx2 and abs(elem - elem2) < threshold:
                return True
    return False
Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural
experiences and must-see attractions. Write a persuasive email to convince your introverted friend.
The quick brown fox jumps over the lazy dog 0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' "
"""


@dataclass(frozen=True)
class Preset:
    compress_ratios: tuple  # main layers only; draft entries are appended
    hidden_size: int = 64
    num_attention_heads: int = 4
    head_dim: int = 64
    qk_rope_head_dim: int = 16
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 16
    index_n_heads: int = 16  # few heads make the indexer tie often (all ReLUs zero), unlike the real 64
    index_head_dim: int = 32
    index_topk: int = 4
    sliding_window: int = 16
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    num_hash_layers: int = 3
    routed_scaling_factor: float = 1.5
    vocab_size: int = 1024
    tokenizer_vocab: int = 1000
    hc_mult: int = 4
    dspark_block_size: int = 4
    dspark_markov_rank: int = 16
    extra: dict = field(default_factory=dict)


PRESETS = {
    # V4-Flash pattern [0, 0] + [4, 128]*k + [4]: SWA-only, CSA and HCA layers.
    "flash": Preset(compress_ratios=(0, 0, 4, 128, 4)),
    # V4-Pro pattern [128, 128] + [4, 128]*k + [4]: HCA bootstrap, no SWA-only layer.
    "pro": Preset(compress_ratios=(128, 128, 4, 128, 4), routed_scaling_factor=2.5, o_groups=4),
    # The trained tiny model's shape (tools/train_tiny.py): the Flash pattern at 13 layers, so that
    # one NextN block is 1/13 of the trunk and DSpark's three stages 3/13 (the released Flash:
    # 1/43 and 3/43), wide enough to learn code, small enough to train in ~20 min on 2 cores.
    "trained": Preset(
        compress_ratios=(0, 0) + (4, 128) * 5 + (4,),
        hidden_size=128,
        q_lora_rank=64,
        o_lora_rank=32,
        index_topk=8,
        sliding_window=64,
        moe_intermediate_size=128,
        vocab_size=4096,
        tokenizer_vocab=4096,
        dspark_markov_rank=32,
    ),
}


def build_config(p: Preset, draft: str) -> dict:
    n = len(p.compress_ratios)
    n_draft = 3 if draft == "dspark" else 1
    cfg = {
        "architectures": [DSV4_ARCH],
        "model_type": "deepseek_v4",
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "num_hidden_layers": n,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": p.head_dim,
        "qk_rope_head_dim": p.qk_rope_head_dim,
        "q_lora_rank": p.q_lora_rank,
        "o_groups": p.o_groups,
        "o_lora_rank": p.o_lora_rank,
        "n_routed_experts": p.n_routed_experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": p.num_experts_per_tok,
        "moe_intermediate_size": p.moe_intermediate_size,
        "routed_scaling_factor": p.routed_scaling_factor,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "num_hash_layers": p.num_hash_layers,
        "swiglu_limit": 10.0,
        "index_n_heads": p.index_n_heads,
        "index_head_dim": p.index_head_dim,
        "index_topk": p.index_topk,
        "sliding_window": p.sliding_window,
        "compress_ratios": list(p.compress_ratios) + [0] * n_draft,
        "compress_rope_theta": 160000.0,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 1048576,
        "hc_mult": p.hc_mult,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": n_draft,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    if draft == "dspark":
        cfg.update(
            {
                "dspark_block_size": p.dspark_block_size,
                "dspark_noise_token_id": SPECIAL_TOKENS.index("<｜dspark_noise｜>"),
                "dspark_target_layer_ids": [n - 3, n - 2, n - 1],
                "dspark_markov_rank": p.dspark_markov_rank,
            }
        )
    cfg.update(p.extra)
    return cfg


class _Init:
    """Deterministic tensor factory: one generator, tensors drawn in a fixed order."""

    def __init__(self, seed: int):
        import torch

        self.torch = torch
        self.g = torch.Generator().manual_seed(seed)
        self.tensors: dict = {}

    def normal(self, name, shape, std, dtype="bf16", mean=0.0):
        t = self.torch.randn(*shape, generator=self.g) * std + mean
        self.tensors[name] = t.to(self.torch.bfloat16 if dtype == "bf16" else self.torch.float32)

    def linear(self, name, out_f, in_f):
        self.normal(name, (out_f, in_f), in_f**-0.5)

    def norm(self, name, dim):
        self.normal(name, (dim,), 0.1, mean=1.0)


def _block(init: _Init, p: Preset, pre: str, ratio: int, hash_layer: bool):
    """One V4 block: mHC wrappers, attention (+compressor/indexer), MoE."""
    d, H, D = p.hidden_size, p.num_attention_heads, p.head_dim
    hc = p.hc_mult
    mix = (2 + hc) * hc
    init.norm(f"{pre}.attn_norm.weight", d)
    init.norm(f"{pre}.ffn_norm.weight", d)
    for site in ("attn", "ffn"):
        init.normal(f"{pre}.hc_{site}_fn", (mix, hc * d), (hc * d) ** -0.5, "fp32")
        init.normal(f"{pre}.hc_{site}_base", (mix,), 0.5, "fp32")
        init.normal(f"{pre}.hc_{site}_scale", (3,), 0.2, "fp32", mean=1.0)
    a = f"{pre}.attn"
    init.linear(f"{a}.wq_a.weight", p.q_lora_rank, d)
    init.norm(f"{a}.q_norm.weight", p.q_lora_rank)
    init.linear(f"{a}.wq_b.weight", H * D, p.q_lora_rank)
    init.linear(f"{a}.wkv.weight", D, d)
    init.norm(f"{a}.kv_norm.weight", D)
    init.linear(f"{a}.wo_a.weight", p.o_groups * p.o_lora_rank, H * D // p.o_groups)
    init.linear(f"{a}.wo_b.weight", d, p.o_groups * p.o_lora_rank)
    init.normal(f"{a}.attn_sink", (H,), 1.0, "fp32")
    if ratio:
        width = 2 * D if ratio == 4 else D  # CSA pools overlapping windows: two series
        init.linear(f"{a}.compressor.wkv.weight", width, d)
        init.linear(f"{a}.compressor.wgate.weight", width, d)
        init.normal(f"{a}.compressor.ape", (ratio, width), 0.5, "fp32")
        init.norm(f"{a}.compressor.norm.weight", D)
    if ratio == 4:
        I = p.index_head_dim
        init.linear(f"{a}.indexer.wq_b.weight", p.index_n_heads * I, p.q_lora_rank)
        init.linear(f"{a}.indexer.weights_proj.weight", p.index_n_heads, d)
        init.linear(f"{a}.indexer.compressor.wkv.weight", 2 * I, d)
        init.linear(f"{a}.indexer.compressor.wgate.weight", 2 * I, d)
        init.normal(f"{a}.indexer.compressor.ape", (ratio, 2 * I), 0.5, "fp32")
        init.norm(f"{a}.indexer.compressor.norm.weight", I)
    f = f"{pre}.ffn"
    E, k, inter = p.n_routed_experts, p.num_experts_per_tok, p.moe_intermediate_size
    init.linear(f"{f}.gate.weight", E, d)
    if hash_layer:
        torch = init.torch
        rows = [torch.randperm(E, generator=init.g)[:k] for _ in range(p.vocab_size)]
        init.tensors[f"{f}.gate.tid2eid"] = torch.stack(rows).to(torch.int64)
    else:
        init.normal(f"{f}.gate.bias", (E,), 0.1, "fp32")
    for e in range(E):
        init.linear(f"{f}.experts.{e}.w1.weight", inter, d)
        init.linear(f"{f}.experts.{e}.w3.weight", inter, d)
        init.linear(f"{f}.experts.{e}.w2.weight", d, inter)
    init.linear(f"{f}.shared_experts.w1.weight", inter, d)
    init.linear(f"{f}.shared_experts.w3.weight", inter, d)
    init.linear(f"{f}.shared_experts.w2.weight", d, inter)


def _hc_head(init: _Init, p: Preset, pre: str):
    hc, d = p.hc_mult, p.hidden_size
    init.normal(f"{pre}hc_head_fn", (hc, hc * d), (hc * d) ** -0.5, "fp32")
    init.normal(f"{pre}hc_head_base", (hc,), 0.5, "fp32")
    init.normal(f"{pre}hc_head_scale", (1,), 0.2, "fp32", mean=1.0)


def build_tensors(p: Preset, draft: str, seed: int) -> dict:
    init = _Init(seed)
    d, V = p.hidden_size, p.vocab_size
    init.normal("embed.weight", (V, d), 1.0)
    for i, ratio in enumerate(p.compress_ratios):
        _block(init, p, f"layers.{i}", ratio, hash_layer=i < p.num_hash_layers)
    init.norm("norm.weight", d)
    _hc_head(init, p, "")
    init.linear("head.weight", V, d)
    if draft == "nextn":
        m = "mtp.0"
        _block(init, p, m, 0, hash_layer=False)  # draft layers are never hash-routed
        init.linear(f"{m}.e_proj.weight", d, d)
        init.linear(f"{m}.h_proj.weight", d, d)
        init.norm(f"{m}.enorm.weight", d)
        init.norm(f"{m}.hnorm.weight", d)
        init.norm(f"{m}.norm.weight", d)
        _hc_head(init, p, f"{m}.")
    else:
        for s in range(3):
            _block(init, p, f"mtp.{s}", 0, hash_layer=False)
        init.linear("mtp.0.main_proj.weight", d, 3 * d)
        init.norm("mtp.0.main_norm.weight", d)
        r = p.dspark_markov_rank
        init.norm("mtp.2.norm.weight", d)
        _hc_head(init, p, "mtp.2.")
        init.normal("mtp.2.markov_head.markov_w1.weight", (V, r), 1.0)
        init.linear("mtp.2.markov_head.markov_w2.weight", V, r)
        init.linear("mtp.2.confidence_head.proj.weight", 1, d + r)
        init.normal("mtp.2.confidence_head.proj.bias", (1,), 0.1, "fp32")
    return init.tensors


def build_tokenizer(p: Preset, lines=None):
    """Byte-level BPE with SPECIAL_TOKENS first; trained on `lines` (default: the built-in text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=p.tokenizer_vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True) if lines is None else lines, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, f"special token {s!r} must have id {i}"
    # Prepend BOS like the released tokenizer does; chat templates that emit it themselves
    # are encoded with add_special_tokens=False by SGLang.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKENS[0]} $A", special_tokens=[(SPECIAL_TOKENS[0], 0)]
    )
    return tok


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def write_checkpoint(out_dir: str, preset: str = "flash", draft: str = "dspark", seed: int = 0) -> str:
    """Write the checkpoint and return `out_dir`. Same arguments -> byte-identical files."""
    if preset not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if draft not in ("dspark", "nextn"):
        raise ValueError(f"--draft must be 'dspark' or 'nextn', got {draft!r}")
    p = PRESETS[preset]
    return write_files(out_dir, build_config(p, draft), build_tensors(p, draft, seed), build_tokenizer(p))


def write_files(out_dir: str, cfg: dict, tensors: dict, tok) -> str:
    """config, generation config, safetensors split like the release (trunk / `mtp.*` draft) with
    an index, tokenizer and its config (with the chat template)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, f, indent=2, sort_keys=True)
        f.write("\n")
    shards = {
        "model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if not k.startswith("mtp.")},
        "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k.startswith("mtp.")},
    }
    weight_map = {}
    for fname, part in shards.items():
        save_file(
            {k: part[k].contiguous() for k in sorted(part)}, os.path.join(out_dir, fname), metadata={"format": "pt"}
        )
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_index(out_dir, weight_map, total)
    write_tokenizer(out_dir, tok)
    return out_dir


def write_tokenizer(out_dir: str, tok) -> None:
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[1],
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 1048576,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="flash", choices=sorted(PRESETS))
    ap.add_argument("--draft", default="dspark", choices=["dspark", "nextn"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    write_checkpoint(a.out_dir, a.preset, a.draft, a.seed)
    print(f"wrote tiny DeepSeek-V4 ({a.preset}, draft={a.draft}, seed={a.seed}) to {a.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
