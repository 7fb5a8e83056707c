"""bench headline's arithmetic (the servers it drives are covered by tests/e2e/test_bench_serve.py):
per-position acceptance pooled over levels by rounds, not by averaging the levels' ratios, and
speed ratios taken against no-spec at the same dataset and concurrency."""

import json

from sglang_dsv4_ascend.bench import headline, headline_quant, serve


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


def test_the_baseline_is_the_mean_of_nospec_before_and_after():
    """No-spec read 10 tok/s first and 20 at the end of the run (the machine drifted): a method at
    15 is 1.0x, not 1.5x as against the first run alone, and the drift is reported."""
    res = {
        "nospec": {"levels": [_lv("g", 1, 10.0, None), _lv("g", 8, 40.0, None)]},
        "x": {"levels": [_lv("g", 1, 15.0, [1, 1]), _lv("g", 8, 40.0, [1, 1])]},
        headline.AGAIN: {"levels": [_lv("g", 1, 20.0, None), _lv("g", 8, 40.0, None)]},
    }
    got = {(r["method"], r["dataset"], r["concurrency"]): r["tok_s_ratio"] for r in headline.ratios(res)}
    assert got[("x", "g", 1)] == 1.0 and got[("x", "g", 8)] == 1.0
    assert got[("nospec", "g", 1)] == round(10 / 15, 3) and got[(headline.AGAIN, "g", 1)] == round(20 / 15, 3)
    assert headline.baseline_drift(res) == {"g@1": 2.0, "g@8": 1.0}
    del res[headline.AGAIN]
    assert headline.baseline_drift(res) is None
    assert {r["tok_s_ratio"] for r in headline.ratios(res) if r["method"] == "x"} == {1.5, 1.0}


def test_tree_positions_are_its_depth_not_its_nodes():
    # a topk-2 tree with 3 steps proposes 5 nodes per round but accepts at most 3 drafts
    tree = {"spec_correct_drafts_histogram": [2, 3, 4, 1], "spec_verify_ct": 10, "spec_num_proposed_drafts": 50}
    assert serve._positions(tree) == 3
    assert len(serve.acceptance(tree["spec_correct_drafts_histogram"], serve._positions(tree))) == 3


# --quant (#31): W8A8 versions beside the float model; servers are replaced by a stub here (the
# real run: examples/results/headline_w8a8.json), the checkpoints are written for real (dynamic:
# well under a second each; static: two calibration prompts)


def test_quant_plan_runs_nospec_once_per_target_scheme():
    runs = headline_quant.plan(list(headline_quant.QUANTS), ["dspark_adaptive", "nextn_chain"])
    keys = [k for k, *_ in runs]
    assert [k for k in keys if k.endswith("/nospec")] == ["float/nospec", "w8a8-dynamic/nospec", "w8a8-static/nospec"]
    assert len(keys) == 13 and len(set(keys)) == 13
    base = {k: b for k, _, _, b in runs}
    assert base["w8a8-dynamic-float-draft/nextn_chain"] == "w8a8-dynamic/nospec"
    assert base["w8a8-static/dspark_adaptive"] == "w8a8-static/nospec"
    # a float-draft version asked for alone gets its own no-spec server
    alone = headline_quant.plan(["w8a8-static-float-draft"], ["nextn_chain"])
    assert [k for k, *_ in alone] == ["w8a8-static-float-draft/nospec", "w8a8-static-float-draft/nextn_chain"]


def test_static_version_keeps_a_w8a8_dynamic_draft(tmp_path):
    """What --scheme static writes for the draft (tools/quantize_w8a8.scheme_for): its dense layers
    stay W8A8_DYNAMIC, so 'w8a8-static' serves a W8A8 draft; its trunk is not the dynamic one's."""
    info = headline_quant.checkpoints(["w8a8-dynamic", "w8a8-static"], ["nextn"], str(tmp_path), calib_prompts=2)
    st, dy = info["w8a8-static"], info["w8a8-dynamic"]
    assert set(st["draft_weights"]["nextn"]) == {"FLOAT", "W8A8_DYNAMIC"}
    assert st["draft_weights"] == dy["draft_weights"]
    assert st["trunk_sha256"] != dy["trunk_sha256"]
    calib = (tmp_path / "calibration.jsonl").read_text().splitlines()
    assert len(calib) == 2 and all("<｜Assistant｜></think>" in json.loads(x)["turns"][0] for x in calib)


def _stub_server(calls):
    def run_method(name, datasets, levels, per_level, max_tokens, path=None, extra_flags=(), label=None):
        calls.append((label or name, path, tuple(extra_flags)))
        spec = name != "nospec"
        hist = ([1, 1, 2] if "float-draft" in (path or "") else [2, 1, 1]) if spec else None
        tps = 20.0 if spec else 10.0
        return {
            "checkpoint": "x",
            "env": {},
            "flags": list(extra_flags),
            "levels": [
                {**_lv(ds, c, tps, hist), "accept_length_mean": 1 + (sum(k * v for k, v in enumerate(hist)) / 4)}
                if spec
                else _lv(ds, c, tps, None)
                for ds in datasets
                for c in levels
            ],
        }

    return run_method


