"""`bench serve`: a streaming load generator against a running OpenAI-compatible SGLang server.

    python -m sglang_dsv4_ascend.bench serve --url http://127.0.0.1:30000 [--concurrency 1,4,16]
        [--dataset PROMPTS.jsonl] [--num-prompts 16] [--max-tokens 64] [--temperature 0]
        [--model ID] [--timeout 600] [--out FILE.json] [--plot DIR] [--per-request]

One run per concurrency level, in order; each sends the same `--num-prompts` chat requests (first
turn of each `{"turns": [...]}` line, in file order, cycled) from that many threads, streamed, with
`return_spec_tokens_details` so the plugin puts the speculative counters into every chunk.

Tokens per chunk come from `stream_options.continuous_usage_stats`: every content chunk carries
the request's cumulative `usage.completion_tokens`, so a chunk's tokens are the difference to what
was counted before it (with speculative decoding one chunk often carries several). Per-token
logprobs would be the other exact source, but the plugin refuses `logprobs` under
`--speculative-algorithm dspark`. Timings are client-side, one run, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from ..data import PACKAGED_PROMPTS_DIR

DEFAULT_DATASET = os.path.join(PACKAGED_PROMPTS_DIR, "humaneval.jsonl")
PCTS = (50, 90, 99)
DESCRIPTION = {
    "tokens": "per chunk: the rise of the cumulative usage.completion_tokens that SGLang puts into every "
    "content chunk (stream_options.continuous_usage_stats); chunks without choices or without "
    "delta text are metadata and carry none",
    "ttft_ms": "request sent -> first chunk carrying >= 1 token",
    "tpot_ms": "(last token chunk - first token chunk) / (output tokens - 1), per request",
    "itl_ms": "a token chunk with n tokens arriving dt after the previous token chunk contributes n samples "
    "of dt / n (pooled over the level's requests)",
    "accept_length": "the server's spec_accept_length (tokens verify rounds committed / verify rounds) from "
    "the request's last sglext.spec_tokens_details; accept_length_mean is over requests "
    "with at least one round",
    "acceptance_per_position": "p_j = rounds with >= j correct drafts / rounds with >= j-1, from "
    "spec_correct_drafts_histogram (level: histograms summed over requests); "
    "null where no round reached position j-1",
    "tokens_without_chunk": "usage.completion_tokens - tokens counted from chunks: tokens that reached the "
    "client in no content chunk. SGLang's chat stream emits no chunk for a step whose "
    "tokens add no text (a trailing partial UTF-8 character, a lone EOS); they cannot "
    "be timed",
    "token_counts_match_usage": "every request's chunk token count equals its final usage.completion_tokens",
    "output_tok_per_s": "sum of usage.completion_tokens (chunk counts where usage is missing) / level duration",
}


class BadArgs(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    # argparse prints usage and exits; the bench wants one line and a return code in-process
    def error(self, message):
        raise BadArgs(message)


def chunk_tokens(chunk: dict, counted: int) -> int:
    """Tokens one parsed stream chunk carries, given `counted` tokens of the request before it."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0  # usage / sglext-only chunks
    delta = choices[0].get("delta") or {}
    if not (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")):
        return 0  # role-only opener, finish_reason chunk
    total = (chunk.get("usage") or {}).get("completion_tokens")
    if total is None:
        return 1  # a server without continuous usage: a guess that token_counts_match_usage exposes
    return max(0, total - counted)


def acceptance(hist, positions: int) -> list:
    """Conditional acceptance per draft position from a correct-drafts-per-round histogram."""
    at_least = [sum(hist[k:]) for k in range(positions + 1)]  # rounds with >= k correct drafts
    at_least += [0] * (positions + 1 - len(at_least))
    return [round(at_least[j] / at_least[j - 1], 4) if at_least[j - 1] else None for j in range(1, positions + 1)]


def _positions(details: dict) -> int:
    hist = details.get("spec_correct_drafts_histogram") or []
    if hist:
        return len(hist) - 1  # one bin per accepted-draft count 0..depth (a tree's depth, not its nodes)
    rounds, proposed = details.get("spec_verify_ct") or 0, details.get("spec_num_proposed_drafts") or 0
    return round(proposed / rounds) if rounds else 0


def _mean_accept_length(specs):
    """Over requests that had a verify round (one without reports 0, which is no length)."""
    lens = [d["spec_accept_length"] for d in specs if d.get("spec_verify_ct")]
    return round(sum(lens) / len(lens), 4) if lens else None


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(xs) -> dict:
    out = {f"p{p}": pct(xs, p) for p in PCTS}
    out["mean"] = sum(xs) / len(xs) if xs else None
    return {k: None if v is None else round(v, 3) for k, v in out.items()}


def one_request(url: str, body: dict, timeout: float) -> dict:
    import requests

    rec = {
        "ok": False,
        "error": None,
        "chunk_ms": [],
        "chunk_tokens": [],
        "output_tokens": 0,
        "usage_completion_tokens": None,
        "usage_prompt_tokens": None,
        "cached_tokens": None,
        "spec": None,
    }
    t0 = time.perf_counter()
    last_tok_t, itl = None, []
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            # chunk_size=None: hand over each HTTP chunk as it arrives, not once 512 bytes piled up
            for line in r.iter_lines(chunk_size=None):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                t = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("object") == "error" or "error" in chunk:
                    raise RuntimeError(f"stream error: {json.dumps(chunk)[:300]}")
                ext = chunk.get("sglext") or {}
                if ext.get("spec_tokens_details"):
                    d = ext["spec_tokens_details"]
                    rec["spec"] = d[0] if isinstance(d, list) else d
                if ext.get("cached_tokens") is not None:
                    rec["cached_tokens"] = ext["cached_tokens"]
                if not chunk.get("choices") and chunk.get("usage"):
                    rec["usage_completion_tokens"] = chunk["usage"].get("completion_tokens")
                    rec["usage_prompt_tokens"] = chunk["usage"].get("prompt_tokens")
                n = chunk_tokens(chunk, rec["output_tokens"])
                if not n:
                    continue
                if last_tok_t is None:
                    rec["ttft_ms"] = (t - t0) * 1e3
                    first_tok_t = t
                else:
                    itl += [(t - last_tok_t) * 1e3 / n] * n
                last_tok_t = t
                rec["output_tokens"] += n
                rec["chunk_ms"].append(round((t - t0) * 1e3, 3))
                rec["chunk_tokens"].append(n)
        rec["ok"] = rec["output_tokens"] > 0 or rec["usage_completion_tokens"] == 0
        if not rec["ok"]:
            rec["error"] = "no token chunk in the stream"
    except Exception as e:  # noqa: BLE001 - one failed request is a data point, not a crash
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["latency_ms"] = (time.perf_counter() - t0) * 1e3
    if rec["usage_completion_tokens"] is not None:
        rec["tokens_without_chunk"] = rec["usage_completion_tokens"] - rec["output_tokens"]
    rec["itl_ms"] = [round(x, 3) for x in itl]
    rec["tpot_ms"] = (last_tok_t - first_tok_t) * 1e3 / (rec["output_tokens"] - 1) if rec["output_tokens"] > 1 else None
    if rec["spec"]:
        rec["accept_length"] = rec["spec"].get("spec_accept_length")
        rec["acceptance_per_position"] = acceptance(
            rec["spec"].get("spec_correct_drafts_histogram") or [], _positions(rec["spec"])
        )
    return rec


def _generated(rec) -> int:
    # throughput counts what the server generated, timed or not
    u = rec["usage_completion_tokens"]
    return rec["output_tokens"] if u is None else u


def run_level(args, prompts, c: int) -> tuple:
    from tqdm import tqdm

    bodies = [
        {
            "model": args.model,
            "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "ignore_eos": False,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "return_spec_tokens_details": True,
        }
        for i in range(args.num_prompts)
    ]
    recs, toks = [None] * len(bodies), 0
    bar = tqdm(total=len(bodies), desc=f"concurrency {c}", unit="req", file=sys.stderr, leave=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as ex:
        futs = {ex.submit(one_request, args.url, b, args.timeout): i for i, b in enumerate(bodies)}
        for f in as_completed(futs):
            i = futs[f]
            recs[i] = {"concurrency": c, "index": i, "prompt_index": i % len(prompts), **f.result()}
            toks += _generated(recs[i])
            bar.set_postfix_str(f"{toks / (time.perf_counter() - t0):.1f} out tok/s")
            bar.update()
    dur = time.perf_counter() - t0
    bar.close()
    ok = [r for r in recs if r["ok"]]
    errs = [r for r in recs if not r["ok"]]
    specs = [r["spec"] for r in ok if r["spec"]]
    hist, npos = [], 0
    for d in specs:  # pool the rounds: a request with many rounds weighs more, as its tokens do
        h = d.get("spec_correct_drafts_histogram") or []
        hist = [sum(x[k] for x in (hist, h) if k < len(x)) for k in range(max(len(hist), len(h)))]
        npos = max(npos, _positions(d))
    level = {
        "concurrency": c,
        "requests": len(recs),
        "errors": len(errs),
        "first_error": errs[0]["error"] if errs else None,
        "duration_s": round(dur, 3),
        "output_tok_per_s": round(sum(_generated(r) for r in ok) / dur, 3),
        "request_per_s": round(len(ok) / dur, 3),
        "ttft_ms": summary([r["ttft_ms"] for r in ok if "ttft_ms" in r]),
        "tpot_ms": summary([r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]),
        "itl_ms": summary([x for r in ok for x in r["itl_ms"]]),
        "accept_length_mean": _mean_accept_length(specs),
        "acceptance_per_position": acceptance(hist, npos) if specs else None,
        "correct_drafts_histogram": hist if specs else None,  # rounds with k correct drafts, pooled
        "draft_positions": npos if specs else None,
        "total_output_tokens": sum(r["output_tokens"] for r in recs),
        "total_usage_completion_tokens": sum(r["usage_completion_tokens"] or 0 for r in recs),
        "tokens_without_chunk": sum(r.get("tokens_without_chunk") or 0 for r in recs),
        "cached_tokens_total": sum(r["cached_tokens"] or 0 for r in recs),
        "token_counts_match_usage": bool(ok) and all(r["output_tokens"] == r["usage_completion_tokens"] for r in ok),
    }
    return level, recs


def plot(levels, out_dir: str) -> list:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    cs = [lv["concurrency"] for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms")):
        for p in ("p50", "p90", "p99", "mean"):
            ax.plot(cs, [lv[key][p] for lv in levels], marker="o", label=p)
        ax.set(xscale="log", xlabel="concurrency", ylabel="ms", title=key)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.legend()
    paths = [os.path.join(out_dir, "latency.png"), os.path.join(out_dir, "throughput.png")]
    fig.tight_layout()
    fig.savefig(paths[0])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(cs, [lv["output_tok_per_s"] for lv in levels], marker="o")
    ax.set(xscale="log", xlabel="concurrency", ylabel="output tok/s", title="output throughput")
    ax.set_xticks(cs, [str(c) for c in cs])
    fig.tight_layout()
    fig.savefig(paths[1])
    plt.close("all")
    return paths


def _positive(kind):
    def conv(s):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a {kind.__name__}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{s!r} must be > 0")
        return v

    return conv


def _levels(s):
    parts = [p for p in s.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("empty list")
    return [_positive(int)(p.strip()) for p in parts]


def parse(argv):
    ap = _Parser(prog="python -m sglang_dsv4_ascend.bench serve", description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--concurrency", type=_levels, default=[1, 4, 16])
    ap.add_argument("--dataset", default=DEFAULT_DATASET)
    ap.add_argument("--num-prompts", type=_positive(int), default=16)
    ap.add_argument("--max-tokens", type=_positive(int), default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--timeout", type=_positive(float), default=600.0, help="seconds per request")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, metavar="DIR")
    ap.add_argument("--per-request", action="store_true")
    args = ap.parse_args(argv)
    if args.temperature < 0:
        raise BadArgs(f"argument --temperature: {args.temperature} must be >= 0")
    args.url = args.url.rstrip("/")
    return args


def load_dataset(path: str) -> list:
    if not os.path.isfile(path):
        raise BadArgs(f"argument --dataset: {path} not found")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    prompts.append(json.loads(line)["turns"][0])
                except (ValueError, KeyError, IndexError, TypeError):
                    raise BadArgs(f'argument --dataset: {path}:{n} is not {{"turns": [...]}}') from None
    if not prompts:
        raise BadArgs(f"argument --dataset: {path} has no prompts")
    return prompts


def first_model(url: str, timeout: float) -> str:
    import requests

    try:
        r = requests.get(f"{url}/v1/models", timeout=min(timeout, 30))
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception as e:  # noqa: BLE001 - any failure here means the server is not usable
        raise BadArgs(f"argument --url: cannot list models at {url}/v1/models ({type(e).__name__}: {e})") from None


def main(argv=None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        prompts = load_dataset(args.dataset)
        if args.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise BadArgs("argument --plot: matplotlib is not installed (pip install matplotlib)") from None
        model = first_model(args.url, args.timeout)  # also the reachability check
        args.model = args.model or model
    except BadArgs as e:
        print(f"bench serve: error: {e}", file=sys.stderr)
        return 2
    levels, recs = [], []
    for c in args.concurrency:
        lv, rs = run_level(args, prompts, c)
        levels.append(lv)
        recs += rs
    report = {
        "bench": "serve",
        "description": DESCRIPTION,
        "config": {**vars(args), "dataset_prompts": len(prompts)},
        "levels": levels,
    }
    if args.per_request:
        report["requests"] = recs
    if args.plot:
        report["plots"] = plot(levels, args.plot)
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if not any(lv["errors"] for lv in levels) else 1
