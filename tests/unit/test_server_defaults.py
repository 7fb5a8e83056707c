"""Server settings for DeepSeek-V4 resolved by SGLang's own pipeline with the plugin loaded: what we
declare (backend, pages, graphs off, caches in the model dtype, CPU bounds), what a user's explicit
value keeps, and every unsupported setting refused with a message naming the flag. One fresh
interpreter resolves all cases (the plugin patches process-wide state); the NPU-like case, last,
uses `--device npu` with SGLang's NPU memory probe stubbed, since no NPU is here."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# One worker runs the whole module: its fixture (one SGLang import resolving every case, ~40 s on
# the CI machine) would otherwise run once on each xdist worker.
pytestmark = pytest.mark.xdist_group("server_defaults")

RESOLVE = textwrap.dedent("""
    import json, sys
    # the --device npu case: SGLang's NPU defaults read the device memory through torch_npu (the
    # CPU cases never ask)
    import sglang.srt.hardware_backend.npu.utils as nu
    nu.get_npu_memory_capacity = lambda *a, **k: 65536
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.arg_groups.overrides import resolving_view
    out = []
    for args in json.loads(sys.argv[1]):
        try:
            sa = prepare_server_args(args)
            sa.resolve_once()
            v = resolving_view(sa)
            out.append({k: getattr(v, k) for k in (
                "device", "attention_backend", "decode_attention_backend", "page_size", "kv_cache_dtype",
                "max_running_requests", "context_length", "disable_radix_cache", "radix_cache_backend",
                "disable_cuda_graph",
                "speculative_algorithm", "speculative_eagle_topk", "speculative_num_steps",
                "speculative_num_draft_tokens", "disable_overlap_schedule", "tp_size", "ep_size", "enable_dp_lm_head",
                "enable_torch_compile", "torch_compile_max_bs")}
                | {"graphs": [v.cuda_graph_config.decode.backend, v.cuda_graph_config.prefill.backend],
                   "decode_bs": v.cuda_graph_config.decode.bs})
        except Exception as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
    print("RESULT " + json.dumps(out))