def test_quant_run_layout_baselines_and_draft_effect(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(headline, "run_method", _stub_server(calls))
    monkeypatch.setattr(headline, "environment", dict)  # its version probes import SGLang: seconds
    quants = "float,w8a8-dynamic,w8a8-dynamic-float-draft"
    assert headline.main(["--quant", quants, "--out-dir", str(tmp_path), "--no-plot"]) == 0
    assert not (tmp_path / "headline.json").exists()
    doc = json.loads((tmp_path / "headline_w8a8.json").read_text())
    cfg = doc["config"]
    assert cfg["quant"] == quants.split(",") and cfg["methods"] == ["nospec", "dspark_adaptive", "nextn_chain"]
    assert cfg["datasets"] == ["humaneval"] and cfg["concurrency"] == [1, 4] and cfg["max_tokens"] == 48
    res = doc["results"]
    assert list(res) == [k for k, *_ in headline_quant.plan(quants.split(","), cfg["methods"])]
    # W8A8 servers get --quantization w8a8_ascend, the float ones not; the draft kind is recorded
    for label, path, flags in calls:
        w8a8 = not label.startswith("float/")
        assert flags == (("--quantization", "w8a8_ascend") if w8a8 else ()), label
        assert (path not in headline_quant.SOURCES.values()) == w8a8, label
    r = res["w8a8-dynamic-float-draft/nextn_chain"]
    assert r["baseline"] == "w8a8-dynamic/nospec" and r["baseline_same_trunk"] is True
    assert r["draft"] == "float" and res["w8a8-dynamic/nextn_chain"]["draft"].startswith("w8a8 (W8A8_DYNAMIC")
    assert all(x["tok_s_ratio"] == (1.0 if x["spec_method"] == "nospec" else 2.0) for x in doc["summary"])
    eff = {(e["target"], e["method"]): e for e in doc["draft_quantization_effect"]}
    assert set(eff) == {("dynamic", "dspark_adaptive"), ("dynamic", "nextn_chain")}
    e = eff["dynamic", "dspark_adaptive"]
    assert e["accept_length_pooled_w8a8_draft"] == 1.75 and e["accept_length_pooled_float_draft"] == 2.25
    assert e["change_pooled"] == -0.5 and e["levels"][0]["change"] == -0.5
    assert doc["accept_length_pooled"]["nextn_chain"] == {
        "float": 1.75,
        "w8a8-dynamic": 1.75,
        "w8a8-dynamic-float-draft": 2.25,
    }


def test_default_run_is_unchanged(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(headline, "run_method", _stub_server(calls))
    monkeypatch.setattr(headline, "environment", dict)  # its version probes import SGLang: seconds
    assert headline.main(["--out-dir", str(tmp_path), "--no-plot"]) == 0
    doc = json.loads((tmp_path / "headline.json").read_text())
    # every method, then no-spec again: the baseline brackets the run
    assert [c[0] for c in calls] == [*headline.METHODS, headline.AGAIN] and all(c[1:] == (None, ()) for c in calls)
    assert doc["baseline_drift"] == {f"{ds}@{c}": 1.0 for ds in doc["config"]["datasets"] for c in (1, 8, 16)}
    assert list(doc["config"]) == [
        "methods",
        "datasets",
        "concurrency",
        "prompts_per_level",
        "max_tokens",
        "out_dir",
        "model",
        "dtype",
        "greedy",
    ]
    assert doc["config"]["concurrency"] == [1, 8, 16] and doc["config"]["max_tokens"] == 64
    assert "quant" not in doc and "draft_quantization_effect" not in doc
    assert not (tmp_path / "headline_w8a8.json").exists()


def test_the_speculative_record_is_read_from_server_info():
    """A method's run keeps the worker's record from /get_server_info (DSpark's or NextN's field of
    SGLang's internal_states): why it drafted or not per batch size; no speculation has none."""
    guard = {"R<=16": {"drafting_rounds": 16, "plain_rounds": 9, "drafting_over_plain": 0.91, "choice": "plain"}}
    rec = {"rounds": 40, "guard_by_batch": guard, "rounds_by_guard": {"plain": 20}, "acceptance_by_position": [0.9]}
    info = {"internal_states": [{"last_gen_throughput": 1.0, "nextn_info_record": rec}]}
    got = headline.speculative_record(info)
    assert got == {"rounds": 40, "guard_by_batch": guard, "rounds_by_guard": {"plain": 20}}
    dspark = {"internal_states": [{"dspark_info_record": {"rounds": 3, "skipped_draft_rounds": 1}}]}
    assert headline.speculative_record(dspark) == {"rounds": 3, "skipped_draft_rounds": 1}
    assert headline.speculative_record({"internal_states": [{"last_gen_throughput": 1.0}]}) is None
