"""NextN speculative decoding (chain and tree) on the tiny DeepSeek-V4: acceptance, verify cost and
decode speed per configuration, drafter and batch size, as ratios to no-spec measured in the same run.

    python -m sglang_dsv4_ascend.bench spec --algo nextn [--model random|trained] [--preset flash|pro] [--batch 1,8]
        [--configs nospec,chain1,chain2,chain3,tree2,tree4] [--new-tokens 32] [--prompt-len 64]
        [--drafters nextn,replay] [--threads N] [--server]

Configurations (CONFIGS): chainK = topk 1, K steps, K + 1 draft tokens; tree2 = topk 2, 3 steps, 6
draft tokens; tree4 = topk 4, 3 steps, 8 draft tokens; tree2paths / tree4paths the same trees
verified path by path (SGLANG_DSV4_TREE_VERIFY=paths) instead of node-once; tree2shapes the
topk-2 tree with each round's shape (tree, chain, no draft) chosen per round
(SGLANG_DSV4_NEXTN_SHAPE=adaptive, seeded untimed as the server seeds it). "nospec" is always
run: it is the baseline of the ratios, of the lossless check and of the replay references. Drafters: "nextn" is the
checkpoint's NextN block (`--model trained`: the shipped trained tiny model's; `random`: random
weights, acceptance near zero, recorded anyway); "replay" is the
test drafter (speculative/drafters.py) in "full" mode, fed the no-spec greedy outputs, so it
proposes the right tokens and acceptance is maximal: it bounds what the spec machinery costs.

Prompts: the packaged gsm8k / humaneval / mt-bench sets (first turns, taken round-robin), tokenized
with the checkpoint's tokenizer (transformers AutoTokenizer, BOS included) and cut to
`--prompt-len` tokens; prompts shorter than that are skipped, so every request has the same length.
Decoding is greedy and ignores EOS: every request gets `--new-tokens` tokens.

In process (default): the model, the NextN block and speculative/engine.NextNEngine (the round the
server's worker runs), with a fresh cache per run, after an untimed warm-up (a few tokens of every
configuration at every batch size: TorchScript profiles its first runs). One forward prefills the batch (untimed, its
last rows give each request's first token); then no-spec is a greedy loop of one forward of B
one-token segments per step, and spec is NextNEngine rounds, a request leaving the batch once it
has its tokens. tok/s = decode tokens (new_tokens - 1 per request: the first comes from the
prefill) / decode wall time. Per round: draft / verify / accept / extend wall time (the engine's
timings, ms per batch round); per request-round: accept length (bonus included), how deep the
accepted path reached, verified tokens (tree nodes incl. root) and target rows (the engine's count: the tree's nodes
node-once, the sum over leaves of depth + 1 path by path). `lossless`: the greedy
spec output equals the no-spec one token for token for every request (the no-spec reference is
decoded `max steps` tokens further, so a last round's overshoot is checked too). Reported, never
asserted here (tests/unit/test_bench_spec.py asserts it).

`--guard on|off` (default on, as served; `on,off` side by side with `--algo dspark`): the
speculation guard (speculative/guard.py) in every spec run, its plain step timed (untimed) first as
the worker does; a short run is mostly its learning rounds.

`--server`: per configuration and drafter a real SGLang server (tools/server.SGLangServer, started
and stopped each time; the replay drafter through SGLANG_DSV4_TEST_DRAFTER=replay:FILE, its
references being the no-spec server's outputs), one untimed warm-up request, then the batch sent
concurrently (one thread per request). From meta_info: completion_tokens, spec_verify_ct,
spec_accept_length and spec_correct_drafts_histogram; tok/s = completion tokens / wall time of the
batch (prefill included, which a server does not separate). `--threads` sets this process's torch
threads only, not the server's.

Progress lines go to stderr, the JSON document to stdout. Timings are measurements of one run on
this machine (noisy at a few ms per round: compare within a run), not checked against anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time

import torch

from .. import settings
from . import spec_dspark
from .spec_common import InProcess, drafter_factory, log, mean, prompt_ids, replay_file, rounded

# name -> (topk, num_steps, num_draft_tokens); None = no speculation
CONFIGS = {
    "nospec": None,
    "chain1": (1, 1, 2),
    "chain2": (1, 2, 3),
    "chain3": (1, 3, 4),
    "tree2": (2, 3, 6),
    "tree4": (4, 3, 8),
    "tree2paths": (2, 3, 6),
    "tree4paths": (4, 3, 8),
    "tree2shapes": (2, 3, 6),
}
# verified path by path (SGLANG_DSV4_TREE_VERIFY=paths), beside the node-once default
PATHS = ("tree2paths", "tree4paths")
# the round's shape (tree, chain, no draft) chosen per round (SGLANG_DSV4_NEXTN_SHAPE=adaptive)
SHAPES = ("tree2shapes",)
DRAFTERS = ("nextn", "replay")

IN_PROCESS_METRICS = {
    "mean_accept_length": "tokens emitted per request-round (accepted drafts + bonus)",
    "accept_rate_by_depth": "[k-1]: fraction of request-rounds whose accepted path reached depth >= k",
    "verified_tokens_per_round": "draft-tree nodes incl. the root, per request-round",
    "target_rows_per_round": "target rows the verify ran (the engine's count), per request-round: the tree's nodes "
    "(node-once), or for the *paths configurations one segment per root-to-leaf path (sum of depth + 1 over leaves)",
    "<stage>_ms_per_round": "engine round timings (draft, plan, verify, accept, commit, extend), ms per batch round",
    "lossless": "greedy spec output == no-spec output for every request",
}
SERVER_METRICS = {
    "spec_accept_length": "completion_tokens / spec_verify_ct, summed over the batch (counts the prefill's "
    "token; the server's own per-request field counts verify-round tokens only)",
    "spec_correct_drafts_histogram": "rounds by accepted drafts (0..steps), summed over the batch",
    "mean_accept_length": "from the histogram: 1 + mean accepted drafts per round",
    "accept_rate_by_depth": "from the histogram: [k-1] = fraction of rounds accepting >= k drafts",
    "lossless": "spec output_ids == the no-spec server's output_ids for every request",
}
ALGOS = ("nextn", "dspark")


def _depth_rates(depths, steps: int) -> list:
    """For k = 1..steps: the fraction of request-rounds whose accepted path reached depth >= k."""
    return [round(sum(d >= k for d in depths) / len(depths), 4) for k in range(1, steps + 1)]


def run_in_process(
    ckpt: str, workdir: str, batches, configs, drafters, new_tokens: int, prompt_len: int, guard_on: bool = True
) -> list:
    spec_cfgs = [c for c in configs if CONFIGS[c] is not None]
    extra = max([CONFIGS[c][1] for c in spec_cfgs], default=0)
    max_len = prompt_len + new_tokens + extra + 2
    ip = InProcess(ckpt)
    ip.guard = guard_on
    all_prompts = prompt_ids(ckpt, max(batches), prompt_len)
    # warm-up (untimed): the first forwards of a shape pay one-time costs (TorchScript profiling)
    for B in batches:
        ip.nospec(all_prompts[:B], 3, 3, max_len)
        for c in spec_cfgs:
            ip.spec(
                all_prompts[:B], CONFIGS[c], drafter_factory("nextn", None), 3, max_len, c not in PATHS, c in SHAPES
            )
    log(f"warm-up done ({', '.join(configs)} at batch {batches})")
    results = []
    for B in batches:
        prompts = all_prompts[:B]
        base = ip.nospec(prompts, new_tokens, new_tokens + extra, max_len)
        refs = base["outputs"]
        base_tok = B * base["steps"]
        base_tps = base_tok / base["decode_s"]
        results.append(
            {
                "config": "nospec",
                "drafter": None,
                "batch": B,
                "decode_tokens": base_tok,
                "decode_s": rounded(base["decode_s"], 4),
                "tok_s": rounded(base_tps, 1),
                "tok_s_ratio_to_nospec": 1.0,
            }
        )
        log(f"batch {B} nospec: {base_tps:.1f} tok/s")
        replay = replay_file(workdir, prompts, refs, f"b{B}")
        for c in spec_cfgs:
            topk, steps, ndraft = CONFIGS[c]
            for dr in drafters:
                s = ip.spec(
                    prompts, CONFIGS[c], drafter_factory(dr, replay), new_tokens, max_len, c not in PATHS, c in SHAPES
                )
                tps = base_tok / s["decode_s"]
                lossless = all(o == ref[: len(o)] for o, ref in zip(s["outputs"], refs))
                n = s["rounds"]
                row = {
                    "config": c,
                    "drafter": dr,
                    "batch": B,
                    "topk": topk,
                    "steps": steps,
                    "draft_tokens": ndraft,
                    "rounds": n,
                    "request_rounds": len(s["accept"]),
                    "mean_accept_length": rounded(mean(s["accept"]), 4),
                    "accept_rate_by_depth": _depth_rates(s["depths"], steps),
                    "verified_tokens_per_round": rounded(mean(s["verified"]), 4),
                    "target_rows_per_round": rounded(mean(s["rows"]), 4),
                    **{f"{k}_ms_per_round": rounded(v * 1e3 / n, 3) for k, v in s["timings"].items()},
                    "decode_tokens": base_tok,
                    "decode_s": rounded(s["decode_s"], 4),
                    "tok_s": rounded(tps, 1),
                    "tok_s_ratio_to_nospec": rounded(tps / base_tps, 3),
                    "lossless": lossless,
                }
                if c in SHAPES:
                    row["rounds_by_shape"] = s["shapes"]
                results.append(row)
                log(
                    f"batch {B} {c} {dr}: accept {row['mean_accept_length']}, {row['tok_s']} tok/s "
                    f"(x{row['tok_s_ratio_to_nospec']}), lossless {lossless}"
                )
    return results


def _server_batch(srv, prompts, max_new_tokens: int):
    outs = [None] * len(prompts)
    errors = []

    def one(i):
        try:
            outs[i] = srv.generate(prompts[i], max_new_tokens, temperature=0, ignore_eos=True)
        except Exception as e:  # noqa: BLE001 - reported after the join
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return outs, wall


def _server_row(c, dr, B, shape, startup, outs, wall, base) -> dict:
    topk, steps, ndraft = shape
    metas = [o["meta_info"] for o in outs]
    tokens = sum(m["completion_tokens"] for m in metas)
    verify_ct = sum(m.get("spec_verify_ct", 0) for m in metas)
    hist = [0] * (steps + 1)  # rounds by number of accepted drafts, summed over requests
    for m in metas:
        for k, v in enumerate(m.get("spec_correct_drafts_histogram") or []):
            hist[min(k, steps)] += v
    n = sum(hist)
    return {
        "config": c,
        "drafter": dr,
        "batch": B,
        "topk": topk,
        "steps": steps,
        "draft_tokens": ndraft,
        "startup_s": rounded(startup, 1),
        "spec_verify_ct": verify_ct,
        "spec_accept_length": rounded(tokens / verify_ct, 4) if verify_ct else None,
        "spec_correct_drafts_histogram": hist,
        "mean_accept_length": rounded(1 + sum(k * v for k, v in enumerate(hist)) / n, 4) if n else None,
        "accept_rate_by_depth": [round(sum(hist[k:]) / n, 4) for k in range(1, steps + 1)] if n else None,
        "completion_tokens": tokens,
        "wall_s": rounded(wall, 4),
        "tok_s": rounded(tokens / wall, 1),
        "tok_s_ratio_to_nospec": rounded(tokens / wall / base["tok_s"], 3),
        "lossless": all(o["output_ids"] == ref for o, ref in zip(outs, base["outputs"])),
    }


def run_server(ckpt: str, workdir: str, batches, configs, drafters, new_tokens: int, prompt_len: int) -> list:
    from ..tools.server import SGLangServer

    spec_cfgs = [c for c in configs if CONFIGS[c] is not None]
    extra = max([CONFIGS[c][1] for c in spec_cfgs], default=0)
    all_prompts = prompt_ids(ckpt, max(batches), prompt_len)
    common = ("--max-total-tokens", "32768")

    def serve(args, env=None):
        srv = SGLangServer(ckpt, *args, *common, env=env)
        t0 = time.perf_counter()
        srv.start()
        startup = time.perf_counter() - t0
        try:
            srv.generate(all_prompts[0][:8], 2, temperature=0, ignore_eos=True)  # warm-up, untimed
        except BaseException:
            srv.stop()
            raise
        return srv, startup

    results, base, refs = [], {}, {}
    srv, startup = serve(())
    try:
        for B in batches:
            prompts = all_prompts[:B]
            outs, wall = _server_batch(srv, prompts, new_tokens)
            tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
            base[B] = {"outputs": [o["output_ids"] for o in outs], "tok_s": tokens / wall}
            ref_outs, _ = _server_batch(srv, prompts, new_tokens + extra)  # untimed: replay references
            refs[B] = [o["output_ids"] for o in ref_outs]
            results.append(
                {
                    "config": "nospec",
                    "drafter": None,
                    "batch": B,
                    "startup_s": rounded(startup, 1),
                    "completion_tokens": tokens,
                    "wall_s": rounded(wall, 4),
                    "tok_s": rounded(tokens / wall, 1),
                    "tok_s_ratio_to_nospec": 1.0,
                }
            )
            log(f"server batch {B} nospec: {tokens / wall:.1f} tok/s")
    finally:
        srv.stop()
    # one file for every batch size (the drafter picks the reference whose prefix the history is)
    replay = replay_file(
        workdir, [p for B in batches for p in all_prompts[:B]], [o for B in batches for o in refs[B]], "server"
    )
    for c in spec_cfgs:
        topk, steps, ndraft = CONFIGS[c]
        args = (
            "--speculative-algorithm",
            "nextn",
            "--speculative-num-steps",
            str(steps),
            "--speculative-eagle-topk",
            str(topk),
            "--speculative-num-draft-tokens",
            str(ndraft),
        )
        for dr in drafters:
            # empty = unset (drafters.make_drafter): the NextN head even if this shell sets it
            env = (
                {settings.TEST_DRAFTER.name: f"replay:{replay}", settings.TESTING.name: "1"}
                if dr == "replay"
                else {settings.TEST_DRAFTER.name: ""}
            )
            env[settings.TREE_VERIFY.name] = "paths" if c in PATHS else "nodes"
            env[settings.NEXTN_SHAPE.name] = "adaptive" if c in SHAPES else "static"
            srv, startup = serve(args, env)
            try:
                for B in batches:
                    outs, wall = _server_batch(srv, all_prompts[:B], new_tokens)
                    results.append(_server_row(c, dr, B, CONFIGS[c], startup, outs, wall, base[B]))
                    row = results[-1]
                    log(
                        f"server batch {B} {c} {dr}: accept {row['spec_accept_length']}, {row['tok_s']} tok/s "
                        f"(x{row['tok_s_ratio_to_nospec']}), lossless {row['lossless']}"
                    )
            finally:
                srv.stop()
    return results


def _checkpoints(a, workdir: str) -> dict:
    """{"nextn": dir, "dspark": dir}: one trunk with either draft (random: written from one seed,
    the trunk drawn first, so both trunks are the same tensors; trained: the shipped pair)."""
    if a.model == "trained":
        import sglang_dsv4_ascend as pkg

        return {"nextn": pkg.TINY_NEXTN_MODEL_PATH, "dspark": pkg.TINY_MODEL_PATH}
    from ..tools.make_tiny_checkpoint import write_checkpoint

    return {k: write_checkpoint(os.path.join(workdir, k), a.preset, k) for k in ("nextn", "dspark")}


def _model_text(a) -> str:
    return (
        "trained tiny DeepSeek-V4 (sglang_dsv4_ascend.TINY_MODEL_PATH, MODEL_CARD.md)"
        if a.model == "trained"
        else f"random tiny DeepSeek-V4, preset {a.preset}"
    )


def _split(s: str) -> list:
    return [x.strip() for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algo", required=True, help="speculative algorithm (only 'nextn' for now)")
    ap.add_argument(
        "--model",
        default="random",
        choices=["random", "trained"],
        help="random: a tiny checkpoint written with --preset (drafts almost never right); trained: "
        "the shipped trained tiny model (sglang_dsv4_ascend.TINY_MODEL_PATH, real acceptance)",
    )
    ap.add_argument(
        "--preset", default="flash", choices=["flash", "pro"], help="shape of the --model random checkpoint"
    )
    ap.add_argument("--batch", default="1,8", help="batch sizes (concurrent requests)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {','.join(CONFIGS)} (nospec always runs)")
    ap.add_argument("--new-tokens", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--drafters", default=",".join(DRAFTERS), help=f"of {','.join(DRAFTERS)}")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--server", action="store_true", help="measure through real SGLang servers")
    ap.add_argument("--verify", default="static,adaptive", help="dspark: verify modes to run")
    ap.add_argument("--gamma", type=int, default=None, help="dspark: block size (default: the checkpoint's)")
    ap.add_argument(
        "--guard",
        default="on" if settings.SPEC_GUARD.get() else "off",
        help="in process: the speculation guard (speculative/guard.py) in every spec run: on, off, or (--algo "
        f"dspark) on,off side by side (default: as {settings.SPEC_GUARD.name}, on); --server: the servers read "
        f"{settings.SPEC_GUARD.name}",
    )
    a = ap.parse_args(argv)
    guards = _split(a.guard)
    if not guards or any(g not in ("on", "off") for g in guards) or len(set(guards)) < len(guards):
        ap.error(f"--guard {a.guard!r}: on, off or on,off")
    if len(guards) > 1 and a.algo != "dspark":
        ap.error(f"--guard {a.guard!r}: both side by side with --algo dspark only")
    if a.algo not in ALGOS:
        ap.error(f"--algo {a.algo!r}: one of {', '.join(ALGOS)}")
    if a.algo == "dspark":
        return _main_dspark(ap, a, guards)
    try:
        batches = [int(x) for x in _split(a.batch)]
    except ValueError:
        ap.error(f"--batch {a.batch!r}: expected comma-separated positive integers")
    configs, drafters = _split(a.configs), _split(a.drafters)
    if not batches or min(batches) < 1:
        ap.error("--batch needs positive sizes")
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        ap.error(f"--configs {a.configs!r}: unknown {bad}; choose from {','.join(CONFIGS)}")
    bad = [d for d in drafters if d not in DRAFTERS]
    if bad or not drafters:
        ap.error(f"--drafters {a.drafters!r}: unknown {bad}; choose from {','.join(DRAFTERS)}")
    if a.new_tokens < 2 or a.prompt_len < 2:
        ap.error("--new-tokens and --prompt-len must be >= 2")
    configs = ["nospec"] + [c for c in CONFIGS if c in configs and c != "nospec"]
    batches = sorted(set(batches))
    if a.threads:
        torch.set_num_threads(a.threads)
    from .. import device

    t0 = time.perf_counter()
    result = {
        "bench": "spec",
        "config": {
            "algo": a.algo,
            "mode": "server" if a.server else "in-process",
            "model": _model_text(a),
            "dtype": "float32",
            "batch": batches,
            "guard": a.guard if not a.server else f"as {settings.SPEC_GUARD.name} (servers)",
            "new_tokens": a.new_tokens,
            "prompt_len": a.prompt_len,
            "configs": {
                c: (None if CONFIGS[c] is None else dict(zip(("topk", "steps", "draft_tokens"), CONFIGS[c])))
                for c in configs
            },
            "drafters": {
                d: (
                    "the checkpoint's NextN block"
                    if d == "nextn"
                    else "ReplayDrafter mode 'full', references = the no-spec greedy outputs"
                )
                for d in drafters
            },
            "prompts": "packaged gsm8k/humaneval/mt-bench first turns, round-robin, tokenized with the checkpoint's "
            "tokenizer (AutoTokenizer, BOS included), cut to prompt_len; shorter ones skipped",
            "sampling": "greedy, EOS ignored",
            "tok_s": (
                "completion tokens / batch wall time, prefill included"
                if a.server
                else "decode tokens (new_tokens - 1 per request) / decode wall time, prefill excluded"
            ),
            "metrics": SERVER_METRICS if a.server else IN_PROCESS_METRICS,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "kernel_family": device.kernel_family(),
        },
    }
    with tempfile.TemporaryDirectory() as d:
        ckpt = _checkpoints(a, d)["nextn"]
        if a.server:
            result["results"] = run_server(ckpt, d, batches, configs, drafters, a.new_tokens, a.prompt_len)
        else:
            on = guards == ["on"]
            result["results"] = run_in_process(ckpt, d, batches, configs, drafters, a.new_tokens, a.prompt_len, on)
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(result, indent=2))
    return 0


def _main_dspark(ap, a, guards) -> int:

    if a.server:
        ap.error("--algo dspark runs in process only (the server path is tests/e2e/test_dspark_serving.py)")
    verify, drafters = _split(a.verify), _split(a.drafters if a.drafters != ",".join(DRAFTERS) else "dspark,replay")
    if not verify or any(v not in spec_dspark.VERIFY for v in verify):
        ap.error(f"--verify {a.verify!r}: comma-separated of {','.join(spec_dspark.VERIFY)}")
    if not drafters or any(d not in spec_dspark.DRAFTERS for d in drafters):
        ap.error(f"--drafters {a.drafters!r}: comma-separated of {','.join(spec_dspark.DRAFTERS)}")
    try:
        batches = sorted({int(x) for x in _split(a.batch)})
    except ValueError:
        ap.error(f"--batch {a.batch!r}: expected comma-separated positive integers")
    if not batches or min(batches) < 1 or a.new_tokens < 2 or a.prompt_len < 2 or (a.gamma is not None and a.gamma < 1):
        ap.error("--batch sizes, --gamma must be >= 1; --new-tokens, --prompt-len >= 2")
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    doc = {
        "bench": "spec",
        "config": {
            "algo": "dspark",
            "mode": "in-process",
            "model": _model_text(a),
            "dtype": "float32",
            "batch": batches,
            "verify": verify,
            "drafters": drafters,
            "guard": guards,
            "new_tokens": a.new_tokens,
            "prompt_len": a.prompt_len,
            "sampling": "greedy, EOS ignored",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "doc": spec_dspark.__doc__.split("\n\n")[2].replace("\n", " "),
        },
    }
    with tempfile.TemporaryDirectory() as d:
        doc.update(
            spec_dspark.run(
                _checkpoints(a, d),
                d,
                batches,
                verify,
                drafters,
                a.gamma,
                a.new_tokens,
                a.prompt_len,
                tuple(g == "on" for g in guards),
            )
        )
    doc["wall_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
