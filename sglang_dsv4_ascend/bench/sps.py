"""The DSpark round cost surface of this machine, for `--speculative-dspark-sps-table-path`:

    python -m sglang_dsv4_ascend.bench sps [--model-dir DIR | --preset flash|pro] [--gamma 4]
        [--max-requests 16] [--budget-s 20] [--out sps.json]

Times target forwards of R requests x k verify rows (speculative/planner.measure_cost, writes
deferred and dropped) and the DSpark draft step over R requests on the checkpoint (default: the
tiny one, written to a temporary dir), fits the additive surface t(R, m) = bias + alpha(R) +
theta(m) plus draft(R) (speculative/cost.py), and prints (and with --out writes) the JSON the
server loads: SGLang's `SpsAdditiveCostTable` fields, our `draft_seconds`, the measured points and
the surface's prediction next to each. Timings are one run on this machine; the server measures
the same at startup when no file is given, and refines it online from its own rounds either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None, help="a DeepSeek-V4 checkpoint (default: the tiny one)")
    ap.add_argument("--preset", default="flash", choices=["flash", "pro"])
    ap.add_argument("--gamma", type=int, default=4, help="DSpark block size (rows per request up to gamma + 1)")
    ap.add_argument("--max-requests", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=20.0, help="stop measuring after this many seconds")
    ap.add_argument("--out", default=None, help="write the table here")
    a = ap.parse_args(argv)
    if a.gamma < 1 or a.max_requests < 1:
        ap.error("--gamma and --max-requests must be >= 1")
    import types

    import torch

    from ..models.dspark import load_dspark_from_dir
    from ..models.weights import load_model_from_dir
    from ..speculative.drafters import DSparkDrafter
    from ..speculative.planner import measure_cost

    d = a.model_dir
    if d is None:
        from ..tools.make_tiny_checkpoint import write_checkpoint

        d = write_checkpoint(tempfile.mkdtemp(prefix="sps-") + "/ck", a.preset, "dspark")
    trunk = load_model_from_dir(d)
    cache = trunk.make_cache(a.max_requests, 512, a.gamma + 1)
    drafter = None
    if trunk.cfg.dspark_target_layer_ids:
        try:
            model = types.SimpleNamespace(model=trunk, dspark=load_dspark_from_dir(d, trunk.cfg), cfg=trunk.cfg)
        except (KeyError, ValueError, OSError, RuntimeError) as e:  # no DSpark draft: verify only
            print(f"[sps] no DSpark draft timed ({e})", file=sys.stderr)
        else:
            engine = types.SimpleNamespace(
                model=model, cache=cache, device=torch.device("cpu"), gamma=a.gamma, generator=torch.Generator()
            )
            drafter = DSparkDrafter(engine)
    m = measure_cost(trunk, cache, a.gamma, a.max_requests, a.budget_s, drafter=drafter)
    doc = {
        "bench": "sps",
        "model": d,
        "gamma": a.gamma,
        **m.to_json(),
        "predicted_s": [round(m(r, b), 6) for r, b, _ in m.points],
        "source": m.source,
    }
    text = json.dumps(doc, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
