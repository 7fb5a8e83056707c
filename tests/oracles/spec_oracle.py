"""Independent oracles for the speculative-decoding core (sglang_dsv4_ascend/speculative).

Deliberately naive and written differently from the fast path, which they never import:
* trees as plain parent lists; ancestor sets by walking parent pointers to the root;
* EAGLE candidates enumerated step by step with Python `sorted` on (-value, id) keys, fp32
  products spelled out as an exact double product rounded once to binary32 (struct), which is what
  one IEEE fp32 multiply gives;
* greedy acceptance decided node by node in index order (a node is accepted iff its parent is and
  it is the first sibling carrying the parent row's argmax);
* SGLang's sampler transform in float64 with explicit loops over the vocabulary.
"""

from __future__ import annotations

import math
import struct


def f32(x: float) -> float:
    """Round a double to the nearest binary32 value (ties to even, like the hardware)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


# ---------------------------------------------------------------------------------------------
# Trees


def ancestors(parents, i) -> set:
    """i and every node on its way to the root."""
    out = set()
    while i != -1:
        out.add(i)
        i = parents[i]
    return out


def ancestor_matrix(parents) -> list[list[bool]]:
    n = len(parents)
    return [[j in ancestors(parents, i) for j in range(n)] for i in range(n)]


def depths(parents) -> list[int]:
    return [len(ancestors(parents, i)) - 1 for i in range(len(parents))]


def root_path(parents, i) -> list[int]:
    return sorted(ancestors(parents, i), key=lambda j: len(ancestors(parents, j)))


def leaves(parents) -> list[int]:
    return [i for i in range(len(parents)) if all(parents[j] != i for j in range(len(parents)))]


def eagle_tree(root_token, topk, num_steps, draft_row, num_draft_tokens):
    """EAGLE tree by explicit enumeration.

    draft_row(token_path) -> list of V draft probabilities (binary32 values) for the context
    root + token_path. Returns (tokens, parents, node_cands) like TreeBuilder.finish, with node 0
    the root and node_cands[i - 1] the candidate id of node i.
    """
    cand_token, cand_parent, cand_score = [], [], []

    def path_tokens(c):
        out = []
        while c != -1:
            out.append(cand_token[c])
            c = cand_parent[c]
        return tuple(reversed(out))

    def best(row, k):
        return sorted(range(len(row)), key=lambda t: (-row[t], t))[:k]

    row = draft_row(())
    leaves_now = []
    for t in best(row, topk):
        leaves_now.append(len(cand_token))
        cand_token.append(t)
        cand_parent.append(-1)
        cand_score.append(f32(row[t]))
    for _ in range(1, num_steps):
        new = []
        for leaf in leaves_now:
            row = draft_row(path_tokens(leaf))
            for t in best(row, topk):
                new.append(len(cand_token))
                cand_token.append(t)
                cand_parent.append(leaf)
                cand_score.append(f32(cand_score[leaf] * f32(row[t])))
        leaves_now = sorted(new, key=lambda c: (-cand_score[c], c))[:topk]

    if num_draft_tokens - 1 > len(cand_token):
        raise ValueError("not enough candidates")
    ranked = sorted(range(len(cand_token)), key=lambda c: (-cand_score[c], c))
    chosen = sorted(ranked[: num_draft_tokens - 1])
    tokens, parents = [root_token], [-1]
    for c in chosen:
        tokens.append(cand_token[c])
        parents.append(0 if cand_parent[c] == -1 else 1 + chosen.index(cand_parent[c]))
    return tokens, parents, chosen


# ---------------------------------------------------------------------------------------------
# Accept rules


def greedy_accept(tokens, parents, argmax):
    """(accepted path, bonus) for greedy verification; row i's argmax predicts node i's child."""
    accepted = {0}
    for i in range(1, len(tokens)):
        p = parents[i]
        if p not in accepted or tokens[i] != argmax[p]:
            continue
        earlier_match = any(parents[j] == p and tokens[j] == argmax[p] for j in range(1, i))
        if not earlier_match:
            accepted.add(i)
    path = sorted(accepted)  # one child per accepted node, so this is a chain in depth order
    return path, argmax[path[-1]]


def sampler_probs(logits_row, temperature, top_k, top_p, min_p) -> list[float]:
    """SGLang's pytorch sampler as a distribution, for one row (float64, explicit loops).

    Greedy (temperature < 1e-6 or top_k == 1): one-hot at the first maximal logit. Otherwise
    softmax(logits / T), rank tokens by (-p, id), keep a token iff its rank < top_k (when
    1 <= top_k < V), the mass ranked before it is <= top_p (when top_p < 1), and p >= min_p * p_max
    (when min_p > 0); renormalize.
    """
    V = len(logits_row)
    if temperature < 1e-6 or top_k == 1:
        m = max(logits_row)
        first = next(t for t in range(V) if logits_row[t] == m)
        return [1.0 if t == first else 0.0 for t in range(V)]
    z = [x / temperature for x in logits_row]
    zmax = max(z)
    e = [math.exp(x - zmax) for x in z]
    s = sum(e)
    p = [x / s for x in e]
    ranked = sorted(range(V), key=lambda t: (-p[t], t))
    pmax = p[ranked[0]]
    kept = [0.0] * V
    before = 0.0
    for rank, t in enumerate(ranked):
        ok = True
        if 1 <= top_k < V and rank >= top_k:
            ok = False
        if top_p < 1 and before > top_p:
            ok = False
        if min_p > 0 and p[t] < min_p * pmax:
            ok = False
        if ok:
            kept[t] = p[t]
        before += p[t]
    total = sum(kept)
    return [x / total for x in kept]


def sampler_margin(logits_row, temperature, top_k, top_p, min_p) -> float:
    """Distance of the row's top-p / min-p decisions from their thresholds (inf if none apply).
    fp32 and float64 may decide differently only when this is tiny."""
    if temperature < 1e-6 or top_k == 1:
        return math.inf
    z = [x / temperature for x in logits_row]
    zmax = max(z)
    e = [math.exp(x - zmax) for x in z]
    s = sum(e)
    p = sorted((x / s for x in e), reverse=True)
    margin = math.inf
    before = 0.0
    for x in p:
        if top_p < 1:
            margin = min(margin, abs(before - top_p))
        if min_p > 0:
            margin = min(margin, abs(x - min_p * p[0]))
        before += x
    return margin


def sequential_joint(p_first, p_second_given) -> dict:
    """Exact joint distribution of two tokens sampled one after the other from the target:
    {(x, y): p_first[x] * p_second_given(x)[y]} over every pair."""
    out = {}
    for x, px in enumerate(p_first):
        row = p_second_given(x)
        for y, py in enumerate(row):
            out[(x, y)] = px * py
    return out
