"""Server settings for DeepSeek-V4 under this plugin: what we declare, what we refuse.

Three SGLang seams, all registered in components.py:
* `checkpoint_checks` — a resolution hook after `handle_model_source_paths`: a local DeepSeek-V4
  checkpoint is validated with our messages (config fields, tokenizer files, quantization
  files) before transformers or SGLang read it and fail with messages that point elsewhere.
* `dsv4_overrides` — a model-override provider for `DeepseekV4ForCausalLM` (registered after
  SGLang's own, so ours wins): our backend, 128-token pages, SGLang's hybrid-SWA pools off, and
  our radix cache (`--radix-cache-backend dsv4_ascend`, declared in `model_adjustments`).
* `model_adjustments` — a resolution hook around `handle_model_specific_adjustments` (the
  override gate does not accept every field): refuses settings this plugin cannot serve yet,
  naming the flag and what is supported, before SGLang's own DeepSeek-V4 step turns them into a
  shape error or a bare assertion; then declares the remaining defaults (graph capture off,
  caches in the model dtype, CPU bounds).

Explicit user values are never replaced silently: a value that cannot work is refused, one we
replace is logged with the user's value and ours.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

from .. import settings
from ..checkpoint import DESCRIPTION_FILE, is_dsv4_architectures, is_dsv4_config, tensor_names
from ..config import DSV4Config
from ..names import (
    BACKEND_NAME,
    CPU_DSV4_MAX_RUNNING_REQUESTS,
    CPU_MAX_TOTAL_TOKENS,
    DSPARK_ALGO,
    PAGE_SIZE,
    QUANT_METHOD,
    RADIX_BACKEND,
    SPEC_ALGOS,
)

logger = logging.getLogger("sglang_dsv4_ascend")
SGLANG_COMPILE_MAX_BS = 32  # SGLang's default --torch-compile-max-bs (taken as "not set")
# Our default decode sizes on CPU: each is compiled at startup (about 4 minutes for the shipped
# model on 2 cores, `bench step --graph`); 2 and 3 requests are padded to 4, more run eager.
CPU_GRAPH_BS = (1, 4)


def _raw(server_args, name):
    """What the user passed (None when unset), before any declaration."""
    return getattr(server_args, name, None)


def _log_replaced(server_args, ours: dict) -> None:
    for name, value in ours.items():
        user = _raw(server_args, name)
        if user is not None and user != value:
            logger.info("dsv4_ascend: %s: your value %r is replaced by %r for DeepSeek-V4", name, user, value)


def dsv4_overrides(server_args, hf_config) -> dict:
    """Model-override provider: runs after SGLang's own DeepSeek-V4 provider and replaces its
    `dsv4` backend and 256-token pages."""
    user_page = _raw(server_args, "page_size")
    out = {
        "attention_backend": BACKEND_NAME,
        "prefill_attention_backend": BACKEND_NAME,
        "decode_attention_backend": BACKEND_NAME,
        "page_size": user_page or PAGE_SIZE,  # an explicit multiple of 128 is kept (checked before)
        # Our cache keeps DSV4 state per request slot; SGLang's hybrid-SWA pools would size and
        # evict a second, unused copy.
        "disable_hybrid_swa_memory": True,
    }
    _log_replaced(server_args, out)
    return out


def unsupported_settings(server_args, hf=None) -> list[str]:
    """Messages for every explicit setting DeepSeek-V4 cannot be served with here, each naming
    the flag, the value and what is supported. Reads user input and resolved fields alike.
    `hf`: the checkpoint's config, for the checks of how it splits over ranks."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    out = []

    def need(ok, msg):
        if not ok:
            out.append(msg)

    need(
        cfg.pp_size == 1,
        f"--pp-size {cfg.pp_size}: pipeline parallelism is not supported for DeepSeek-V4; supported: 1",
    )
    # SGLang 0.5.23 turns `--dp-size D --enable-dp-attention` into `--attn-dp-size D` (dp_size 1)
    # before this runs; plain `--dp-size` (replicas) is left to SGLang.
    dp = max(getattr(cfg, "attn_dp_size", 1) or 1, 1)
    dp_attn = dp > 1 or bool(cfg.enable_dp_attention)
    if hf is not None and (cfg.tp_size > 1 or cfg.ep_size > 1 or dp_attn):
        from ..distributed.layout import layout_problems  # imports torch

        out += layout_problems(hf, cfg.tp_size, cfg.ep_size, dp, dp_attn)
        need(
            cfg.quantization != QUANT_METHOD or cfg.ep_size == cfg.tp_size,
            f"--quantization {QUANT_METHOD} with --tp-size {cfg.tp_size} --ep-size {cfg.ep_size}: W8A8 routed experts "
            f"are split by expert only (splitting one expert's intermediate dimension would change its per-token "
            f"activation scale); use --ep-size {cfg.tp_size}",
        )
    need(
        not getattr(cfg, "enable_deterministic_inference", False),
        "--enable-deterministic-inference: SGLang's deterministic mode (its batch-invariant kernels, "
        "split sizes and seeded sampling) is not implemented by the dsv4_ascend backend. Without the flag, "
        "a bf16 model's greedy tokens were the same alone, batched and with speculation in every check on the "
        "CPU reference (tests/unit/test_logits_numerics.py, tests/e2e/test_bf16_lossless.py); in fp32, and "
        "on an NPU, that is not established. Drop the flag",
    )
    need(
        cfg.kv_cache_dtype == "auto",
        f"--kv-cache-dtype {cfg.kv_cache_dtype}: sglang-dsv4-ascend keeps DeepSeek-V4 caches in the model "
        "dtype; supported: auto",
    )
    need(
        (cfg.tokenizer_worker_num or 1) == 1,
        f"--tokenizer-worker-num {cfg.tokenizer_worker_num}: extra tokenizer workers do not load SGLang "
        "plugins, so the request validation that keeps bad requests from crashing the DeepSeek-V4 "
        "scheduler would be missing there; supported: 1",
    )
    backend = _raw(server_args, "radix_cache_backend")
    need(
        backend in (None, RADIX_BACKEND) or cfg.disable_radix_cache,
        f"--radix-cache-backend {backend}: DeepSeek-V4 prefix hits need the plugin's tree, which resumes "
        f"a hit from its saved window and compressor state; supported: {RADIX_BACKEND} (the default), or "
        "--disable-radix-cache",
    )
    out += speculative_problems(cfg)
    out += graph_problems(cfg, server_args)
    for flag, name in (
        ("--cuda-graph-backend-decode", "cuda_graph_backend_decode"),
        ("--cuda-graph-backend-prefill", "cuda_graph_backend_prefill"),
    ):
        value = _raw(server_args, name)
        need(
            value in (None, "disabled"),
            f"{flag} {value}: graph capture is not supported by the dsv4_ascend "
            "backend yet; supported: disabled (the default for DeepSeek-V4)",
        )
    page = _raw(server_args, "page_size")
    need(
        page is None or (page > 0 and page % PAGE_SIZE == 0),
        f"--page-size {page}: DeepSeek-V4 pages must be a multiple of {PAGE_SIZE} tokens (every compressed "
        f"entry must stay inside one page); use {PAGE_SIZE}, {2 * PAGE_SIZE}, ... or leave it unset ({PAGE_SIZE})",
    )
    chunk = _raw(server_args, "chunked_prefill_size")
    page = page or PAGE_SIZE
    need(
        chunk is None or chunk == -1 or (chunk > 0 and chunk % page == 0),
        f"--chunked-prefill-size {chunk}: must be a multiple of the page size {page} that sglang-dsv4-ascend "
        f"uses for DeepSeek-V4 (e.g. {page}, {16 * page}), or -1 to disable chunking",
    )
    return out