""")


def resolve(model, cases):
    """Each case's flags resolved against `model` (a path, or None where the case names its own
    --model-path) in one fresh process: SGLang's resolution is per-process state, and one import
    of SGLang serves every case (an import costs ~15 s on the CI machine)."""
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            RESOLVE,
            json.dumps([(["--model-path", model] if model else []) + ["--dtype", "float32", *c] for c in cases]),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ},
    )
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(line[0][7:]), r.stderr


@pytest.fixture(scope="module")
def cpu_results(tiny_ckpt, tiny_checkpoint, tmp_path_factory):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
    from tiny_llama import write_tiny_llama

    dspark = ["--model-path", tiny_checkpoint("flash", "dspark")]
    llama = ["--model-path", write_tiny_llama(str(tmp_path_factory.mktemp("llama") / "llama"))]
    flash = ["--model-path", tiny_ckpt("flash")]
    others = {  # cases on other checkpoints
        "dspark": [*dspark, "--speculative-algorithm", "DSPARK"],
        "dspark_block6": [*dspark, "--speculative-algorithm", "dspark", "--speculative-dspark-block-size", "6"],
        # DP attention: SGLang's step wants --enable-dp-lm-head for its own head; ours never reads
        # it, so it is declared for the step only
        "dspark_dp_attention": [
            *dspark,
            "--speculative-algorithm",
            "dspark",
            "--tp-size",
            "2",
            "--dp-size",
            "2",
            "--enable-dp-attention",
        ],
        "nextn_on_dspark": [*dspark, "--speculative-algorithm", "nextn"],
        "llama": [*llama, "--page-size", "64", "--kv-cache-dtype", "bf16"],
    }
    cases = {
        "default": [],
        "explicit_256_requests": ["--max-running-requests", "256"],
        "page_256": ["--page-size", "256"],
        "page_64": ["--page-size", "64"],
        "chunk_100": ["--chunked-prefill-size", "100"],
        "chunk_256": ["--chunked-prefill-size", "256"],
        "tp2": ["--tp-size", "2"],
        "tp3": ["--tp-size", "3"],
        "tp2_ep2": ["--tp-size", "2", "--ep-size", "2"],
        "pp2": ["--pp-size", "2"],
        "dp2": ["--dp-size", "2"],
        "attn_dp2": ["--tp-size", "2", "--attn-dp-size", "2"],  # SGLang's newer spelling of the same
        "tp2_dp2_attention": ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"],
        "tp2_dp2_attention_ep2": ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"],
        "dp_attention_nextn": [
            "--tp-size",
            "2",
            "--dp-size",
            "2",
            "--enable-dp-attention",
            "--speculative-algorithm",
            "nextn",
        ],
        "ep2": ["--ep-size", "2"],
        "kv_fp8": ["--kv-cache-dtype", "fp8_e4m3"],
        "tokenizer_workers": ["--tokenizer-worker-num", "2"],
        "nextn_chain": ["--speculative-algorithm", "NEXTN"],
        "nextn_tree": [
            "--speculative-algorithm",
            "nextn",
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "4",
            "--speculative-num-draft-tokens",
            "8",
        ],
        "dspark_topk": ["--speculative-algorithm", "dspark", "--speculative-eagle-topk", "2"],
        "dspark_threshold": ["--speculative-algorithm", "dspark", "--speculative-accept-threshold-acc", "0.5"],
        "dspark_sts_missing": [
            "--speculative-algorithm",
            "dspark",
            "--speculative-dspark-confidence-sts-path",
            "/nonexistent/sts.json",
        ],
        "spec_threshold": ["--speculative-algorithm", "nextn", "--speculative-accept-threshold-single", "0.5"],
        "spec_steps0": [
            "--speculative-algorithm",
            "nextn",
            "--speculative-num-steps",
            "0",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "1",
        ],
        "graph_explicit": ["--cuda-graph-backend-decode", "full"],
        "backend_triton": ["--attention-backend", "triton"],
        "no_radix": ["--disable-radix-cache"],
        "deterministic": ["--enable-deterministic-inference"],
        "other_radix_backend": ["--radix-cache-backend", "flexkv"],
        "compile": ["--enable-torch-compile"],
        "compile_bs": ["--enable-torch-compile", "--cuda-graph-bs-decode", "1", "3"],
        "compile_off": ["--enable-torch-compile", "--disable-cuda-graph"],
        "compile_bs_big": ["--enable-torch-compile", "--cuda-graph-bs-decode", "2", "64"],
        "compile_nextn": ["--enable-torch-compile", "--speculative-algorithm", "nextn"],
        "compile_nextn_tp2": ["--enable-torch-compile", "--speculative-algorithm", "nextn", "--tp-size", "2"],
        "compile_tp2": ["--enable-torch-compile", "--tp-size", "2"],
        "npu_like": ["--device", "npu"],  # last: its NPU settings must not leak into the CPU cases
    }
    cases = {**{k: [*flash, *v] for k, v in cases.items()}, **others}
    results, log = resolve(None, list(cases.values()))
    return dict(zip(cases, results)), log


def test_defaults_on_cpu(cpu_results):
    r, log = cpu_results
    d = r["default"]
    assert d["device"] == "cpu" and d["attention_backend"] == d["decode_attention_backend"] == "dsv4_ascend"
    assert d["page_size"] == 128 and d["kv_cache_dtype"] == "auto"  # not SGLang's fp8_e4m3 default
    assert d["max_running_requests"] == 16 and d["context_length"] == 32768
    assert d["graphs"] == ["disabled", "disabled"]
    # the prefix cache is on, through the plugin's tree (hits resume from saved prefix states)
    assert d["disable_radix_cache"] is False and d["radix_cache_backend"] == "dsv4_ascend"
    assert r["no_radix"]["disable_radix_cache"] is True  # --disable-radix-cache is honoured


def test_cpu_graphs_follow_enable_torch_compile_and_disable_cuda_graph(cpu_results):
    """On CPU, SGLang's CPU graph runner captures iff --enable-torch-compile; DeepSeek-V4 gets a short
    default list of batch sizes (each is compiled at startup), a user's list is kept, and
    --disable-cuda-graph turns capture off whatever else is passed."""
    r, log = cpu_results
    assert r["default"]["enable_torch_compile"] is False
    c = r["compile"]
    assert c["enable_torch_compile"] is True and c["torch_compile_max_bs"] == 4 and c["decode_bs"] == [1, 4], c
    assert r["compile_bs"]["decode_bs"] == [1, 3] and r["compile_bs"]["enable_torch_compile"] is True
    assert r["compile_off"]["enable_torch_compile"] is False, r["compile_off"]
    assert "--disable-cuda-graph: decode graphs off" in log
    # with speculation the worker captures its own verify (spec_graph_sizes reads the flag): SGLang's
    # runner, which would capture a target verify through our backend, stays off
    assert "error" not in r["compile_nextn"] and r["compile_nextn"]["enable_torch_compile"] is False
    assert "the target verify is captured by the speculative worker per batch size (1 4" in log


def test_prefix_cache_stays_on_under_speculation(cpu_results):
    r, _ = cpu_results
    for case in ("nextn_chain", "nextn_tree"):
        assert r[case]["disable_radix_cache"] is False and r[case]["radix_cache_backend"] == "dsv4_ascend", r[case]


def test_explicit_user_values_are_kept_or_logged(cpu_results):
    r, log = cpu_results
    assert r["explicit_256_requests"]["max_running_requests"] == 256  # an explicit 256 is not "unset"
    assert r["page_256"]["page_size"] == 256
    assert "error" not in r["chunk_256"]
    assert r["backend_triton"]["attention_backend"] == "dsv4_ascend"
    assert "attention_backend: your value 'triton' is replaced by 'dsv4_ascend'" in log


@pytest.mark.parametrize(
    "case,flag",
    [
        ("page_64", "--page-size 64: DeepSeek-V4 pages must be a multiple of 128"),
        ("chunk_100", "--chunked-prefill-size 100: must be a multiple of the page size 128"),
        ("tp3", "--tp-size 3: attention TP splits the 4 heads over the ranks"),
        ("pp2", "--pp-size 2:"),
        ("ep2", "--ep-size 2: must divide --tp-size 1"),
        (
            "kv_fp8",
            "--kv-cache-dtype fp8_e4m3: sglang-dsv4-ascend keeps DeepSeek-V4 caches in the model dtype; "
            "supported: auto",
        ),
        ("tokenizer_workers", "--tokenizer-worker-num 2:"),
        ("dspark_topk", "--speculative-eagle-topk 2: DSpark drafts a chain (topk 1)"),
        (
            "dspark_threshold",
            "--speculative-accept-threshold-acc 0.5: the dsv4_ascend DSpark worker accepts losslessly",
        ),
        ("dspark_sts_missing", "--speculative-dspark-confidence-sts-path /nonexistent/sts.json: no such file"),
        (
            "spec_threshold",
            "--speculative-accept-threshold-single 0.5: the dsv4_ascend NextN worker accepts losslessly",
        ),
        ("spec_steps0", "--speculative-num-steps 0: must be >= 1"),
        ("graph_explicit", "--cuda-graph-backend-decode full: graph capture is not supported"),
        ("other_radix_backend", "--radix-cache-backend flexkv: DeepSeek-V4 prefix hits need the plugin's tree"),
        ("deterministic", "--enable-deterministic-inference: SGLang's deterministic mode"),
        ("compile_bs_big", "--cuda-graph-bs-decode 2 64: decode batch sizes must be within 1..16"),
        ("compile_nextn_tp2", "--enable-torch-compile with --tp-size 2: captured DeepSeek-V4 decode is verified"),
        ("compile_tp2", "--enable-torch-compile with --tp-size 2: captured DeepSeek-V4 decode is verified on one"),
    ],
)
def test_unsupported_settings_are_refused_by_name(cpu_results, case, flag):
    r, _ = cpu_results
    assert flag in r[case].get("error", ""), r[case]


def test_tensor_and_expert_parallel_layouts_resolve(cpu_results):
    r, _ = cpu_results
    assert "error" not in r["tp2"] and r["tp2"]["tp_size"] == 2, r["tp2"]
    assert "error" not in r["tp2_ep2"] and r["tp2_ep2"]["ep_size"] == 2, r["tp2_ep2"]
    # plain --dp-size: replicas; --enable-dp-attention with a dp that divides tp: attention TP = tp / dp
    for case in ("dp2", "tp2_dp2_attention", "tp2_dp2_attention_ep2", "attn_dp2", "dp_attention_nextn"):
        assert "error" not in r[case] and r[case]["attention_backend"] == "dsv4_ascend", (case, r[case])


def test_nextn_resolves_with_our_backend_chain_and_tree(cpu_results):
    """SGLang's DeepSeek-V4 step asserts EAGLE with topk == 1 and its EAGLE step refuses topk > 1
    with 128-token pages on our backend: both are for SGLang's own worker, and must not stop ours."""
    r, _ = cpu_results
    chain, tree = r["nextn_chain"], r["nextn_tree"]
    for d in (chain, tree):
        assert "error" not in d, d
        assert d["speculative_algorithm"] == "EAGLE" and d["attention_backend"] == "dsv4_ascend", d
        assert d["page_size"] == 128 and d["disable_overlap_schedule"] is True, d
    assert chain["speculative_eagle_topk"] == 1
    assert chain["speculative_num_draft_tokens"] == chain["speculative_num_steps"] + 1
    assert (tree["speculative_eagle_topk"], tree["speculative_num_steps"], tree["speculative_num_draft_tokens"]) == (
        4,
        3,
        8,
    )


