"""The NextN speculative-decoding benchmark (`python -m sglang_dsv4_ascend.bench spec`), in process
on the tiny model with tiny settings: its JSON holds what the run measured, and the measured
quantities obey what the machinery guarantees (lossless greedy output, maximal acceptance with the
replay drafter in full mode, the rows a node-once or a path-by-path tree verify runs). Timings are never asserted.

The `--server` mode (a real SGLang server per configuration) is not run in CI: it takes minutes of
server startups; it is run by hand (`python -m sglang_dsv4_ascend.bench spec --algo nextn --batch 1
--configs nospec,chain2 --new-tokens 8 --server`).
"""

import contextlib
import io
import json

import pytest

from sglang_dsv4_ascend.bench import spec

ARGS = [
    "--algo",
    "nextn",
    "--batch",
    "1,2",
    "--configs",
    "nospec,chain2,tree2,tree2paths,tree2shapes",
    "--new-tokens",
    "6",
    "--prompt-len",
    "24",
    "--guard",  # every round as configured: the accounting below counts whole shapes
    "off",
]


@pytest.fixture(scope="module")
def report():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert spec.main(ARGS) == 0
    return json.loads(buf.getvalue())


def _rows(report, **match):
    return [r for r in report["results"] if all(r.get(k) == v for k, v in match.items())]


def test_layout(report):
    cfg = report["config"]
    assert report["bench"] == "spec" and cfg["algo"] == "nextn" and cfg["mode"] == "in-process"
    assert cfg["configs"] == {
        "nospec": None,
        "chain2": {"topk": 1, "steps": 2, "draft_tokens": 3},
        "tree2": {"topk": 2, "steps": 3, "draft_tokens": 6},
        "tree2paths": {"topk": 2, "steps": 3, "draft_tokens": 6},
        "tree2shapes": {"topk": 2, "steps": 3, "draft_tokens": 6},
    }
    assert cfg["batch"] == [1, 2] and cfg["new_tokens"] == 6 and cfg["prompt_len"] == 24
    # every (config, drafter, batch) once, no-spec once per batch
    keys = sorted((r["config"], str(r["drafter"]), r["batch"]) for r in report["results"])
    want = sorted(
        [("nospec", "None", b) for b in (1, 2)]
        + [
            (c, d, b)
            for c in ("chain2", "tree2", "tree2paths", "tree2shapes")
            for d in ("nextn", "replay")
            for b in (1, 2)
        ]
    )
    assert keys == want