@contextlib.contextmanager
def declared_during(server_args, source: str, during: dict, after: dict):
    """Declare `during` for the body (SGLang's own step that must not see our values), then
    `after` (ours back: the last declaration wins)."""
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(server_args, source, **during)
    try:
        yield
    finally:
        declare_resolution(server_args, source, **after)


def speculative_problems(cfg) -> list[str]:
    """What the speculative worker cannot serve, checked before SGLang's own DeepSeek-V4 and speculative
    steps (which see the NEXTN alias and a topk not chosen yet). The final step / topk / draft-token
    values are checked again by the worker at startup, after SGLang picks its defaults."""
    algo = str(cfg.speculative_algorithm or "").upper()
    if not algo:
        return []
    out = []

    def need(ok, msg):
        if not ok:
            out.append(msg)

    flag = f"--speculative-algorithm {cfg.speculative_algorithm}"
    need(
        algo in SPEC_ALGOS,
        f"{flag}: sglang-dsv4-ascend serves DeepSeek-V4 with nextn (its alias eagle) or dspark speculation",
    )
    dspark = algo == DSPARK_ALGO
    worker = "DSpark" if dspark else "NextN"
    for name in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
        value = getattr(cfg, name, 1.0)
        need(
            value in (None, 1.0),
            f"--{name.replace('_', '-')} {value}: the dsv4_ascend {worker} worker accepts "
            "losslessly only (greedy match / exact rejection sampling); supported: 1.0",
        )
    steps, topk = cfg.speculative_num_steps, cfg.speculative_eagle_topk
    if dspark:
        from ..speculative.planner import verify_mode  # imports torch

        gamma = getattr(cfg, "speculative_dspark_block_size", None)
        need(gamma is None or gamma >= 1, f"--speculative-dspark-block-size {gamma}: must be >= 1")
        need(topk in (None, 1), f"--speculative-eagle-topk {topk}: DSpark drafts a chain (topk 1)")
        try:
            verify_mode()
        except ValueError as e:
            out.append(str(e))
        for name in ("speculative_dspark_sps_table_path", "speculative_dspark_confidence_sts_path"):
            path = getattr(cfg, name, None)
            need(not path or os.path.isfile(path), f"--{name.replace('_', '-')} {path}: no such file")
    else:
        need(steps is None or steps >= 1, f"--speculative-num-steps {steps}: must be >= 1")
        need(topk is None or topk >= 1, f"--speculative-eagle-topk {topk}: must be >= 1 (1 = chain, > 1 = tree)")
        need(
            not getattr(cfg, "enable_multi_layer_eagle", False),
            "--enable-multi-layer-eagle: DeepSeek-V4 checkpoints have one NextN block (chained); drop the flag",
        )
    if algo in SPEC_ALGOS:
        missing = _checkpoint_lacks_draft(cfg.model_path, "dspark" if dspark else "nextn")
        need(not missing, f"{flag}: {missing}")
    return out


