"""Serve the tiny DeepSeek-V4 with stock SGLang + sglang-dsv4-ascend and show a completion.

    python examples/serve_tiny.py [--model-dir DIR] [--preset flash|pro] [--prompt TEXT] [-- extra sglang args]

Writes the tiny checkpoint (fixed seed), starts `python -m sglang.launch_server` on it exactly as a
user would (the plugin is found through its entry points), sends one OpenAI chat completion and
one native /generate, prints both, and shuts the server down. The model is random, so the text is
gibberish; what matters is that it is served by our DeepSeek-V4 and matches HF transformers.
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
    ap.add_argument("sglang_args", nargs="*", help="extra arguments for sglang.launch_server (after --)")
    a = ap.parse_args(argv)

    from sglang_dsv4_ascend.tools.make_tiny_checkpoint import write_checkpoint
    from sglang_dsv4_ascend.tools.server import SGLangServer

    print(f"[demo] writing the tiny DeepSeek-V4 ({a.preset}) to {a.model_dir}", flush=True)
    write_checkpoint(a.model_dir, a.preset, "dspark")
    print("[demo] starting the SGLang server (a minute or two on 2 CPU cores: SGLang's imports and the "
          "model load)...", flush=True)
    t0 = time.monotonic()
    with SGLangServer(a.model_dir, *a.sglang_args) as srv:
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