def test_spec_is_lossless_and_well_formed(report):
    for r in _rows(report):
        if r["config"] == "nospec":
            assert r["tok_s_ratio_to_nospec"] == 1.0 and r["decode_tokens"] == r["batch"] * 5
            continue
        shape = report["config"]["configs"][r["config"]]
        assert r["lossless"] is True, r
        assert isinstance(r["tok_s_ratio_to_nospec"], float) and r["tok_s_ratio_to_nospec"] > 0
        rates = r["accept_rate_by_depth"]
        assert len(rates) == shape["steps"]
        assert all(0.0 <= x <= 1.0 for x in rates)
        assert all(a >= b for a, b in zip(rates, rates[1:])), rates
        # accept length (bonus included) = 1 + sum over depths of the rate of reaching it
        assert r["mean_accept_length"] == pytest.approx(1 + sum(rates), abs=1e-3)
        assert 1.0 <= r["mean_accept_length"] <= shape["steps"] + 1
        if r["config"].endswith("shapes"):  # rounds of each shape: the first ones take the tree and the chain
            assert sum(r["rounds_by_shape"].values()) == r["rounds"] and r["rounds_by_shape"]["tree"] >= 1
            assert r["target_rows_per_round"] == r["verified_tokens_per_round"] <= shape["draft_tokens"]
            continue
        assert r["verified_tokens_per_round"] == shape["draft_tokens"]
        # the rows the engine ran: a node each (chains, node-once trees), or a branching tree path by path
        if r["config"].endswith("paths"):
            assert r["target_rows_per_round"] > r["verified_tokens_per_round"]
        else:
            assert r["target_rows_per_round"] == r["verified_tokens_per_round"]
        # every request needs 5 decode tokens; a round emits at most steps + 1 of them
        assert r["request_rounds"] >= r["batch"] * -(-5 // (shape["steps"] + 1))
        for k in ("draft", "verify", "accept", "extend"):
            assert r[f"{k}_ms_per_round"] >= 0


def test_replay_full_mode_accepts(report):
    for c in ("chain2", "tree2"):
        for r in _rows(report, config=c, drafter="replay"):
            assert r["mean_accept_length"] > 1.5, r
            assert r["accept_rate_by_depth"][0] == 1.0, r


def test_algo_must_be_nextn(capsys):
    with pytest.raises(SystemExit) as e:
        spec.main(["--algo", "eagle3"])
    assert e.value.code == 2
    assert "--algo" in capsys.readouterr().err


def test_unknown_config_is_refused(capsys):
    with pytest.raises(SystemExit):
        spec.main(["--algo", "nextn", "--configs", "chain9"])
    assert "chain9" in capsys.readouterr().err


def test_dspark_bench_measures_static_adaptive_and_nextn_side_by_side():
    """`--algo dspark`: one JSON with no-spec, NextN and DSpark static / adaptive, all lossless; the
    replay drafter (full mode) accepts the whole block; static verifies gamma + 1 rows per request,
    adaptive never more; the two checkpoints share their trunk."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        argv = ["--algo", "dspark", "--batch", "2", "--new-tokens", "6", "--prompt-len", "24", "--guard", "off"]
        assert spec.main(argv) == 0
    doc = json.loads(buf.getvalue())
    assert doc["same_trunk"] is True and doc["cost_model"]["points"]
    g = doc["gamma"]
    rows = {(r["config"], r.get("drafter")): r for r in doc["results"]}
    assert set(rows) >= {
        ("nospec", None),
        (f"nextn_chain{g}", "nextn"),
        ("dspark_static_unguarded", "dspark"),  # --guard off: every round as configured
        ("dspark_static_unguarded", "replay"),
        ("dspark_adaptive_unguarded", "dspark"),
        ("dspark_adaptive_unguarded", "replay"),
    }
    assert all(r.get("lossless", True) for r in doc["results"])
    assert rows[("dspark_static_unguarded", "replay")]["mean_accept_length"] == g + 1
    assert rows[("dspark_static_unguarded", "dspark")]["target_rows_per_round"] == 2 * (g + 1)
    assert rows[("dspark_adaptive_unguarded", "dspark")]["target_rows_per_round"] <= 2 * (g + 1)
    assert {"planner_predicted_tok_s", "measured_round_ms", "skipped_draft_rounds"} <= set(
        rows[("dspark_adaptive_unguarded", "replay")]
    )


def test_dspark_bench_runs_the_guard_beside_its_absence_on_a_draft_that_is_never_right():
    """`--guard on,off` with the zero-acceptance replay drafter: both rows lossless; without the
    guard every round verifies the whole block and accepts nothing; with it the guard's classes
    are reported and its first rounds drafted."""
    buf = io.StringIO()
    argv = ["--algo", "dspark", "--batch", "2", "--new-tokens", "12", "--prompt-len", "24"]
    argv += ["--verify", "static", "--drafters", "replay-zero", "--guard", "on,off"]
    with contextlib.redirect_stdout(buf):
        assert spec.main(argv) == 0
    doc = json.loads(buf.getvalue())
    assert doc["config"]["guard"] == ["on", "off"]
    rows = {r["config"]: r for r in doc["results"] if r.get("drafter") == "replay-zero"}
    on, off, g = rows["dspark_static"], rows["dspark_static_unguarded"], doc["gamma"]
    assert on["lossless"] is True and off["lossless"] is True
    assert off["mean_accept_length"] == 1.0 and off["verified_drafts_per_request_round"] == g
    assert "guard_by_batch" not in off and on["guard_by_batch"]["R<=2"]["drafting_rounds"] >= 4


def test_bench_spec_refuses_a_bad_guard(capsys):
    with pytest.raises(SystemExit):
        spec.main(["--algo", "nextn", "--guard", "on,off"])
    assert "both side by side with --algo dspark only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        spec.main(["--algo", "dspark", "--guard", "maybe"])
    assert "--guard 'maybe': on, off or on,off" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--graph", "--parts", "decode,graphs"], "--parts decode,graphs: expected some of decode,verify,draft"),
        (["--graph", "--parts", "draft", "--model", "flash"], "the shipped model only"),
    ],
)
def test_bench_step_graph_refuses_parts_it_cannot_run(argv, says, capsys):
    from sglang_dsv4_ascend.bench import step

    with pytest.raises(SystemExit):
        step.main(argv)
    assert says in capsys.readouterr().err
