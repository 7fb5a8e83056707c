"""`bench pd`: prefill/decode disaggregation through SGLang's router against one unified server,
same checkpoint, flags and load, one after the other in one run.

    python -m sglang_dsv4_ascend.bench pd [--method dspark_adaptive] [--concurrency 1,4]
        [--num-prompts 8] [--max-tokens 48] [--dataset PROMPTS.jsonl] [--out FILE.json]

`--method` is one of the headline table's (bench/headline.py METHODS: checkpoint, environment,
flags). Each side gets `bench serve`'s load (streamed chat requests, client-side TTFT / TPOT /
tok/s). The state each request moves, two ways: described, from the layout both PD sides log
(`dsv4_ascend PD layout`): the pages its prompt occupies times the bytes a page of entries holds,
plus one request slot's rings (and the draft's); and moved, the bytes NIXL's telemetry reports for
the prefill side's finished transfers over the load (`dsv4_ascend NIXL moved`, on the CPU
platform), per request. On one CPU machine the point is correctness and the byte count, not speed:
both servers share two cores.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from ..integration.hooks.pd_nixl_host_memory import MOVED_LOG_PERIOD_S, moved
from ..tools.pd import PDServers
from ..tools.server import SGLangServer
from . import headline, serve


def layout_bytes(log: str) -> dict:
    """Bytes per page of entries and per request slot, from a PD server's `dsv4_ascend PD layout`."""
    m = re.search(
        r"dsv4_ascend PD layout: dsv4_ascend\(config \w+, page (\d+), \w+, paged (\d+) stores (\d+) B/page, "
        r"request rows (\d+) tensors (\d+) B/slot, draft rows (\d+) tensors (\d+) B/slot\)",
        log,
    )
    if m is None:
        raise RuntimeError("bench pd: the prefill server logged no 'dsv4_ascend PD layout' line")
    page, _, per_page, _, per_slot, _, draft = map(int, m.groups())
    return {"page": page, "bytes_per_page": per_page, "bytes_per_slot": per_slot, "draft_bytes_per_slot": draft}


def prompt_tokens(model_path: str, prompts: list) -> list:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    return [len(tok(t, add_special_tokens=False).input_ids) for t in texts]


def state_per_request(model_path: str, prompts: list, layout: dict) -> dict:
    """The bytes each request's state takes across PD: its prompt's pages of entries, one slot of
    every ring, and the draft's slot."""
    lens = prompt_tokens(model_path, prompts)
    per_req = [
        -(-n // layout["page"]) * layout["bytes_per_page"] + layout["bytes_per_slot"] + layout["draft_bytes_per_slot"]
        for n in lens
    ]
    return {
        **layout,
        "prompt_tokens_mean": round(sum(lens) / len(lens), 1),
        "bytes_described_mean": round(sum(per_req) / len(per_req)),
        "bytes_described_max": max(per_req),
    }


def _levels(url: str, args, prompts) -> list:
    load = argparse.Namespace(
        url=url, model=None, max_tokens=args.max_tokens, temperature=0.0, num_prompts=args.num_prompts, timeout=600.0
    )
    load.model = serve.first_model(url, 60)
    return [serve.run_level(load, prompts, c)[0] for c in args.concurrency]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_dsv4_ascend.bench pd", description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="dspark_adaptive", choices=sorted(headline.METHODS))
    ap.add_argument("--concurrency", type=serve._levels, default=[1, 4])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dataset", default=serve.DEFAULT_DATASET)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    prompts = serve.load_dataset(args.dataset)
    path, env, flags = headline.METHODS[args.method]
    out = {"config": {"method": args.method, "checkpoint": path, "flags": [*headline.POOL, *flags], "env": env}}
    out["config"].update(concurrency=args.concurrency, num_prompts=args.num_prompts, max_tokens=args.max_tokens)
    print(f"[bench pd] unified server ({args.method})", file=sys.stderr)
    with SGLangServer(path, *headline.POOL, *flags, env=env) as srv:
        out["unified"] = _levels(srv.url, args, prompts)
    print("[bench pd] prefill + decode servers behind SGLang's router", file=sys.stderr)
    with PDServers(path, *headline.POOL, *flags, env=env) as pd:
        before = moved(pd.prefill.log_text())
        out["pd"] = _levels(pd.url, args, prompts)
        time.sleep(MOVED_LOG_PERIOD_S + 0.5)  # the last count is logged within a period
        after = moved(pd.prefill.log_text())
        layout = layout_bytes(pd.prefill.log_text())
    sent = [prompts[i % len(prompts)] for i in range(args.num_prompts)]
    out["state_per_request"] = state = state_per_request(path, sent, layout)
    n = args.num_prompts * len(args.concurrency)  # each level sends the same prompts
    state["bytes_moved_mean"] = round((after[1] - before[1]) / n)
    state["transfers_per_request"] = round((after[0] - before[0]) / n, 2)
    state["moved_over_described"] = round(state["bytes_moved_mean"] / state["bytes_described_mean"], 4)
    out["ratios_pd_over_unified"] = [
        {
            "concurrency": u["concurrency"],
            "output_tok_per_s": round(p["output_tok_per_s"] / u["output_tok_per_s"], 3),
            "ttft_p50": round(p["ttft_ms"]["p50"] / u["ttft_ms"]["p50"], 3),
            "tpot_p50": round(p["tpot_ms"]["p50"] / u["tpot_ms"]["p50"], 3),
        }
        for u, p in zip(out["unified"], out["pd"])
    ]
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