def _checkpoint_lacks_draft(model_path, kind: str) -> str | None:
    """A reason when a local checkpoint has no draft of `kind` ("nextn": `mtp.0.e_proj.weight`,
    "dspark": `mtp.0.main_proj.weight`), else None."""
    if not model_path or not os.path.isdir(model_path):
        return None  # a hub id: the loader reports missing tensors by name
    try:
        names = tensor_names(model_path)
    except (OSError, ValueError, KeyError) as e:
        return f"cannot list the tensors of {model_path} ({e})"
    has = {"nextn": "mtp.0.e_proj.weight" in names, "dspark": "mtp.0.main_proj.weight" in names}
    if has[kind]:
        return None
    found = (
        "a NextN block (mtp.0.e_proj)"
        if has["nextn"]
        else "a DSpark draft (mtp.*.main_proj)"
        if has["dspark"]
        else "no draft layers"
    )
    if kind == "nextn":
        return (
            f"{model_path} has {found}, not a NextN block (mtp.0.e_proj, mtp.0.h_proj, ...); use a checkpoint "
            "with num_nextn_predict_layers >= 1 and its mtp.0 tensors, or --speculative-algorithm dspark on a "
            "DSpark checkpoint"
        )
    return (
        f"{model_path} has {found}, not a DSpark draft (mtp.0.main_proj, mtp.2.markov_head, ...); use a "
        "DSpark checkpoint (dspark_* config fields and mtp.0..2), or --speculative-algorithm nextn on an MTP one"
    )


