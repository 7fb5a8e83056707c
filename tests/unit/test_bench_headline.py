"""bench headline's arithmetic (the servers it drives are covered by tests/e2e/test_bench_serve.py):
per-position acceptance pooled over levels by rounds, not by averaging the levels' ratios, and
speed ratios taken against no-spec at the same dataset and concurrency."""

from sglang_dsv4_ascend.bench import headline, serve


def _lv(ds, c, tps, hist):
    return {
        "dataset": ds,
        "concurrency": c,
        "output_tok_per_s": tps,
        "tpot_ms": {"mean": 1.0},
        "ttft_ms": {"p50": 1.0},
        "accept_length_mean": None,
        "errors": 0,
        "correct_drafts_histogram": hist,
        "draft_positions": None if hist is None else len(hist) - 1,
    }


def test_acceptance_is_pooled_over_rounds():
    # level A: 10 rounds, all 2 correct; level B: 30 rounds, none correct -> P1 = 10 / 40
    levels = [_lv("g", 1, 1.0, [0, 0, 10]), _lv("g", 8, 1.0, [30, 0, 0])]
    assert headline.pooled_acceptance(levels) == [0.25, 1.0]
    mean_of_levels = [(1.0 + 0.0) / 2, 1.0]  # the wrong way: each level weighs the same
    assert headline.pooled_acceptance(levels) != mean_of_levels
    assert headline.pooled_acceptance([_lv("g", 1, 1.0, None)]) is None


def test_ratios_are_against_nospec_at_the_same_point():
    res = {
        "nospec": {"levels": [_lv("g", 1, 10.0, None), _lv("g", 8, 40.0, None), _lv("h", 1, 20.0, None)]},
        "x": {"levels": [_lv("g", 1, 15.0, [1, 1]), _lv("g", 8, 20.0, [1, 1]), _lv("h", 1, 30.0, [1, 1])]},
    }
    got = {(r["method"], r["dataset"], r["concurrency"]): r["tok_s_ratio"] for r in headline.ratios(res)}
    assert got[("x", "g", 1)] == 1.5 and got[("x", "g", 8)] == 0.5 and got[("x", "h", 1)] == 1.5
    assert got[("nospec", "g", 8)] == 1.0


def test_tree_positions_are_its_depth_not_its_nodes():
    # a topk-2 tree with 3 steps proposes 5 nodes per round but accepts at most 3 drafts
    tree = {"spec_correct_drafts_histogram": [2, 3, 4, 1], "spec_verify_ct": 10, "spec_num_proposed_drafts": 50}
    assert serve._positions(tree) == 3
    assert len(serve.acceptance(tree["spec_correct_drafts_histogram"], serve._positions(tree))) == 3