def test_dspark_resolves_on_cpu_with_our_backend(cpu_results):
    """SGLang's DSpark step refuses CPU for its own kernels; ours runs it (hook #10) and keeps what
    it resolves: steps 1, topk 1, draft tokens = gamma + 1 (the checkpoint's 4, or the flag's), also
    under DP attention."""
    r, _ = cpu_results
    res = [r["dspark"], r["dspark_block6"], r["dspark_dp_attention"]]
    assert res[2].get("enable_dp_lm_head") is False, res[2]
    for d, gamma in zip(res, (4, 6, 4)):
        assert "error" not in d, d
        assert d["speculative_algorithm"] == "DSPARK" and d["device"] == "cpu", d
        assert d["attention_backend"] == "dsv4_ascend" and d["disable_overlap_schedule"] is True, d
        assert (d["speculative_num_steps"], d["speculative_eagle_topk"], d["speculative_num_draft_tokens"]) == (
            1,
            1,
            gamma + 1,
        ), d


def test_nextn_refused_on_a_checkpoint_without_a_nextn_block(cpu_results):
    d = cpu_results[0]["nextn_on_dspark"]
    assert "--speculative-algorithm nextn:" in d.get("error", "") and "DSpark draft" in d["error"], d


def test_npu_like_platform_gets_graphs_off_and_our_backend(cpu_results):
    """SGLang turns decode graph capture on by default and pins NPU backends to 'ascend'; the
    dsv4_ascend backend cannot capture yet, so the same command must start with graphs off."""
    r, log = cpu_results
    d = r["npu_like"]
    assert d.get("device") == "npu", d
    assert d["attention_backend"] == d["decode_attention_backend"] == "dsv4_ascend"
    assert d["graphs"] == ["disabled", "disabled"] and d["disable_cuda_graph"] is True
    assert d["kv_cache_dtype"] == "auto" and d["page_size"] == 128
    assert "graph capture disabled for DeepSeek-V4 on npu" in log


def test_other_models_are_left_alone(cpu_results):
    """The DeepSeek-V4 refusals must not leak onto models the plugin does not own."""
    d = cpu_results[0]["llama"]
    assert "error" not in d, d
    assert d["page_size"] == 64 and d["attention_backend"] == "torch_native"
