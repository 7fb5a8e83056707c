"""IndexCache (`index_topk_freq`, config.topk_source) at freq 1 vs 2 vs 4 in one run: the indexer
time a reused top-k saves, at V4-Flash shapes and on the tiny model, and what it changes in the
trained tiny model's outputs. Ratios are to freq 1 measured in the same run.

    python -m sglang_dsv4_ascend.bench indexcache [--freqs 1,2,4] [--parts op,tiny,quality]
        [--op-contexts 4096,16384,65536] [--op-rows 8] [--op-reps 5]
        [--contexts 4096,16384,65536] [--decode-batch 4] [--chunk 1024] [--reps 5] [--prefill-reps 1]
        [--prompts 8] [--prompt-len 128] [--new-tokens 64] [--spec-new-tokens 32] [--threads N]

`op`: one CSA layer's top-k selection at V4-Flash indexer shapes (bench/cache.py CONFIGS["flash"]:
64 indexer heads of 128, top-512; 21 CSA layers of 43), as the batched forward runs it:
`Indexer.select_batched` (scores of every committed C4 entry for every query row, in bounded chunks,
merged into a running top-k; ties to the lowest entry). A decode batch of `--op-rows` requests of
one token, each at position C of context C, so C // 4 committed entries each. The index keys are
random bf16 in a one-layer `DSV4Cache` (the entry store laid out as the backend pages it), the
queries random bf16, the head weights random fp32; the op scores in fp32. Timed: the selection
only (plan built before; no query projection, no compressor pooling, no attention). Median of
`--op-reps` after one warm-up call. Per-step indexer time = that x the number of CSA layers that
compute their own top-k at the freq (config.computes_topk: 21 / 11 / 6 for Flash at 1 / 2 / 4): an
extrapolation that assumes every computing layer's selection costs the same (they have the same
shapes); a reusing layer's share of the step (handing over the source's picks) is nothing.

`tiny`: the trained tiny model (sglang_dsv4_ascend.TINY_MODEL_PATH: 13 layers, 6 CSA, 16 indexer
heads of 32, top-8), bf16 weights loaded into an fp32 model, the batched forward, built once per
freq (reusing CSA layers have no indexer). For each context L: a decode step is one forward of
`--decode-batch` one-token segments at start L (positions L) on a fresh cache (the cache content
does not change the work, only its length does), plan and logits included, writes deferred and
dropped so every rep sees the same cache: median of `--reps` after one warm-up. Prefill: one chunk
of `--chunk` tokens of one request at start L - chunk, same cache, `--prefill-reps` timings
(median) after a warm-up forward of each model; tok/s = chunk / wall time. Each time is reported
as wall time and as this process's user CPU time over the same calls (getrusage), which other load
on a shared machine does not inflate (prefill: system time too, mostly page faults of the large
temporaries). The freqs are interleaved at each L, so load drift hits them alike, and the one
that runs first rotates with L. On a shared machine wall and system times of one run move by tens
of percent; the user CPU time is the figure to compare.

`quality`: the trained tiny model, bf16 weights run in fp32, `--prompts` prompts of exactly
`--prompt-len` tokens from the packaged sets (spec_common.prompt_ids: gsm8k / humaneval /
mt-bench first turns, round-robin, BOS included). Teacher-forced: one prefill per prompt; at every
position the next-token distribution p_f = softmax(logits), KL(p_1 || p_N) in nats (mean and max
over every position of every prompt) and top-1 agreement (argmax equal). Positions that see at
most index_topk (8) entries select every visible entry at every freq, so only positions >= 35
can differ; `--prompt-len` 128 makes most of them count. Greedy: `--new-tokens` tokens per prompt
(EOS ignored; the prompts decoded as one batch, spec_common.InProcess.nospec), compared with freq
1: the first index where the outputs differ (= new_tokens when they never do), its mean, the
prefix agreement (sum of those indices / all generated tokens: the fraction of tokens produced
before the first divergence), the positionwise equal fraction (after a divergence the contexts
differ) and how many prompts are identical. Every freq, freq 1 included, is a separately built
model, so freq 1's KL 0 / agreement 1 says the comparison is deterministic. Speculative: the
shipped drafts against the freq-N target (draft layers have no CSA layer: unaffected), the
prompts as one batch, `--spec-new-tokens` per prompt, greedy: NextN (the nextn checkpoint's
block, a chain of gamma steps) and DSpark static verify (the dspark checkpoint's draft and its
calibration), gamma = dspark_block_size, through the in-process engines of `bench spec`
(spec_common.InProcess, spec_dspark.DSparkInProcess); mean accept length (accepted drafts + bonus
per request-round) and lossless (the spec output equals that freq's own greedy output).

Note on the tiny model: its training never updated the indexer (HF's hard top-k passes no gradient
to it: MODEL_CARD.md), so its selections are those of random projections; the quality figures
measure how much the outputs depend on which entries are picked, not a trained indexer's
agreement across layers. Timings are one run on this machine (noisy on a shared CPU), never
asserted; progress lines go to stderr, the JSON document to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import torch

from .spec_common import mean, rounded


def log(msg: str) -> None:
    print(f"[bench indexcache] {msg}", file=sys.stderr, flush=True)


def _cpu() -> tuple:
    """(user, system) CPU seconds of this process so far, all threads."""
    try:
        import resource

        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime, r.ru_stime
    except ImportError:  # no getrusage: all of it counted as user time
        return time.process_time(), 0.0


def _median_s(fn, reps: int, warmup: bool = True) -> tuple:
    """Medians of `reps` calls of fn: (wall, user CPU, system CPU) seconds."""
    if warmup:
        fn()
    walls, users, syss = [], [], []
    for _ in range(reps):
        (u0, s0), t0 = _cpu(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        u1, s1 = _cpu()
        users.append(u1 - u0)
        syss.append(s1 - s0)
    return statistics.median(walls), statistics.median(users), statistics.median(syss)


def load_at_freq(path: str, freq: int, dtype: torch.dtype = torch.float32):
    """The checkpoint's target with its config's `index_topk_freq` replaced (eval mode)."""
    from ..config import DSV4Config
    from ..models.trunk import DSV4Model
    from ..models.weights import iter_checkpoint, load_released_weights

    with open(os.path.join(path, "config.json")) as f:
        cfg = dataclasses.replace(DSV4Config.from_hf(json.load(f)), index_topk_freq=freq)
    model = DSV4Model(cfg, dtype=dtype)
    load_released_weights(model, iter_checkpoint(path), source=path)
    return model.eval()


def computing_layers(cfg, freq: int) -> list:
    """The main layers that run a lightning indexer at `freq` (config.computes_topk)."""
    cfg = dataclasses.replace(cfg, index_topk_freq=freq)
    return [i for i in range(cfg.num_hidden_layers) if cfg.computes_topk(i)]


# --- op: one layer's selection at V4-Flash shapes -------------------------------------------------


def flash_select_s(cfg, context: int, rows: int, reps: int, seed: int = 0) -> float:
    """Median seconds of one `Indexer.select_batched` for `rows` decode requests at `context`."""
    from ..batch import INDEXER, Segment
    from ..kvcache.cache import DSV4Cache
    from ..kvcache.plan import build_plan
    from ..layers.indexer import Indexer
    from ..ops.reference import Source

    H, D = cfg.index_n_heads, cfg.index_head_dim
    g = torch.Generator().manual_seed(seed)
    cache = DSV4Cache(cfg, rows, context + 1, dtype=torch.bfloat16, ratios=(4,))
    keys = cache.layers[0].entries[INDEXER]
    keys.copy_(torch.randn(keys.shape, generator=g))
    plan = build_plan([Segment(s, context, 1) for s in range(rows)], cache)
    rp = plan.ratios[4]
    indexer = Indexer(cfg, device="meta")  # the op reads only its sizes: no weights allocated
    q = torch.randn(rows, H, D, generator=g).to(torch.bfloat16)
    w = torch.randn(rows, H, generator=g) * H**-0.5
    zeros = plan.zeros()
    committed = Source(keys, rp.slot_entries, plan.row_slot, zeros, rp.com_hi, None, 4)
    fresh = Source(keys.new_zeros(0, D), rp.new_table, plan.row_seg, zeros, rp.new_hi)

    def fn():
        return indexer.select_batched(q, w, committed, fresh, rp, plan.T, cache.swa_rows_total, plan.host_groups)

    picks, _ = fn()
    want = min(cfg.index_topk, context // 4)
    if not bool((picks.mask.sum(1) == want).all()):
        raise RuntimeError(f"select_batched picked {picks.mask.sum(1).tolist()} entries per row, expected {want}")
    return _median_s(fn, reps)[0]


def run_op(freqs, contexts, rows: int, reps: int) -> dict:
    from ..config import DSV4Config
    from .cache import CONFIGS

    cfg = DSV4Config.from_hf(CONFIGS["flash"])
    layers = {f: len(computing_layers(cfg, f)) for f in freqs}
    out = []
    for ctx in contexts:
        s = flash_select_s(cfg, ctx, rows, reps)
        base = s * layers[1]
        out.append(
            {
                "context": ctx,
                "entries_per_row": ctx // 4,
                "layer_select_ms": round(s * 1e3, 3),
                "per_step": [
                    {
                        "index_topk_freq": f,
                        "computing_layers": layers[f],
                        "indexer_ms": round(s * layers[f] * 1e3, 3),
                        "ratio_to_freq1": round(s * layers[f] / base, 4),
                    }
                    for f in freqs
                ],
            }
        )
        log(f"op flash context {ctx}: one layer's select {s * 1e3:.2f} ms")
    return {
        "model": "V4-Flash indexer shapes (bench/cache.py CONFIGS['flash'])",
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "csa_layers": cfg.compress_ratios[: cfg.num_hidden_layers].count(4),
        "layers": cfg.num_hidden_layers,
        "query_rows": rows,
        "inputs": "index keys and queries random bf16, head weights random fp32; scores computed in fp32",
        "op": "Indexer.select_batched (batched forward's selection: chunked scores + running top-k)",
        "reps": reps,
        "results": out,
    }


# --- tiny: decode step and prefill chunk on the trained tiny model --------------------------------


def run_tiny(ckpt: str, freqs, contexts, batch: int, chunk: int, reps: int, prefill_reps: int) -> dict:
    from ..batch import Segment
    from ..kvcache.plan import build_plan

    models = {f: load_at_freq(ckpt, f) for f in freqs}
    V = models[1].cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    for m in models.values():  # warm-up (TorchScript compiles and profiles its first runs)
        m.compute_logits(
            m(torch.randint(0, V, (64,), generator=g), torch.arange(64), [Segment(0, 0, 64)], m.make_cache(1, 64))
        )
    rows = []
    for n, L in enumerate(contexts):
        dec_ids = torch.randint(0, V, (batch,), generator=g)
        pre_ids = torch.randint(0, V, (chunk,), generator=g)
        dec_segs = [Segment(s, L, 1) for s in range(batch)]
        pre_segs = [Segment(0, L - chunk, chunk)]
        per = {}
        order = freqs[n % len(freqs) :] + freqs[: n % len(freqs)]  # no freq always runs first
        for f in order:
            m = models[f]
            cache = m.make_cache(batch, L + 1)

            def step(ids, segs, m=m, cache=cache):
                pos = torch.cat([torch.arange(s.start, s.start + s.length) for s in segs])
                return lambda: m.compute_logits(m(ids, pos, segs, cache, pending=[], plan=build_plan(segs, cache)))

            dec, dec_user, _ = _median_s(step(dec_ids, dec_segs), reps)
            pre, pre_user, pre_sys = _median_s(step(pre_ids, pre_segs), prefill_reps, warmup=False)
            per[f] = (dec, dec_user, pre, pre_user, pre_sys, cache.nbytes()["c4_index"])
            log(
                f"tiny L {L} freq {f}: decode {dec * 1e3:.1f} ms (user cpu {dec_user * 1e3:.1f}), prefill "
                f"{chunk / pre:.0f} tok/s (cpu user {pre_user:.2f} s, sys {pre_sys:.2f} s)"
            )
            del cache
        d1, du1, p1, pu1, _, _ = per[1]
        rows.append(
            {
                "context": L,
                "by_freq": [
                    {
                        "index_topk_freq": f,
                        "decode_step_ms": round(d * 1e3, 3),
                        "decode_ratio_to_freq1": round(d / d1, 4),
                        "decode_user_cpu_ms": round(du * 1e3, 3),
                        "decode_user_cpu_ratio_to_freq1": round(du / du1, 4),
                        "prefill_s": round(p, 3),
                        "prefill_tok_s": round(chunk / p, 1),
                        "prefill_tok_s_ratio_to_freq1": round(p1 / p, 4),
                        "prefill_user_cpu_s": round(pu, 3),
                        "prefill_sys_cpu_s": round(ps, 3),
                        "prefill_user_cpu_ratio_to_freq1": round(pu / pu1, 4),
                        "c4_index_cache_bytes": ix,
                    }
                    for f, (d, du, p, pu, ps, ix) in sorted(per.items())
                ],
            }
        )
    cfg = models[1].cfg
    return {
        "model": "trained tiny DeepSeek-V4 (TINY_MODEL_PATH), bf16 weights, fp32 compute, batched forward",
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "computing_layers": {str(f): len(computing_layers(cfg, f)) for f in freqs},
        "decode_batch": batch,
        "prefill_chunk": chunk,
        "reps": reps,
        "prefill_reps": prefill_reps,
        "ratios": "decode and CPU: time at freq N / time at freq 1; prefill_tok_s: tok/s at freq N / at freq 1",
        "cpu": "this process's user and system CPU seconds over the same calls (getrusage, all threads): user time "
        "is the arithmetic, which other load on a shared machine does not inflate; system time is mostly page "
        "faults of the large temporaries (the indexer's scores at long contexts) and varies with memory pressure",
        "results": rows,
    }


# --- quality: the trained tiny model's outputs at freq N vs freq 1 --------------------------------


@torch.no_grad()
def _teacher_forced(model, prompts) -> list:
    from ..batch import Segment

    out = []
    for p in prompts:
        cache = model.make_cache(1, len(p))
        h = model(torch.tensor(p), torch.arange(len(p)), [Segment(0, 0, len(p))], cache)
        out.append(torch.log_softmax(model.compute_logits(h).double(), -1))
    return out


def _first_divergence(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_quality(ds_ckpt: str, nx_ckpt: str, freqs, n: int, prompt_len: int, new_tokens: int, spec_new: int) -> dict:
    from ..models.dspark import load_sts, sts_path
    from ..speculative.drafters import DSparkDrafter
    from .spec_common import InProcess, drafter_factory, prompt_ids
    from .spec_dspark import DSparkInProcess

    prompts = prompt_ids(ds_ckpt, n, prompt_len)
    ref_model = load_at_freq(ds_ckpt, 1)
    gamma = ref_model.cfg.dspark_block_size
    ref_lp = _teacher_forced(ref_model, prompts)
    total = max(new_tokens, spec_new + gamma)  # a spec's last round may overshoot by gamma: checked too
    max_len = prompt_len + total + gamma + 2
    ref_out = InProcess(nx_ckpt, ref_model).nospec(prompts, total, total, max_len)["outputs"]
    del ref_model
    rows = []
    for f in freqs:
        trunk = load_at_freq(ds_ckpt, f)
        lp = _teacher_forced(trunk, prompts)
        kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(ref_lp, lp)])
        top1 = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(ref_lp, lp)])
        nx = InProcess(nx_ckpt, trunk)  # the shared trunk (nextn/ links dspark/'s shard) with the NextN block
        out = nx.nospec(prompts, total, total, max_len)["outputs"]
        firsts = [_first_divergence(a[:new_tokens], b[:new_tokens]) for a, b in zip(ref_out, out)]
        equal = sum(x == y for a, b in zip(ref_out, out) for x, y in zip(a[:new_tokens], b[:new_tokens]))
        row = {
            "index_topk_freq": f,
            "teacher_forced": {
                "positions": int(kl.numel()),
                "kl_mean": float(kl.mean()),
                "kl_max": float(kl.max()),
                "top1_agreement": round(float(top1.double().mean()), 4),
            },
            "greedy": {
                "new_tokens": new_tokens,
                "mean_first_divergence": rounded(mean(firsts), 3),
                "first_divergence": firsts,
                "prefix_agreement": round(sum(firsts) / (n * new_tokens), 4),
                "positionwise_equal": round(equal / (n * new_tokens), 4),
                "identical_prompts": sum(x == new_tokens for x in firsts),
            },
        }
        # speculative decoding with this target: NextN chain and DSpark static, gamma steps
        s = nx.spec(prompts, (1, gamma, gamma + 1), drafter_factory("nextn", None), spec_new, max_len)
        spec = {
            "nextn": {
                "mean_accept_length": rounded(mean(s["accept"]), 4),
                "request_rounds": len(s["accept"]),
                "lossless": all(o == ref[: len(o)] for o, ref in zip(s["outputs"], out)),
            }
        }
        ds = DSparkInProcess(ds_ckpt, trunk)
        ds.draft.sts = load_sts(sts_path(None, ds_ckpt))
        s = ds.spec(prompts, gamma, "static", None, DSparkDrafter, spec_new, max_len)
        spec["dspark"] = {
            "mean_accept_length": rounded(mean(s["accept"]), 4),
            "request_rounds": len(s["accept"]),
            "lossless": all(o == ref[: len(o)] for o, ref in zip(s["outputs"], out)),
        }
        row["speculative"] = spec
        rows.append(row)
        tf = row["teacher_forced"]
        log(
            f"quality freq {f}: KL mean {tf['kl_mean']:.3g} max {tf['kl_max']:.3g}, top-1 {tf['top1_agreement']}, "
            f"greedy first divergence {row['greedy']['mean_first_divergence']}, accept nextn "
            f"{spec['nextn']['mean_accept_length']} dspark {spec['dspark']['mean_accept_length']}"
        )
    one = next(r for r in rows if r["index_topk_freq"] == 1)["speculative"]
    base = {k: one[k]["mean_accept_length"] for k in ("nextn", "dspark")}
    for r in rows:
        for k, v in r["speculative"].items():
            v["accept_length_ratio_to_freq1"] = rounded(v["mean_accept_length"] / base[k], 4)
    return {
        "model": "trained tiny DeepSeek-V4 (TINY_MODEL_PATH; NextN block from TINY_NEXTN_MODEL_PATH), bf16 weights, "
        "fp32 compute",
        "prompts": n,
        "prompt_len": prompt_len,
        "prompt_source": "packaged gsm8k/humaneval/mt-bench first turns, round-robin, tokenized with the "
        "checkpoint's tokenizer (BOS included), cut to prompt_len; shorter ones skipped",
        "kl": "KL(p_freq1 || p_freqN) of the next-token distribution, nats, every prompt position, teacher-forced",
        "speculative": {
            "gamma": gamma,
            "new_tokens": spec_new,
            "batch": n,
            "nextn": f"NextN chain of {gamma} steps (topk 1, {gamma + 1} draft tokens)",
            "dspark": f"DSpark static verify, block {gamma}, the checkpoint's calibration",
        },
        "indexer_trained": False,
        "results": rows,
    }


# --- command line ---------------------------------------------------------------------------------

PARTS = ("op", "tiny", "quality")


def _ints(ap, name: str, s: str) -> list:
    try:
        xs = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        xs = []
    if not xs or min(xs) < 1:
        ap.error(f"{name} {s!r}: expected comma-separated positive integers")
    return xs


def main(argv=None) -> int:
    import sglang_dsv4_ascend as pkg

    ap = argparse.ArgumentParser(
        prog="python -m sglang_dsv4_ascend.bench indexcache", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--freqs", default="1,2,4", help="index_topk_freq values (must include 1: the ratios' base)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated of {','.join(PARTS)}")
    ap.add_argument("--op-contexts", default="4096,16384,65536", help="V4-Flash op: contexts (entries = context // 4)")
    ap.add_argument("--op-rows", type=int, default=8, help="V4-Flash op: decode query rows (one per request)")
    ap.add_argument("--op-reps", type=int, default=5)
    ap.add_argument("--contexts", default="4096,16384,65536", help="tiny model: context lengths L")
    ap.add_argument("--decode-batch", type=int, default=4, help="tiny model: one-token segments per decode step")
    ap.add_argument("--chunk", type=int, default=1024, help="tiny model: prefill chunk tokens (at start L - chunk)")
    ap.add_argument("--reps", type=int, default=5, help="tiny model: decode reps (median, after a warm-up)")
    ap.add_argument("--prefill-reps", type=int, default=1, help="tiny model: prefill reps (median)")
    ap.add_argument("--prompts", type=int, default=8, help="quality: prompts")
    ap.add_argument("--prompt-len", type=int, default=128, help="quality: tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="quality: greedy tokens per prompt")
    ap.add_argument("--spec-new-tokens", type=int, default=32, help="quality: speculative tokens per prompt")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    a = ap.parse_args(argv)
    freqs = sorted(set(_ints(ap, "--freqs", a.freqs)))
    if 1 not in freqs:
        ap.error("--freqs must include 1 (the ratios are to freq 1)")
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        ap.error(f"--parts {a.parts!r}: comma-separated of {','.join(PARTS)}")
    op_contexts = _ints(ap, "--op-contexts", a.op_contexts)
    contexts = _ints(ap, "--contexts", a.contexts)
    counts = (a.op_rows, a.op_reps, a.decode_batch, a.chunk, a.reps, a.prefill_reps, a.prompts)
    if min(counts) < 1 or a.prompt_len < 2 or a.new_tokens < 2 or a.spec_new_tokens < 2:
        ap.error(
            "--op-rows/--op-reps/--decode-batch/--chunk/--reps/--prefill-reps/--prompts must be >= 1, "
            "--prompt-len/--new-tokens/--spec-new-tokens >= 2"
        )
    if min(op_contexts) < 4:
        ap.error("--op-contexts must be >= 4 (one C4 entry)")
    if "tiny" in parts and min(contexts) < a.chunk:
        ap.error(f"--contexts must be >= --chunk ({a.chunk}): the chunk is prefilled at start L - chunk")
    if a.threads:
        torch.set_num_threads(a.threads)
    from .. import device

    t0 = time.perf_counter()
    doc = {
        "bench": "indexcache",
        "config": {
            "freqs": freqs,
            "parts": parts,
            "op_contexts": op_contexts,
            "op_rows": a.op_rows,
            "op_reps": a.op_reps,
            "contexts": contexts,
            "decode_batch": a.decode_batch,
            "chunk": a.chunk,
            "reps": a.reps,
            "prefill_reps": a.prefill_reps,
            "prompts": a.prompts,
            "prompt_len": a.prompt_len,
            "new_tokens": a.new_tokens,
            "spec_new_tokens": a.spec_new_tokens,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "kernel_family": device.kernel_family(),
            "doc": " ".join(__doc__.split("\n\n")[0].split()),
        },
    }
    if "op" in parts:
        doc["op"] = run_op(freqs, op_contexts, a.op_rows, a.op_reps)
    if "tiny" in parts:
        doc["tiny"] = run_tiny(pkg.TINY_MODEL_PATH, freqs, contexts, a.decode_batch, a.chunk, a.reps, a.prefill_reps)
    if "quality" in parts:
        doc["quality"] = run_quality(
            pkg.TINY_MODEL_PATH,
            pkg.TINY_NEXTN_MODEL_PATH,
            freqs,
            a.prompts,
            a.prompt_len,
            a.new_tokens,
            a.spec_new_tokens,
        )
    doc["wall_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
