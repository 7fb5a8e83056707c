"""Lossless accept rules for a verified draft tree.

Alignment. The verify pass runs the target over the n tree nodes; row i of the target logits is the
distribution of the token AFTER node i. Accepting a child c of node i compares c's token against
row i. The accepted nodes form a root-to-node path (the root is always in it); the bonus token comes
from the row of the LAST accepted node (from the residual distribution there if children were
rejected there). The tokens emitted this round are tokens[path[1:]] + [bonus], so
accept_len = len(path) (bonus included, as SGLang counts).

Losslessness. `sample_accept` emits tokens distributed exactly as sampling them one at a time from
the target's distributions (`target_probs` of each row):
* deterministic children (EAGLE top-k drafts, point-mass proposals): testing the children of a node
  one by one, accepting child c with probability r(c) / sum(r) and otherwise zeroing r(c), is the
  chain rule for drawing from r = p_row: "is it c1? if not, is it c2 given not c1? ...", and the
  bonus drawn from what is left of r completes the draw; an accepted child's next token then comes
  from its own row, exactly the target's next-token distribution for that context;
* sampled chains (child d drawn from q): accept iff u * q(d) < p(d), else draw from
  normalize(max(p - q, 0)); the standard speculative-sampling identity makes the emitted token ~ p.
Greedy verification is the temperature-0 limit: accept the child equal to the row's argmax.
"""

from __future__ import annotations

import torch

from .tree import DraftTree

__all__ = [
    "SAMPLING_EPS",
    "accept_batch",
    "greedy_accept",
    "is_greedy",
    "sample_accept",
    "sampled_temperature",
    "target_probs",
]

# sglang.srt.sampling.sampling_params._SAMPLING_EPS: a temperature in [0, eps) means greedy
SAMPLING_EPS = 1e-6
FLOAT32_MAX = torch.finfo(torch.float32).max


