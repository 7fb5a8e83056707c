"""`bench indexcache` (freq 1 vs 2 vs 4 in one run) on tiny settings, and `bench cache
--index-topk-freq`: the JSON's structure and the relations the code guarantees, never timings.

Relations: the per-step indexer time is one layer's time x the layers that compute their top-k
(21 / 11 / 6 for V4-Flash, counted here from the config rule written out, not from the bench); the
tiny model's indexer store shrinks in proportion to its computing layers; a separately built freq-1
model reproduces freq 1 exactly (KL 0, top-1 and greedy agreement 1) while freq 2 changes the
distribution; speculative decoding stays lossless against each freq's own greedy output; the cache
saved at freq N is exactly the reusing layers' indexer store (entries and compressor rows).
"""

import contextlib
import io
import json

import pytest
import torch

from sglang_dsv4_ascend.bench import cache as cache_bench
from sglang_dsv4_ascend.bench import indexcache

ARGS = [
    "--op-contexts",
    "256",
    "--op-reps",
    "1",
    "--contexts",
    "64",
    "--chunk",
    "32",
    "--decode-batch",
    "2",
    "--reps",
    "1",
    "--prompts",
    "2",
    "--prompt-len",
    "48",  # positions 35.. see more than index_topk (8) entries: selections can differ
    "--new-tokens",
    "4",
    "--spec-new-tokens",
    "4",
]


def _run(module, args) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert module.main(args) == 0
    return json.loads(buf.getvalue())


@pytest.fixture(scope="module")
def doc():
    return _run(indexcache, ARGS)


def _by_freq(rows):
    return {r["index_topk_freq"]: r for r in rows}


def _computing(compress_ratios, n_layers, freq):
    """The upstream rule: CSA layers in order, the first of every `freq` computes."""
    csa = [i for i in range(n_layers) if compress_ratios[i] == 4]
    return [layer for k, layer in enumerate(csa) if k % freq == 0]


def test_config_is_recorded(doc):
    c = doc["config"]
    assert doc["bench"] == "indexcache" and c["freqs"] == [1, 2, 4]
    assert c["parts"] == ["op", "tiny", "quality"] and c["op_contexts"] == [256] and c["contexts"] == [64]
    assert c["prompts"] == 2 and c["prompt_len"] == 48 and c["threads"] >= 1


def test_op_scales_one_layer_by_the_computing_layers(doc):
    op = doc["op"]
    flash = cache_bench.CONFIGS["flash"]
    assert (op["index_n_heads"], op["index_head_dim"], op["index_topk"]) == (64, 128, 512)
    assert op["csa_layers"] == 21 and op["layers"] == 43
    (row,) = op["results"]
    assert row["context"] == 256 and row["entries_per_row"] == 64 and row["layer_select_ms"] > 0
    steps = _by_freq(row["per_step"])
    for f, want in ((1, 21), (2, 11), (4, 6)):
        assert steps[f]["computing_layers"] == want == len(_computing(flash["compress_ratios"], 43, f))
        assert steps[f]["ratio_to_freq1"] == round(want / 21, 4)
        assert steps[f]["indexer_ms"] == pytest.approx(
            row["layer_select_ms"] * want, abs=5e-4 * (want + 1)
        )  # 3-decimal rounding


def test_tiny_rows_and_indexer_store(doc):
    tiny = doc["tiny"]
    assert tiny["computing_layers"] == {"1": 6, "2": 3, "4": 2}
    (row,) = tiny["results"]
    rows = _by_freq(row["by_freq"])
    assert set(rows) == {1, 2, 4}
    for f, r in rows.items():
        assert r["decode_step_ms"] > 0 and r["prefill_tok_s"] > 0
        assert r["decode_user_cpu_ms"] >= 0 and r["prefill_user_cpu_s"] >= 0 and r["prefill_sys_cpu_s"] >= 0
        # every computing layer keeps one indexer store of the same size, the others none
        assert r["c4_index_cache_bytes"] * 6 == rows[1]["c4_index_cache_bytes"] * tiny["computing_layers"][str(f)]
    assert rows[1]["decode_ratio_to_freq1"] == rows[1]["prefill_tok_s_ratio_to_freq1"] == 1.0


