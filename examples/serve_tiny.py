"""Serve the tiny DeepSeek-V4 with stock SGLang + sglang-dsv4-ascend, speculating with its DSpark
draft (adaptive verify), and show a completion with its speculative statistics.

    python examples/serve_tiny.py [--model-dir DIR] [--preset flash|pro] [--prompt TEXT] [--no-spec]
                                  [-- extra sglang args]

Writes the tiny checkpoint (fixed seed, with a DSpark draft, block size 4), starts
`python -m sglang.launch_server` on it exactly as a user would (the plugin is found through its
entry points) with `--speculative-algorithm dspark` (adaptive verify: a cost model measured at
startup, verify lengths chosen from the draft's confidences), sends one OpenAI chat completion and
one native /generate, prints both with the speculative statistics SGLang reports (accept length,
verify rounds, correct drafts per round, verified rows per round) and the worker's stage timings,
and shuts the server down. The model is random, so the text is gibberish and the draft is almost
never right (accept length ~1.0); what matters is that it is served by our DeepSeek-V4,
speculatively and losslessly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=os.path.join("build", "tiny-dsv4"))
    ap.add_argument("--preset", default="flash", choices=["flash", "pro"])
    ap.add_argument("--prompt", default="Janet's ducks lay 16 eggs per day. How many eggs are left?")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-spec", action="store_true", help="serve without speculative decoding")
    ap.add_argument("sglang_args", nargs="*", help="extra arguments for sglang.launch_server (after --)")
    a = ap.parse_args(argv)

    from sglang_dsv4_ascend.tools.make_tiny_checkpoint import write_checkpoint
    from sglang_dsv4_ascend.tools.server import SGLangServer

    print(f"[demo] writing the tiny DeepSeek-V4 ({a.preset}) to {a.model_dir}", flush=True)
    write_checkpoint(a.model_dir, a.preset, "dspark")
    spec = [] if a.no_spec else SPEC_ARGS
    print("[demo] starting the SGLang server (a minute or two on 2 CPU cores: SGLang's imports and the "
          f"model load){' with ' + ' '.join(spec) if spec else ''}...", flush=True)
    t0 = time.monotonic()
    with SGLangServer(a.model_dir, *spec, *a.sglang_args) as srv:
        print(f"[demo] server up in {time.monotonic() - t0:.0f} s at {srv.url}; log: {srv.log_path}", flush=True)
        info = srv.server_info()
        print(f"[demo] attention backend: {info['attention_backend']}, device: {info['device']}", flush=True)
        chat = srv.post("/v1/chat/completions", {
            "model": "tiny-dsv4", "messages": [{"role": "user", "content": a.prompt}],
            "max_tokens": a.max_tokens, "temperature": 0,
        })
        print("[demo] /v1/chat/completions ->")
        print(json.dumps(chat, indent=2, ensure_ascii=False))
        gen = srv.post("/generate", {"text": a.prompt, "sampling_params": {"max_new_tokens": a.max_tokens,
                                                                            "temperature": 0}})
        print("[demo] /generate meta_info ->")
        print(json.dumps(gen["meta_info"], indent=2))
        m = gen["meta_info"]
        if m.get("spec_verify_ct"):
            h = m.get("spec_correct_drafts_histogram") or []
            per_round = 1 + sum(k * n for k, n in enumerate(h)) / max(1, sum(h))
            print(f"[demo] speculative: {m['spec_verify_ct']} verify rounds, {per_round:.2f} tokens per round "
                  f"(accepted drafts + bonus; rounds by accepted drafts 0..steps: {h}); SGLang's "
                  f"spec_accept_length {m['spec_accept_length']:.2f} also counts the prefill's token")
            if m.get("spec_cap_lens_histogram"):
                print(f"[demo] verified rows per round (anchor included) {m['spec_cap_length']:.2f}, "
                      f"rounds by verified rows: {m['spec_cap_lens_histogram']}")
            rec = (srv.server_info().get("internal_states") or [{}])[0].get("dspark_info_record")
            if rec:
                print(f"[demo] worker stage ms per round: {rec['stage_ms_per_round']}")
    return 0


SPEC_ARGS = ["--speculative-algorithm", "dspark", "--max-total-tokens", "32768"]


if __name__ == "__main__":
    sys.exit(main())