def _per_row(x, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A scalar or an [n] sequence as an [n] tensor."""
    t = torch.as_tensor(x, dtype=dtype, device=device)
    if t.dim() == 0:
        t = t.expand(n)
    if t.shape != (n,):
        raise ValueError(f"per-row sampling parameter must have shape [{n}], got {tuple(t.shape)}")
    return t


def is_greedy(temperature: float, top_k: int) -> bool:
    """SGLang's greedy rule (SamplingParams.normalize + is_all_greedy): temperature below
    SAMPLING_EPS, or top_k == 1."""
    return temperature < SAMPLING_EPS or top_k == 1


def sampled_temperature(sp: dict | None, b: int = 0) -> float | None:
    """The temperature request b samples at, or None when it is greedy (`is_greedy`; no sampling
    dict means greedy).

    Runs in the scheduler for a whole batch, so a value validation should have stopped is handled
    here for its own request instead of raising (which would end the server): +inf (what a
    temperature past float32's range becomes in SGLang's float32 tensor) samples at float32's
    largest temperature, the limit SGLang's own sampler reaches by dividing by inf (uniform over
    the tokens with finite logits) without its NaNs; NaN or negative, which no sampler can use, is
    served greedy. Every other value is returned unchanged."""
    if sp is None:
        return None
    temperature = float(sp.get("temperature", 1.0))
    if not temperature >= 0:  # NaN included
        return None
    if is_greedy(temperature, int(sp.get("top_k", -1))):
        return None
    return min(temperature, FLOAT32_MAX)


def target_probs(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """The distribution SGLang's non-speculative "pytorch" sampler draws each row from.

    logits: [n, V]; temperature (float), top_k (int), top_p (float), min_p (float): per-row [n]
    tensors or scalars. Returns [n, V] fp32 probabilities, each row summing to 1.

    Reproduces `Sampler.forward` (sglang/srt/layers/sampler.py: logits.div_(temperatures), softmax)
    followed by `top_k_top_p_min_p_sampling_from_probs_torch`, whose masks act on the probabilities
    sorted descending, all computed from the unrenormalized softmax:
      * top-k: drop ranks >= top_k;
      * top-p: drop a token when the mass of the tokens ranked before it (cumsum - p) is > top_p,
        i.e. top-p is measured on the full softmax, not on the top-k survivors (flashinfer's
        "joint" order), and a token whose prefix mass equals top_p exactly is kept;
      * min-p: drop p < min_p * p_max;
    then torch.multinomial's implicit renormalization, made explicit here.
    Greedy rows (temperature < 1e-6, or top_k == 1) are one-hot at argmax(logits), the lowest
    token id among equal maxima, like the all-greedy path's torch.argmax.

    Off values: top_k <= 0 or >= V (SGLang stores "off" as TOP_K_ALL = 1 << 30; -1 is its
    user-facing spelling), top_p >= 1, min_p <= 0. An off filter is skipped per row: SGLang skips
    it per batch (need_top_p_sampling etc.), and applying top-p = 1 could only drop tail tokens
    whose preceding fp32 cumsum rounds above 1. Ties in the sort are broken by lower token id
    (stable sort); SGLang's unstable sort leaves that order to the backend. NaN sanitizing
    (SGLANG_SANITIZE_NAN_LOGITS) is the caller's business.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, V], got {tuple(logits.shape)}")
    logits = logits.float()
    n, V = logits.shape
    dev = logits.device
    temp = _per_row(temperature, n, torch.float32, dev)
    top_k = _per_row(top_k, n, torch.int64, dev)
    top_p = _per_row(top_p, n, torch.float32, dev)
    min_p = _per_row(min_p, n, torch.float32, dev)
    if bool((temp < 0).any()) or not bool(torch.isfinite(temp).all()):
        raise ValueError("temperature must be a non-negative finite number")

    greedy = (temp < SAMPLING_EPS) | (top_k == 1)
    # SGLang rewrites a greedy request's temperature to 1.0; it also keeps 0 out of the division
    temp = torch.where(greedy, torch.ones_like(temp), temp)
    probs = torch.softmax(logits / temp[:, None], dim=-1)

    p_sort, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    prefix = torch.cumsum(p_sort, dim=-1) - p_sort
    rank = torch.arange(V, device=dev)[None, :]
    k_on = ((top_k >= 1) & (top_k < V))[:, None]
    drop = k_on & (rank >= top_k[:, None])
    drop |= (top_p < 1)[:, None] & (prefix > top_p[:, None])
    # p_sort[:, 0] survives every mask (rank 0, prefix 0), so it is SGLang's post-mask max too
    drop |= (min_p > 0)[:, None] & (p_sort < p_sort[:, :1] * min_p[:, None])
    p_sort = p_sort.masked_fill(drop, 0.0)
    p_sort = p_sort / p_sort.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(probs).scatter_(-1, order, p_sort)

    if bool(greedy.any()):
        onehot = torch.zeros_like(out)
        onehot.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        out = torch.where(greedy[:, None], onehot, out)
    return out


def greedy_accept(tree: DraftTree, target_argmax) -> tuple[list[int], int]:
    """Greedy verification: from the root, accept the first child (sibling order) whose token is the
    argmax of the current node's row, descend, repeat until no child matches.

    target_argmax: [n] token ids, the argmax of each row. Returns (accepted path of node indices,
    root included; bonus = target_argmax[path[-1]]).
    """
    argmax = [int(a) for a in torch.as_tensor(target_argmax).reshape(-1).tolist()]
    if len(argmax) != tree.n:
        raise ValueError(f"target_argmax has {len(argmax)} entries for a tree of {tree.n} nodes")
    path = [0]
    while True:
        node = path[-1]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == argmax[node]), None)
        if nxt is None:
            return path, argmax[node]
        path.append(nxt)


def _uniform(generator: torch.Generator) -> float:
    return torch.rand((), generator=generator, dtype=torch.float64).item()


def _row(t: torch.Tensor, i: int) -> torch.Tensor:
    # float64 on the CPU: residual sums stay accurate over a large vocabulary, and multinomial
    # must run where the (CPU) generator is. Always a copy: residuals are zeroed in place, and
    # .to() would hand back the caller's own row when it is already CPU float64.
    return t[i].detach().to("cpu", torch.float64, copy=True)


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(weights, 1, generator=generator).item())