def test_quality_freq1_is_exact_and_freq2_differs(doc):
    q = doc["quality"]
    rows = _by_freq(q["results"])
    one, two = rows[1], rows[2]
    assert one["teacher_forced"]["positions"] == 2 * 48
    assert one["teacher_forced"]["kl_mean"] == 0.0 and one["teacher_forced"]["kl_max"] == 0.0
    assert one["teacher_forced"]["top1_agreement"] == 1.0
    assert one["greedy"]["first_divergence"] == [4, 4] and one["greedy"]["prefix_agreement"] == 1.0
    assert one["greedy"]["identical_prompts"] == 2
    # a reused selection changes the later positions' distributions (the tiny indexer is untrained)
    assert two["teacher_forced"]["kl_max"] > 0
    assert 0 <= two["teacher_forced"]["kl_mean"] <= two["teacher_forced"]["kl_max"]
    for r in rows.values():
        g = r["greedy"]
        assert all(0 <= d <= 4 for d in g["first_divergence"])
        assert g["prefix_agreement"] == round(sum(g["first_divergence"]) / 8, 4) <= g["positionwise_equal"]
        for algo in ("nextn", "dspark"):
            s = r["speculative"][algo]
            assert s["lossless"] is True, (r["index_topk_freq"], algo)
            assert 1 <= s["mean_accept_length"] <= q["speculative"]["gamma"] + 1
    assert one["speculative"]["nextn"]["accept_length_ratio_to_freq1"] == 1.0


def test_cache_block_saves_the_reusing_layers_indexer_store():
    from sglang_dsv4_ascend.batch import INDEXER
    from sglang_dsv4_ascend.config import DSV4Config
    from sglang_dsv4_ascend.kvcache.cache import DSV4Cache

    assert "index_cache" not in _run(cache_bench, ["--config", "flash"])
    out = _run(cache_bench, ["--config", "flash", "--index-topk-freq", "1,2,4"])["index_cache"]
    cfg = DSV4Config.from_hf(cache_bench.CONFIGS["flash"])
    rows = _by_freq(out["by_freq"])
    assert out["csa_layers"] == 21 and {f: r["indexer_layers"] for f, r in rows.items()} == {1: 21, 2: 11, 4: 6}
    for f, r in rows.items():
        reusing = sorted(set(_computing(cfg.compress_ratios, 43, 1)) - set(_computing(cfg.compress_ratios, 43, f)))
        assert r["reusing_layers"] == len(reusing)
        for c in r["results"]:
            full = DSV4Cache(cfg, 1, c["context"], dtype=torch.bfloat16, device="meta")  # freq 1
            store = 0
            for i in reusing:
                st = full.layers[i]
                store += st.entries[INDEXER].numel() * st.entries[INDEXER].element_size()
                store += sum(t.numel() * t.element_size() for t in st.rows[INDEXER])
            assert c["saved_bytes_per_token_vs_freq1"] == pytest.approx(store / c["context"], abs=0.01)
            if f > 1:
                assert c["saved_bytes_per_token_vs_freq1"] > 0
            base = rows[1]["results"][r["results"].index(c)]["bytes_per_token"]
            assert c["saved_fraction_vs_freq1"] == pytest.approx(c["saved_bytes_per_token_vs_freq1"] / base, abs=1e-4)
    refused = io.StringIO()
    with contextlib.redirect_stderr(refused), pytest.raises(SystemExit):
        cache_bench.main(["--index-topk-freq", "0"])
    assert "--index-topk-freq" in refused.getvalue()


def test_freqs_must_include_one(capsys):
    with pytest.raises(SystemExit):
        indexcache.main(["--freqs", "2,4"])
    assert "include 1" in capsys.readouterr().err


def test_computing_layers_helper_matches_the_rule():
    from sglang_dsv4_ascend.config import DSV4Config

    cfg = DSV4Config.from_hf(cache_bench.CONFIGS["pro"])
    for f in (1, 2, 3, 4):
        assert indexcache.computing_layers(cfg, f) == _computing(cfg.compress_ratios, cfg.num_hidden_layers, f)
