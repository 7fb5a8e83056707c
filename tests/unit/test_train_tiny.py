"""The training side of the trained tiny model (tools/train_tiny.py, train_drafts.py, tiny_corpus.py):
each training forward equals the serving forward it trains (on the same weights), gradients reach
every trained weight, the HF <-> released name mapping round-trips exactly, the calibration finds a
known temperature, and the corpus order is fixed."""

import pytest
import torch

from sglang_dsv4_ascend.batch import Segment
from sglang_dsv4_ascend.models.dspark import load_dspark_from_dir
from sglang_dsv4_ascend.models.nextn import load_nextn_from_dir
from sglang_dsv4_ascend.models.weights import load_model_from_dir
from sglang_dsv4_ascend.tools import train_drafts as td
from sglang_dsv4_ascend.tools.make_tiny_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def dspark_ckpt(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("dspark")), "flash", "dspark")


def _seq(model, B=2, S=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(20, model.cfg.vocab_size, (B, S + 1), generator=g)


def test_nextn_training_forward_equals_serving_step(tiny_ckpt):
    path = tiny_ckpt("flash")
    model, nextn = load_model_from_dir(path), load_nextn_from_dir(path, load_model_from_dir(path).cfg)
    x = _seq(model)
    B, S = x.shape[0], x.shape[1] - 1
    tgt = td.target_outputs(model, x[:, :S])
    got = td.nextn_logits(nextn, model.embed, model.head.weight, x[:, 1:S], tgt["streams"][:, : S - 1])
    # serving: one prefill segment per request through the NextN's own cache
    cache = nextn.make_cache(B, S, 0)
    segs = [Segment(b, 0, S - 1) for b in range(B)]
    h, _ = nextn.step(
        x[:, 1:S].flatten(),
        tgt["streams"][:, : S - 1].flatten(0, 1),
        torch.arange(S - 1).repeat(B),
        segs,
        cache,
        model.embed,
    )
    want = model.compute_logits(h).view(B, S - 1, -1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # S > window (16): the window matters; a full causal key set would differ
    assert S > model.cfg.sliding_window


def test_dspark_training_block_equals_serving_block(dspark_ckpt):
    model = load_model_from_dir(dspark_ckpt)
    draft = load_dspark_from_dir(dspark_ckpt, model.cfg)
    x = _seq(model, S=48)
    B, S, gamma = x.shape[0], x.shape[1] - 1, 4
    tgt = td.target_outputs(model, x[:, :S], model.cfg.dspark_target_layer_ids)
    L = torch.tensor([[5, 30], [21, 44]])  # one anchor inside the first window, others past it
    feats = td.dspark_features(draft, tgt)
    U, h = td.dspark_block(draft, model.embed, model.head.weight, feats, x, L, gamma)
    # serving: inject the committed features 0..L-1 into a fresh cache, then the block
    for i in range(L.shape[1]):
        cache = draft.make_cache(B, slack=gamma)
        for b in range(B):
            n = int(L[b, i])
            draft.inject(cache, feats[b, :n], torch.full((n,), b), torch.arange(n))
        Us, hs = draft.block(
            cache,
            list(range(B)),
            L[:, i].tolist(),
            x[torch.arange(B), L[:, i]],
            gamma,
            model.embed,
            model.compute_logits,
        )
        torch.testing.assert_close(U.view(B, 2, gamma, -1)[:, i], Us, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(h.view(B, 2, gamma, -1)[:, i], hs, rtol=1e-4, atol=1e-4)


def test_draft_losses_train_every_weight(tiny_ckpt, dspark_ckpt):
    model = load_model_from_dir(dspark_ckpt)
    draft = load_dspark_from_dir(dspark_ckpt, model.cfg).train()
    x = _seq(model, S=40)
    tgt = td.target_outputs(model, x[:, :-1], model.cfg.dspark_target_layer_ids)
    loss, stats = td.dspark_loss(draft, model.embed, model.head.weight, x, tgt, 4, 4, torch.Generator().manual_seed(0))
    loss.backward()
    no_grad = [n for n, p in draft.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    # routed experts that no token picked get no gradient, nor does the router bias (it only
    # steers the top-k choice); everything else must
    assert all(".experts." in n or n.endswith("gate.bias") for n in no_grad), no_grad
    assert 0 <= stats["acc1"] <= 1 and stats["bce"] > 0
    nm = load_model_from_dir(tiny_ckpt("flash"))
    nextn = load_nextn_from_dir(tiny_ckpt("flash"), nm.cfg).train()
    x = _seq(nm)
    loss, _ = td.nextn_loss(nextn, nm.embed, nm.head.weight, x, td.target_outputs(nm, x[:, :-1]))
    loss.backward()
    no_grad = [n for n, p in nextn.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert all(".experts." in n or n.endswith("gate.bias") for n in no_grad), no_grad


def test_distill_loss_is_zero_only_at_the_target():
    p = torch.softmax(torch.randn(5, 11), -1)
    exact = td.distill_loss(torch.log(p), p)
    ce_only = torch.nn.functional.cross_entropy(torch.log(p), p.argmax(-1), reduction="none")
    torch.testing.assert_close(exact, ce_only)  # TV term vanishes at the target distribution
    assert (td.distill_loss(torch.log(p) + torch.randn(5, 11), p) > exact - 1e-6).any()


def test_sequential_temperature_recovers_a_known_one():
    g = torch.Generator().manual_seed(0)
    n, T = 20000, 2.5
    e1 = torch.randn(n, generator=g) * 3
    y1 = torch.rand(n, generator=g) < torch.sigmoid(e1 / T)  # logits 2.5x too confident
    e2 = torch.randn(n, generator=g) * 2
    y2 = y1 & (torch.rand(n, generator=g) < torch.sigmoid(e2 / 0.5))
    temps, rep = td.sequential_temperatures(torch.stack([e1, e2], 1), torch.stack([y1, y2], 1))
    assert abs(temps[0] - T) / T < 0.1, temps
    assert abs(temps[1] - 0.5) / 0.5 < 0.15, temps  # fitted only where draft 1 was accepted
    assert rep[1]["samples"] == int(y1.sum())
    # a calibration that ignored the conditioning (all anchors at position 2) is off
    wrong, _ = td.sequential_temperatures(torch.stack([e2, e2], 1), torch.stack([y2, y2], 1))
    assert abs(wrong[0] - 0.5) / 0.5 > 0.15


def test_generate_greedy_matches_one_forward_argmax(tiny_ckpt):
    model = load_model_from_dir(tiny_ckpt("flash"))
    prompts = [[0, 5, 9, 33, 70], [0, 44, 12]]
    out = td.generate(model, prompts, 6, 0.0, seed=0)
    for p, o in zip(prompts, out):
        assert o[: len(p)] == p and len(o) == len(p) + 6
        full = td.target_outputs(model, torch.tensor([o[:-1]]))["logits"][0]
        assert full[len(p) - 1 :].argmax(-1).tolist() == o[len(p) :]