def sample_accept(
    tree: DraftTree,
    probs: torch.Tensor,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> tuple[list[int], int]:
    """Lossless rejection sampling over a draft tree. Returns (accepted path incl. root, bonus).

    probs: [n, V] target probabilities (`target_probs`), row i = next token after node i.
    generator: a CPU torch.Generator; it is the only source of randomness.

    draft_probs None: the children are deterministic proposals (EAGLE top-k). At each node the
    residual r starts as p_row; each child c in sibling order is accepted with probability
    r(c) / sum(r), and on rejection r(c) is zeroed. A duplicate sibling token therefore has
    r(c) = 0 by its turn and is always rejected. The first accepted child is descended into with a
    fresh r = its own row. When no child is accepted the bonus is drawn from r (from p_row if r has
    no mass left, which only rounding can cause).

    draft_probs given: only for chains (ValueError otherwise); draft_probs[i] is the distribution q
    node i's child was sampled from (rows of nodes without a child are not read). The child d is
    accepted iff u * q(d) < p(d), u ~ U[0, 1); on rejection the bonus is drawn from
    normalize(max(p - q, 0)), or from p when that has no mass; after a full accept the bonus is
    drawn from the last node's p.
    """
    if probs.dim() != 2 or probs.shape[0] != tree.n:
        raise ValueError(f"probs must be [{tree.n}, V], got {tuple(probs.shape)}")
    if draft_probs is not None:
        return _sample_accept_chain(tree, probs, draft_probs, generator)

    path = [0]
    while True:
        node = path[-1]
        r = _row(probs, node)
        accepted = None
        for c in tree.children(node):
            total = r.sum().item()
            if total <= 0:
                break
            tok = tree.tokens[c]
            if _uniform(generator) < r[tok].item() / total:
                accepted = c
                break
            r[tok] = 0.0
        if accepted is None:
            return path, _draw(r if r.sum().item() > 0 else _row(probs, node), generator)
        path.append(accepted)


def _sample_accept_chain(tree, probs, draft_probs, generator):
    kids = [tree.children(i) for i in range(tree.n)]
    if any(len(k) > 1 for k in kids):
        raise ValueError("draft_probs is only defined for chains (every node has at most one child)")
    V = probs.shape[1]
    if draft_probs.dim() != 2 or draft_probs.shape[0] < tree.n - 1 or draft_probs.shape[1] != V:
        shape = tuple(draft_probs.shape)
        raise ValueError(f"draft_probs must be [{tree.n} (or one less), {V}], got {shape}")
    # with parents before children and at most one child each, node i's parent is i - 1, so the
    # accepted path is simply 0..node
    node = 0
    while kids[node]:
        child = kids[node][0]
        d = tree.tokens[child]
        p, q = _row(probs, node), _row(draft_probs, node)
        if _uniform(generator) * q[d].item() < p[d].item():
            node = child
            continue
        residual = (p - q).clamp_min_(0.0)
        return list(range(node + 1)), _draw(residual if residual.sum().item() > 0 else p, generator)
    return list(range(node + 1)), _draw(_row(probs, node), generator)


def accept_batch(
    trees: list[DraftTree],
    logits_rows: list[torch.Tensor],
    sampling: list[dict | None] | None,
    generator: torch.Generator,
    draft_probs: list | None = None,
) -> list[tuple[list[int], int]]:
    """Accept every request of a verify batch.

    logits_rows[b]: [n_b, V] fp32 target logits of request b's nodes. sampling[b]: a dict with
    temperature, top_k, top_p, min_p (missing keys default to 1.0, off, 1.0, 0.0), or None for
    greedy; sampling None makes the whole batch greedy. A greedy request (see `is_greedy`) uses
    greedy_accept on the logits' argmax; the others target_probs + sample_accept with `generator`,
    consumed in batch order. draft_probs[b] (chains only): the distributions request b's drafts
    were sampled from (`sample_accept`); None (or a None entry): deterministic proposals.
    """
    if len(trees) != len(logits_rows) or (sampling is not None and len(sampling) != len(trees)):
        raise ValueError("trees, logits_rows and sampling must have one entry per request")
    out = []
    for b, (tree, logits) in enumerate(zip(trees, logits_rows)):
        sp = None if sampling is None else sampling[b]
        temperature = sampled_temperature(sp, b)
        if temperature is None:
            out.append(greedy_accept(tree, logits.argmax(dim=-1)))
            continue
        top_k, top_p, min_p = int(sp.get("top_k", -1)), float(sp.get("top_p", 1.0)), float(sp.get("min_p", 0.0))
        probs = target_probs(logits, temperature, top_k, top_p, min_p)
        q = None if draft_probs is None else draft_probs[b]
        out.append(sample_accept(tree, probs, generator, q))
    return out
