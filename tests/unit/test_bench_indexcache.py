"""`bench cache --index-topk-freq`: the cache saved at freq N is exactly the reusing CSA layers'
indexer store (entries and compressor rows), counted here from the config rule written out."""

import contextlib
import io
import json

import pytest
import torch

from sglang_dsv4_ascend.bench import cache as cache_bench


def _run(module, args) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert module.main(args) == 0
    return json.loads(buf.getvalue())


def _by_freq(rows):
    return {r["index_topk_freq"]: r for r in rows}


def _computing(compress_ratios, n_layers, freq):
    """The upstream rule: CSA layers in order, the first of every `freq` computes."""
    csa = [i for i in range(n_layers) if compress_ratios[i] == 4]
    return [layer for k, layer in enumerate(csa) if k % freq == 0]


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
