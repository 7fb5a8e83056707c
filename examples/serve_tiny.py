"""Serve the trained tiny DeepSeek-V4 that ships with the package with stock SGLang +
sglang-dsv4-ascend, speculating with its DSpark draft (adaptive verify), and show a completion
with its speculative statistics.

    python examples/serve_tiny.py [--prompt TEXT] [--no-spec] [--model-dir DIR | --random [--preset flash|pro]]
                                  [-- extra sglang args]

Starts `python -m sglang.launch_server` on `sglang_dsv4_ascend.TINY_MODEL_PATH` exactly as a user
would (the plugin is found through its entry points) with `--speculative-algorithm dspark`
(adaptive verify: a cost model measured at startup, verify lengths chosen from the draft's
calibrated confidences), sends a coding request as an OpenAI chat completion and prints the
answer with its speculative statistics (accept length, verify rounds, correct drafts per round,
verified rows per round), then the same conversation through the native /generate with its meta_info and the worker's stage
timings, and shuts the server down. The model is 8M parameters trained for ~50 minutes on the
Python standard library (MODEL_CARD.md): its code is fluent-looking, not correct, and its drafts
are right often enough to show what speculation does. `--random` serves a random-weight tiny
checkpoint instead (written with a fixed seed; gibberish, drafts almost never right).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    import sglang_dsv4_ascend as pkg

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None, help=f"checkpoint to serve (default: {pkg.TINY_MODEL_PATH})")
    ap.add_argument("--random", action="store_true", help="serve a random-weight tiny checkpoint written to build/")
    ap.add_argument("--preset", default="flash", choices=["flash", "pro"], help="shape of the --random checkpoint")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--no-spec", action="store_true", help="serve without speculative decoding")
    ap.add_argument("sglang_args", nargs="*", help="extra arguments for sglang.launch_server (after --)")
    a = ap.parse_args(argv)

    from sglang_dsv4_ascend.tools.server import SGLangServer

    model = a.model_dir or pkg.TINY_MODEL_PATH
    if a.random:
        from sglang_dsv4_ascend.tools.make_tiny_checkpoint import write_checkpoint

        model = a.model_dir or os.path.join("build", "tiny-dsv4-random")
        print(f"[demo] writing a random tiny DeepSeek-V4 ({a.preset}) to {model}", flush=True)
        write_checkpoint(model, a.preset, "dspark")
    prompt = a.prompt
    spec = [] if a.no_spec else SPEC_ARGS
    print(f"[demo] serving {model}", flush=True)
    print("[demo] starting the SGLang server (a minute or two on 2 CPU cores: SGLang's imports and the "
          f"model load){' with ' + ' '.join(spec) if spec else ''}...", flush=True)
    t0 = time.monotonic()
    with SGLangServer(model, *spec, *a.sglang_args) as srv:
        print(f"[demo] server up in {time.monotonic() - t0:.0f} s at {srv.url}; log: {srv.log_path}", flush=True)
        info = srv.server_info()
        print(f"[demo] attention backend: {info['attention_backend']}, device: {info['device']}", flush=True)
        t1 = time.monotonic()
        chat = srv.post("/v1/chat/completions", {
            "model": "tiny-dsv4", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": a.max_tokens, "temperature": 0, "return_spec_tokens_details": True,
        })
        dt = time.monotonic() - t1
        msg = chat["choices"][0]["message"]
        print(f"[demo] user:\n{prompt}\n")
        print(f"[demo] assistant ({chat['usage']['completion_tokens']} tokens in {dt:.1f} s):\n"
              f"{msg.get('content') or ''}\n")
        details = (chat.get("sglext") or {}).get("spec_tokens_details")
        if details:
            print("[demo] speculative stats of this completion (sglext.spec_tokens_details):")
            print(json.dumps(details, indent=2))
        # the same conversation as token ids in the chat format the model was trained on (the
        # chat API renders it so too), so the native meta_info below is this completion's
        from tokenizers import Tokenizer

        from sglang_dsv4_ascend.tools.tiny_corpus import chat_prompt

        ids = Tokenizer.from_file(os.path.join(model, "tokenizer.json")).encode(
            chat_prompt(prompt), add_special_tokens=False).ids
        gen = srv.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": a.max_tokens,
                                                                           "temperature": 0}})
        m = gen["meta_info"]
        print("[demo] /generate meta_info ->")
        print(json.dumps({k: v for k, v in m.items() if k != "output_token_logprobs"}, indent=2))
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


# The tiny model barely reads its prompt (MODEL_CARD.md): it writes standard-library-flavoured
# Python whatever is asked; on long humaneval problems its greedy text often falls into a loop.
DEFAULT_PROMPT = "Write a Python function that returns the largest number in a list."
SPEC_ARGS = ["--speculative-algorithm", "dspark", "--max-total-tokens", "32768"]


if __name__ == "__main__":
    sys.exit(main())
