"""Training text for the trained tiny DeepSeek-V4 (tools/train_tiny.py): the Python standard
library's own source, which every machine with Python has, needs no download, carries a permissive
license (PSF) and suits code prompts such as humaneval.

Two kinds of documents, in one deterministic order (sorted paths, then a seeded shuffle):
- raw modules: `<bos>` + the file's text, for plain completion (`/generate`, `/v1/completions`);
- chat samples, one per function that has a docstring, in the exact prompt format SGLang's
  DeepSeek-V4 chat encoder renders for a non-thinking request,
      <bos><｜User｜>{humaneval-style instruction + signature and docstring}<｜Assistant｜></think>
      {the function}<｜end▁of▁sentence｜>
  so `/v1/chat/completions` on a humaneval prompt gets code back rather than noise.
Test packages (`test/`, `tests/`, `idlelib/idle_test`) are left out: they are mostly
boilerplate. A fixed share of the documents is held out (every 50th) for the loss report and the
draft heads' calibration.
"""

from __future__ import annotations

import ast
import os
import random
import sysconfig

import torch

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
THINK_END = "</think>"
INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
HOLDOUT_EVERY = 50


def stdlib_files(root: str | None = None) -> list[str]:
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        parts = rel.split(os.sep)
        dirs[:] = sorted(x for x in dirs if x not in ("test", "tests", "idle_test", "site-packages", "__pycache__"))
        if "site-packages" in parts or "test" in parts or "tests" in parts:
            continue
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return sorted(out)


def chat_prompt(user: str) -> str:
    return f"{BOS}{USER}{user}{ASSISTANT}{THINK_END}"


def _chat_samples(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not ast.get_docstring(node):
            continue
        doc = node.body[0]
        if node.col_offset or node.end_lineno - node.lineno > 40:  # top-level, short functions only
            continue
        head = "".join(lines[node.lineno - 1 : doc.end_lineno])  # signature + docstring
        whole = "".join(lines[node.lineno - 1 : node.end_lineno])
        user = INSTRUCTION + head + "\n```"
        out.append(chat_prompt(user) + "```python\n" + whole + "```" + EOS)
    return out


def documents(seed: int = 0, root: str | None = None) -> tuple[list[str], list[str]]:
    """(train, holdout) documents in a fixed order."""
    docs = []
    for path in stdlib_files(root):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        docs.append(BOS + text)
        docs += _chat_samples(text)
    random.Random(seed).shuffle(docs)
    train = [d for i, d in enumerate(docs) if i % HOLDOUT_EVERY]
    hold = [d for i, d in enumerate(docs) if not i % HOLDOUT_EVERY]
    return train, hold


def tokenize(tok, docs: list[str]) -> torch.Tensor:
    """One stream of token ids (int32), documents back to back. The BOS / EOS markers are in the
    text, so no post-processor BOS is added here."""
    ids = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += enc.ids
    return torch.tensor(ids, dtype=torch.int32)


class Batches:
    """Random windows of `seq_len + 1` tokens from a stream, in a fixed order: batch i depends only
    on (seed, i), so a resumed run sees the same data as an uninterrupted one."""

    def __init__(self, stream: torch.Tensor, batch: int, seq_len: int, seed: int):
        if stream.numel() <= seq_len + 1:
            raise ValueError(f"training stream has {stream.numel()} tokens, need more than seq_len + 1 = {seq_len + 1}")
        self.stream, self.batch, self.seq_len, self.seed = stream, batch, seq_len, seed

    def __call__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        starts = torch.randint(0, self.stream.numel() - self.seq_len - 1, (self.batch,), generator=g)
        return torch.stack([self.stream[s : s + self.seq_len + 1] for s in starts.tolist()]).long()
