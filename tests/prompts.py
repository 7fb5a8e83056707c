"""Prompts for tests: the package's own prompt sets (sglang_dsv4_ascend/data/prompts)."""

from sglang_dsv4_ascend.data import load_prompts, prompt_path, prompts_dir  # noqa: F401


def chat_ids(n: int) -> list:
    """The first n humaneval prompts in the shipped trained tiny model's chat format, as its token
    ids (what the e2e tests of that model send)."""
    from transformers import AutoTokenizer

    import sglang_dsv4_ascend as pkg
    from sglang_dsv4_ascend.tools.tiny_corpus import chat_prompt

    tok = AutoTokenizer.from_pretrained(pkg.TINY_MODEL_PATH)
    texts = load_prompts("humaneval", n, max_chars=None)
    return [tok(chat_prompt(t), add_special_tokens=False).input_ids for t in texts]