def graph_problems(cfg, server_args) -> list[str]:
    """Graph capture on CPU (under --enable-torch-compile: SGLang's CPU graph runner for the plain
    decode, the speculative worker for its target verify) covers one rank; what it does not cover
    is refused by flag."""
    compile_on = cfg.enable_torch_compile or _raw(server_args, "enable_torch_compile")
    if cfg.device != "cpu" or not compile_on or _graphs_turned_off(server_args):
        return []
    out = []
    dp = max(getattr(cfg, "attn_dp_size", 1) or 1, 1)
    if cfg.tp_size > 1 or dp > 1 or cfg.enable_dp_attention:
        out.append(
            f"--enable-torch-compile with --tp-size {cfg.tp_size}"
            + (" --enable-dp-attention" if dp > 1 or cfg.enable_dp_attention else "")
            + ": captured DeepSeek-V4 decode is verified on one rank only; supported: --tp-size 1"
        )
    bs = _raw(server_args, "cuda_graph_bs_decode")
    cap = cfg.max_running_requests or CPU_DSV4_MAX_RUNNING_REQUESTS
    if bs and (min(bs) < 1 or max(bs) > cap):
        out.append(
            f"--cuda-graph-bs-decode {' '.join(map(str, bs))}: decode batch sizes must be within 1.."
            f"{cap} (--max-running-requests); a larger one would never run and its capture costs minutes"
        )
    return out


def spec_graph_sizes(server_args, device: str) -> tuple:
    """The batch sizes whose target verify the speculative worker captures (read in the worker's
    process from the record SGLang passes it, which keeps what the user gave; `device`: the type
    the worker runs on, since the record's --device may be unset): on CPU under
    --enable-torch-compile, on CUDA / NPU under SGLANG_DSV4_DEVICE_GRAPHS=1 (device_graph.py,
    unverified there), the decode sizes (--cuda-graph-bs-decode, else CPU_GRAPH_BS); () when
    graphs are off."""
    if _graphs_turned_off(server_args):
        return ()
    if device in ("cuda", "npu"):
        if not settings.DEVICE_GRAPHS.get():
            return ()
    elif device != "cpu" or not _raw(server_args, "enable_torch_compile"):
        return ()
    return tuple(sorted(set(_raw(server_args, "cuda_graph_bs_decode") or CPU_GRAPH_BS)))


def _graphs_turned_off(server_args) -> bool:
    return bool(_raw(server_args, "disable_cuda_graph") or _raw(server_args, "disable_decode_cuda_graph"))


