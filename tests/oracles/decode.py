"""Plain decoding in process, the definition speculative and served output is held to: one target
forward per token, nothing drafted, nothing verified. And the DSpark engine as the in-process
tests build it."""

from __future__ import annotations

import types

import torch


def plain_greedy(model, prompts, n: int, spec_rows: int = 0) -> list[list[int]]:
    """The n greedy tokens after each prompt: all prompts at once (one slot each), then one
    single-token forward per step. `model`: our DeepseekV4ForCausalLM-like trunk (fp32, bf16 or
    W8A8); `spec_rows`: the cache's speculative rows where a caller shares its shape."""
    from sglang_dsv4_ascend.batch import Segment

    cache = model.make_cache(len(prompts), max(map(len, prompts)) + n + 1, spec_rows)
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    logits = model.compute_logits(model(ids, pos, [Segment(i, 0, len(p)) for i, p in enumerate(prompts)], cache))
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    outs = [[int(t)] for t in logits[ends].argmax(-1)]
    for step in range(n - 1):
        pos = torch.tensor([len(p) + step for p in prompts])
        segs = [Segment(i, int(q), 1) for i, q in enumerate(pos)]
        h = model(torch.tensor([o[-1] for o in outs]), pos, segs, cache)
        for o, t in zip(outs, model.compute_logits(h).argmax(-1)):
            o.append(int(t))
    return outs


def nextn_setup(dsv4_model, tiny_ckpt, lengths, n_new: int, seed: int):
    """(trunk, its NextN block, random prompts of `lengths`, their `n_new` plain greedy tokens) for
    the tiny flash model: what the NextN engine tests serve and hold their output to."""
    from sglang_dsv4_ascend.models.nextn import load_nextn_from_dir

    trunk = dsv4_model("flash")
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in lengths]
    return trunk, load_nextn_from_dir(tiny_ckpt("flash"), trunk.cfg), prompts, plain_greedy(trunk, prompts, n_new)


def dspark_engine(trunk, draft, slots: int, gamma: int, planner, seed: int = 0):
    """A SpecEngine running DSpark (the real draft block and Markov loop) over a fresh cache of
    `slots` request slots, 128 positions each."""
    from sglang_dsv4_ascend.speculative.drafters import DSparkDrafter
    from sglang_dsv4_ascend.speculative.engine import SpecEngine

    model = types.SimpleNamespace(model=trunk, dspark=draft, cfg=trunk.cfg)
    return SpecEngine(
        model,
        trunk.make_cache(slots, 128, gamma + 1),
        DSparkDrafter,
        torch.Generator().manual_seed(seed),
        planner=planner,
        gamma=gamma,
        topk=1,
        num_steps=gamma,
        num_draft_tokens=gamma + 1,
    )


def prefill(trunk, eng, prompts) -> list[list[int]]:
    """Prompt s prefilled into slot s of the engine's cache in one forward, the drafter's context
    extended over it, as the worker does after a prefill -> each request's first greedy token."""
    from sglang_dsv4_ascend.batch import Segment

    segs = [Segment(s, 0, len(p)) for s, p in enumerate(prompts)]
    aux = {"layer_ids": getattr(eng.drafter, "layer_ids", ())}
    ids, pos = torch.tensor(sum(prompts, [])), torch.cat([torch.arange(len(p)) for p in prompts])
    h = trunk(ids, pos, segs, eng.cache, aux=aux)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    got = [[int(t)] for t in trunk.compute_logits(h[ends]).argmax(-1)]
    shifted = sum((p[1:] + got[s] for s, p in enumerate(prompts)), [])
    eng.extend(segs, torch.tensor(shifted), aux, None, [(s, int(e)) for s, e in enumerate(ends)])
    return got