def _graph_declarations(server_args) -> dict:
    """On CPU: decode graphs (SGLang's CPU graph runner, torch.compile per batch size) when
    --enable-torch-compile is given, off when --disable-cuda-graph is, with a short default list
    of batch sizes (each one is compiled at startup). Elsewhere: graph capture off (the NPU and
    CUDA graph runners have never run the dsv4_ascend backend)."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    cfg = resolving_view(server_args)
    out = {}
    if cfg.device == "cpu" and cfg.enable_torch_compile and _graphs_turned_off(server_args):
        logger.info("dsv4_ascend: --disable-cuda-graph: decode graphs off, --enable-torch-compile ignored")
        out["enable_torch_compile"] = False
    elif cfg.device == "cpu" and cfg.enable_torch_compile and cfg.speculative_algorithm:
        # SGLang's runner would capture its target verify through our backend, which the
        # speculative worker never replays: the worker captures its own (spec_graph_sizes).
        out["enable_torch_compile"] = False
        logger.info(
            "dsv4_ascend: --enable-torch-compile with speculation on CPU: the target verify is captured by "
            "the speculative worker per batch size (%s), and so is the draft (the DSpark block, NextN's "
            "steps); each graph is compiled at startup (minutes with inductor's cache cold, seconds warm); "
            "--disable-cuda-graph to run eager",
            " ".join(map(str, spec_graph_sizes(server_args, cfg.device))),
        )
    elif cfg.device == "cpu" and cfg.enable_torch_compile:
        if _raw(server_args, "cuda_graph_bs_decode") is None and cfg.torch_compile_max_bs == SGLANG_COMPILE_MAX_BS:
            # SGLang's CPU list (1..16, then every 2nd, 4th, 8th up to 32) would compile 24 sizes.
            cap = cfg.max_running_requests or CPU_DSV4_MAX_RUNNING_REQUESTS
            sizes = [b for b in CPU_GRAPH_BS if b <= cap]
            out["torch_compile_max_bs"] = n = max(sizes)
            out["cuda_graph_config"] = with_phase(cfg.cuda_graph_config, Phase.DECODE, bs=sizes, max_bs=n)
        logger.info(
            "dsv4_ascend: decode graphs on CPU (torch.compile per batch size: %s; each is compiled at "
            "startup, minutes each with inductor's cache cold, seconds warm: --cuda-graph-bs-decode to choose "
            "them, --disable-cuda-graph to run eager)",
            out["cuda_graph_config"].decode.bs if "cuda_graph_config" in out else "as given",
        )
        return out
    # The phase backends only steer the NPU / CUDA runners (on CPU capture follows
    # --enable-torch-compile alone); declared off everywhere else so the resolved settings say so.
    graphs = cfg.cuda_graph_config
    if graphs is None or all(getattr(graphs, p).backend == Backend.DISABLED for p in Phase.ALL):
        return out
    for phase in Phase.ALL:
        graphs = with_phase(graphs, phase, backend=Backend.DISABLED)
    if cfg.device != "cpu":
        logger.info(
            "dsv4_ascend: graph capture disabled for DeepSeek-V4 on %s (SGLang's graph runner there has not "
            "run the dsv4_ascend backend; CPU graphs: --enable-torch-compile)",
            cfg.device,
        )
    return {**out, "cuda_graph_config": graphs, "disable_cuda_graph": True}


def model_adjustments(server_args, previous):
    """Resolution hook around `handle_model_specific_adjustments`."""
    from sglang.srt.arg_groups.overrides import declare_resolution, model_config_of, resolving_view

    cfg = resolving_view(server_args)
    hf = model_config_of(server_args).hf_config
    if not is_dsv4_architectures(getattr(hf, "architectures", None)):
        return previous(server_args)
    problems = unsupported_settings(server_args, hf)
    if problems:
        raise ValueError("sglang-dsv4-ascend cannot serve DeepSeek-V4 with these settings:\n  " + "\n  ".join(problems))
    decl = {}
    if not cfg.disable_radix_cache:
        # SGLang's tree shares the token slots that carry the compressed entries; ours reports
        # hits only up to a page boundary whose prefix state (window + open compressor rows) was
        # saved (attention_backend/radix.py). Not model-overridable, so declared here.
        decl["radix_cache_backend"] = RADIX_BACKEND
    if cfg.device == "cpu":
        if cfg.context_length is None:
            cap = cfg.max_total_tokens or CPU_MAX_TOTAL_TOKENS
            decl["context_length"] = int(min(getattr(hf, "max_position_embeddings", cap), cap))
        if cfg.max_running_requests is None:  # read before SGLang's DeepSeek-V4 step defaults it to 256
            decl["max_running_requests"] = CPU_DSV4_MAX_RUNNING_REQUESTS
    algo = cfg.speculative_algorithm
    if algo:
        # SGLang's DeepSeek-V4 step runs before its speculative step has resolved the NEXTN alias
        # and chosen a topk, and asserts algorithm in (EAGLE, DSPARK) and topk == 1: its checks
        # are for its own worker. Ours were made above (speculative_problems), so that step runs
        # with the algorithm hidden, and the user's value is declared back right after (the last
        # declaration wins).
        with declared_during(
            server_args,
            "sglang_dsv4_ascend.hide_spec",
            {"speculative_algorithm": None},
            {"speculative_algorithm": algo},
        ):
            previous(server_args)
    else:
        previous(server_args)
    if algo:
        # The worker runs rounds synchronously (SGLang declares this on CPU for EAGLE, not for DSPARK).
        decl["disable_overlap_schedule"] = True
    if cfg.device == "cpu" and str(getattr(cfg, "disaggregation_mode", "null")) != "null":
        # SGLang's overlapped PD loops record CUDA events (prefill.py maybe_send_cached_prefix_chunk):
        # on CPU the prefill side died at its first radix hit.
        decl["disable_overlap_schedule"] = True
    # SGLang's DeepSeek-V4 step turns "auto" into fp8_e4m3 (bfloat16 on NPU) for its own pools;
    # ours keep the model dtype, so the resolved value says so.
    decl["kv_cache_dtype"] = "auto"
    decl.update(_graph_declarations(server_args))
    if cfg.device == "cpu" and "context_length" in decl:
        logger.info(
            "dsv4_ascend on CPU: context_length=%s max_running_requests=%s (pass the flags to change)",
            decl["context_length"],
            decl.get("max_running_requests", cfg.max_running_requests),
        )
    declare_resolution(server_args, "sglang_dsv4_ascend", **decl)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def checkpoint_problems(raw: dict, model_dir: str, cfg) -> list[str]:
    """What is wrong with a local DeepSeek-V4 checkpoint for the settings `cfg`, one message each."""
    out = []
    overrides = getattr(cfg, "json_model_override_args", None) or "{}"
    try:
        overrides = json.loads(overrides) if isinstance(overrides, str) else dict(overrides)
    except (ValueError, TypeError):
        overrides = {}  # SGLang's own parser reports a malformed value
    try:
        DSV4Config.from_hf({**raw, **overrides} if isinstance(overrides, dict) else raw)
    except ValueError as e:
        # A field set by the flag (e.g. index_topk_freq) is named with the flag, not the file.
        bad = [k for k in overrides if isinstance(overrides, dict) and f"{k}=" in str(e)]
        where = "--json-model-override-args" if bad else os.path.join(model_dir, "config.json")
        out.append(f"{where}: {e}")
    tok_dir = cfg.tokenizer_path or model_dir
    if (
        not cfg.skip_tokenizer_init
        and os.path.isdir(tok_dir)
        and not any(os.path.exists(os.path.join(tok_dir, f)) for f in TOKENIZER_FILES)
    ):
        out.append(
            f"tokenizer: none of {' / '.join(TOKENIZER_FILES)} in {tok_dir} (pass --tokenizer-path DIR, or "
            "--skip-tokenizer-init and send input_ids)"
        )
    quant, has_description = cfg.quantization, os.path.exists(os.path.join(model_dir, DESCRIPTION_FILE))
    if raw.get("quantization_config"):
        method = (
            raw["quantization_config"].get("quant_method", "?") if isinstance(raw["quantization_config"], dict) else "?"
        )
        out.append(
            f"config.json quantization_config ({method}): FP8 / FP4 released weights are not supported by "
            "sglang-dsv4-ascend yet; use a bf16 checkpoint or a ModelSlim W8A8 one"
        )
    if quant == QUANT_METHOD and not has_description:
        out.append(
            f"--quantization {QUANT_METHOD}: {model_dir} has no {DESCRIPTION_FILE}, so it is not a ModelSlim W8A8 "
            "checkpoint; write one with `python -m sglang_dsv4_ascend.tools.quantize_w8a8 IN_DIR OUT_DIR`, "
            "or drop the flag to serve the float weights"
        )
    elif quant not in (None, QUANT_METHOD):
        out.append(
            f"--quantization {quant}: not supported for DeepSeek-V4 by sglang-dsv4-ascend; supported: {QUANT_METHOD} "
            f"(a ModelSlim W8A8 checkpoint with {DESCRIPTION_FILE}) or none (bf16 / fp16 / fp32 weights)"
        )
    return out


def checkpoint_checks(server_args, previous):
    """Resolution hook around `handle_model_source_paths` (model path resolved, nothing parsed)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    previous(server_args)
    cfg = resolving_view(server_args)
    config_file = os.path.join(cfg.model_path, "config.json")
    if not os.path.isfile(config_file):
        return  # a hub id or a remote store: SGLang resolves it, our model validates at load
    try:
        with open(config_file) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file}: not readable JSON ({e})") from e
    if not is_dsv4_config(raw):
        return
    problems = checkpoint_problems(raw, cfg.model_path, cfg)
    if problems:
        raise ValueError(
            f"sglang-dsv4-ascend cannot serve the DeepSeek-V4 checkpoint at {cfg.model_path}:\n  "
            + "\n  ".join(problems)
        )
