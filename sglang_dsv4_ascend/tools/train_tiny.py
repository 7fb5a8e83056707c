"""Train the tiny DeepSeek-V4 that ships with the package, with its NextN and DSpark drafts.

    python -m sglang_dsv4_ascend.tools.train_tiny OUT_DIR [--target-steps N] [--smoke]

Stages (each resumable: rerun the same command and it continues from its last saved state in
OUT_DIR/work):
  1. tokenizer  byte-level BPE (4096) trained on the corpus (tools/tiny_corpus.py: the Python
                standard library's source and its documented functions as chat samples);
  2. target     the `trained` preset (13 layers: SWA, CSA with the lightning indexer, HCA; hash
                and score-routed MoE; mHC) trained as HF transformers' DeepseekV4ForCausalLM,
                an implementation independent of ours, then written under the released names and
                rounded to bf16, the dtype it ships in;
  3. self-data  the frozen target's own continuations (greedy and T = 0.8) of corpus prefixes
                and chat prompts, through our serving forward;
  4. nextn      the NextN block `mtp.0` against the frozen target (train_drafts.nextn_loss);
  5. dspark     the three DSpark stages, Markov and confidence heads (train_drafts.dspark_loss);
  6. sts        sequential temperature scaling of the confidence on held-out greedy
                generations (what the adaptive planner reads);
and writes OUT_DIR/dspark (the target + DSpark draft + dspark_sts.json), OUT_DIR/nextn (the same
target + NextN draft; its trunk shard and tokenizer are links into ../dspark) and
OUT_DIR/training_report.json (losses, acceptance, timings). Fixed seeds and a deterministic data
order make a rerun on the same Python version (same standard library) and torch reproduce it;
`--smoke` runs every stage for a few steps (tests, and a check before the real run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch

from . import make_tiny_checkpoint as mk
from . import tiny_corpus as corpus
from . import train_drafts as td

PRESET = "trained"


class Run:
    def __init__(self, out: str, args):
        self.out, self.args = out, args
        self.work = os.path.join(out, "work")
        os.makedirs(self.work, exist_ok=True)
        self.report_path = os.path.join(out, "training_report.json")
        self.report = json.load(open(self.report_path)) if os.path.exists(self.report_path) else {}

    def path(self, name):
        return os.path.join(self.work, name)

    def extend_target(self, steps: int):
        """A finished target asked for more steps trains on from its last state (the cosine
        schedule is then taken over the new total), and everything derived from it is redone."""
        done_steps = self.report.get("target", {}).get("steps")
        if not self.done("target") or done_steps is None or steps <= done_steps:
            return
        print(f"[2/6] target: extending {done_steps} -> {steps} steps; the later stages are redone", file=sys.stderr)
        later = ("target", "selfdata", "nextn", "dspark", "sts")
        self.report["done"] = [s for s in self.report["done"] if s not in later]
        self.report.setdefault("target", {}).setdefault("extended_from", []).append(done_steps)
        for name in (
            "selfdata.pt",
            "nextn_state.pt",
            "nextn_tensors.pt",
            "dspark_state.pt",
            "dspark_tensors.pt",
            "dspark_module.pt",
            "dspark_sts.json",
        ):
            if os.path.exists(self.path(name)):
                os.remove(self.path(name))
        for stage in later[1:]:
            self.report.pop(stage, None)
        shutil.rmtree(self.path("target"), ignore_errors=True)
        self.save_report()

    def done(self, stage):
        return stage in self.report.get("done", [])

    def finish(self, stage, **info):
        self.report.setdefault("done", []).append(stage)
        self.report[stage] = {**self.report.get(stage, {}), **info}
        self.save_report()

    def save_report(self):
        with open(self.report_path, "w") as f:
            json.dump(self.report, f, indent=2)
            f.write("\n")


def _bar(total, desc, initial=0):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, initial=initial, dynamic_ncols=True, file=sys.stderr)


def _lr(step, total, peak, warmup):
    import math

    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


# -- 1. tokenizer and data -------------------------------------------------------------------------
def stage_tokenizer(run: Run):
    if run.done("tokenizer"):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(run.path("tokenizer.json")), torch.load(run.path("tokens.pt"))
    t0 = time.time()
    print("[1/6] tokenizer: reading the standard library ...", file=sys.stderr)
    train, hold = corpus.documents(run.args.seed)
    tok = mk.build_tokenizer(mk.PRESETS[PRESET], (line for d in train for line in d.splitlines(keepends=True)))
    tok.save(run.path("tokenizer.json"))
    data = {"train": corpus.tokenize(tok, train), "holdout": corpus.tokenize(tok, hold)}
    torch.save(data, run.path("tokens.pt"))
    chat = sum(d.startswith(corpus.BOS + corpus.USER) for d in train)
    run.finish(
        "tokenizer",
        documents=len(train),
        chat_samples=chat,
        holdout_documents=len(hold),
        train_tokens=int(data["train"].numel()),
        holdout_tokens=int(data["holdout"].numel()),
        chars=sum(map(len, train)),
        seconds=round(time.time() - t0, 1),
    )
    return tok, data


# -- 2. target -------------------------------------------------------------------------------------
def _hf_to_released(hf_sd: dict, init: dict) -> dict:
    """{hf name: [(released name, slicer)]} found by value: HF was loaded from `init` (random,
    every tensor distinct), so each HF tensor (or expert slice of a merged one) equals exactly
    one released tensor. Derived, not hand-written, so it follows HF's conversion mapping."""
    by_shape = {}
    for k, v in init.items():
        by_shape.setdefault(tuple(v.shape), []).append(k)
    out = {}
    for name, t in hf_sd.items():
        t = t.float()
        hits = [k for k in by_shape.get(tuple(t.shape), []) if torch.equal(init[k].float(), t)]
        if len(hits) == 1:
            out[name] = [(hits[0], None)]
            continue
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            pre = name.replace("model.", "", 1).rsplit(".experts.", 1)[0].replace(".mlp", ".ffn")
            parts = []
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    I = t.shape[1] // 2
                    parts += [
                        (f"{pre}.experts.{e}.w1.weight", (e, slice(0, I))),
                        (f"{pre}.experts.{e}.w3.weight", (e, slice(I, None))),
                    ]
                else:
                    parts.append((f"{pre}.experts.{e}.w2.weight", (e, slice(None))))
            for k, sl in parts:
                if not torch.equal(init[k].float(), t[sl]):
                    raise RuntimeError(f"HF {name}{sl} does not hold {k}: the expert layout changed")
            out[name] = parts
            continue
        raise RuntimeError(f"HF tensor {name} {tuple(t.shape)} matches {len(hits)} released tensors")
    return out


def _released(hf_sd: dict, mapping: dict, init: dict) -> dict:
    """The released tensors: init's names and dtypes, HF's trained values."""
    out = dict(init)
    for name, parts in mapping.items():
        for k, sl in parts:
            v = hf_sd[name] if sl is None else hf_sd[name][sl]
            out[k] = v.detach().to(init[k].dtype).contiguous()
    return out


def _write_variant(dirpath: str, cfg: dict, tensors: dict, tok):
    mk.write_files(dirpath, cfg, tensors, tok)


def stage_target(run: Run, tok, data):
    a = run.args
    p = mk.PRESETS[PRESET]
    cfg = mk.build_config(p, "dspark")
    target_dir = run.path("target")
    if run.done("target"):
        return target_dir, cfg
    from transformers import DeepseekV4ForCausalLM

    init = mk.build_tensors(p, "dspark", a.seed)
    init_dir = run.path("init")
    if not os.path.exists(os.path.join(init_dir, "config.json")):
        _write_variant(init_dir, cfg, init, tok)
    torch.manual_seed(a.seed)
    hf = DeepseekV4ForCausalLM.from_pretrained(init_dir, torch_dtype=torch.float32)
    mapping = _hf_to_released(hf.state_dict(), init)
    n_params = sum(t.numel() for k, t in init.items() if not k.startswith("mtp."))
    hf.train()
    params = [q for q in hf.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.05)
    state_path, step = run.path("target_state.pt"), 0
    if os.path.exists(state_path):
        st = torch.load(state_path)
        hf.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
        print(f"[2/6] target: resuming at step {step}", file=sys.stderr)
    batches = corpus.Batches(data["train"], a.batch, a.seq_len, a.seed)
    total, losses = a.target_steps, run.report.get("target", {}).get("loss_curve", [])
    bar = _bar(total, "[2/6] target", step)
    t0, toks = time.time(), 0
    while step < total:
        x = batches(step)
        for gr in opt.param_groups:
            gr["lr"] = _lr(step, total, a.lr, a.warmup)
        loss = hf(input_ids=x[:, :-1], labels=x[:, :-1]).loss  # HF shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        toks += x[:, :-1].numel()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{toks / (time.time() - t0):.0f}")
        if step % 10 == 0 or step == total:
            losses.append([step, round(loss.item(), 4)])
        if step % a.save_every == 0 or step == total:
            torch.save({"model": hf.state_dict(), "opt": opt.state_dict(), "step": step}, state_path)
            run.report.setdefault("target", {})["loss_curve"] = losses
            run.save_report()
    bar.close()
    hf.eval()
    hold = _holdout_loss(lambda x: hf(input_ids=x, labels=x).loss, data["holdout"], a.seq_len)
    released = _released(hf.state_dict(), mapping, init)
    _write_variant(target_dir, cfg, released, tok)
    # the exported checkpoint, read back by HF, is the model that was trained (up to bf16)
    hf2 = DeepseekV4ForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    hold_bf16 = _holdout_loss(lambda x: hf2(input_ids=x, labels=x).loss, data["holdout"], a.seq_len)
    run.finish(
        "target",
        steps=total,
        batch=a.batch,
        seq_len=a.seq_len,
        lr=a.lr,
        params=n_params,
        tokens_seen=total * a.batch * a.seq_len,
        holdout_loss_fp32=hold,
        holdout_loss_bf16=hold_bf16,
        loss_curve=losses,
        seconds=round(time.time() - t0, 1) + run.report.get("target", {}).get("seconds", 0),
    )
    return target_dir, cfg


@torch.no_grad()
def _holdout_loss(fn, stream, seq_len, n=8):
    L = min(seq_len, (stream.numel() - 1) // n)
    xs = stream[: n * L].view(n, L).long()
    return round(float(fn(xs)), 4)


# -- 3. the target's own generations ------------------------------------------------------------------
def stage_selfdata(run: Run, tok, data, target):
    if run.done("selfdata"):
        return torch.load(run.path("selfdata.pt"))
    a = run.args
    t0 = time.time()
    train, _ = corpus.documents(a.seed)
    chats = [
        d[: d.index(corpus.ASSISTANT) + len(corpus.ASSISTANT + corpus.THINK_END)]
        for d in train
        if d.startswith(corpus.BOS + corpus.USER)
    ]
    g = torch.Generator().manual_seed(a.seed + 7)
    n = a.gen_seqs
    chat_ids = [
        tok.encode(chats[i], add_special_tokens=False).ids[-a.gen_prompt :]
        for i in torch.randperm(len(chats), generator=g)[: n // 2].tolist()
    ]
    starts = torch.randint(0, data["train"].numel() - a.gen_prompt, (n - len(chat_ids),), generator=g).tolist()
    code_ids = [data["train"][s : s + a.gen_prompt].tolist() for s in starts]
    prompts = chat_ids + code_ids
    out = {"greedy": [], "sampled": []}
    bar = _bar(2, "[3/6] self-data (greedy, T=0.8)")
    for kind, temp in (("greedy", 0.0), ("sampled", 0.8)):
        for i in range(0, len(prompts), a.gen_batch):
            out[kind] += td.generate(target, prompts[i : i + a.gen_batch], a.gen_new, temp, seed=a.seed + i)
        bar.update(1)
    bar.close()
    torch.save(out, run.path("selfdata.pt"))
    sample = tok.decode(out["greedy"][0], skip_special_tokens=False)
    run.finish(
        "selfdata",
        sequences=len(prompts) * 2,
        new_tokens_each=a.gen_new,
        prompt_tokens=a.gen_prompt,
        seconds=round(time.time() - t0, 1),
        greedy_sample=sample[-600:],
    )
    return out


def _draft_batches(selfdata, data, a, hold_out: int):
    """Batch i: alternately windows of the target's own generations (all but the last `hold_out`
    greedy ones, kept for calibration) and of the corpus."""
    gen = [torch.tensor(s) for s in selfdata["greedy"][:-hold_out] + selfdata["sampled"]]
    S = min(a.draft_seq_len, min(len(s) for s in gen) - 1)
    corpus_batches = corpus.Batches(data["train"], a.draft_batch, S, a.seed + 1)

    def get(i):
        if i % 2:
            return corpus_batches(i)
        gg = torch.Generator().manual_seed(a.seed * 31 + i)
        pick = torch.randint(0, len(gen), (a.draft_batch,), generator=gg).tolist()
        rows = []
        for j in pick:
            s = gen[j]
            o = int(torch.randint(0, len(s) - S, (1,), generator=gg))
            rows.append(s[o : o + S + 1])
        return torch.stack(rows).long()

    return get


def _train_draft(run: Run, name, module, loss_fn, steps, batches, lr, desc):
    state_path = run.path(f"{name}_state.pt")
    params = [q for n, q in module.named_parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, curve = 0, run.report.get(name, {}).get("loss_curve", [])
    if os.path.exists(state_path):
        st = torch.load(state_path)
        module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
    module.train()
    bar = _bar(steps, desc, step)
    t0 = time.time()
    while step < steps:
        for gr in opt.param_groups:
            gr["lr"] = _lr(step, steps, lr, 20)
        loss, stats = loss_fn(batches(step), step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in stats.items()})
        if step % 10 == 0 or step == steps:
            curve.append([step, {k: round(v, 4) for k, v in stats.items()}])
        if step % run.args.save_every == 0 or step == steps:
            torch.save({"model": module.state_dict(), "opt": opt.state_dict(), "step": step}, state_path)
            run.report.setdefault(name, {})["loss_curve"] = curve
            run.save_report()
    bar.close()
    module.eval()
    return curve, round(time.time() - t0, 1)


def _load_draft_init(kind, cfg_dict, seed):
    """Random init of a draft under its released names (the same factory as the random tiny)."""
    from ..config import DSV4Config
    from ..models.dspark import DSparkDraft, load_dspark
    from ..models.nextn import PREFIX, NextN
    from ..models.weights import load_released_weights

    p = mk.PRESETS[PRESET]
    tensors = {k: v for k, v in mk.build_tensors(p, kind, seed + 1).items() if k.startswith("mtp.")}
    cfg = DSV4Config.from_hf(mk.build_config(p, kind))
    if kind == "nextn":
        m = NextN(cfg)
        load_released_weights(m, ((k, v) for k, v in tensors.items()), source="init", prefix=PREFIX)
    else:
        m = DSparkDraft(cfg, confidence_bias=True)
        load_dspark(m, list(tensors.items()), source="init")
    return m, tensors


def _draft_tensors(module, init: dict, prefix: str) -> dict:
    sd = module.state_dict() if prefix == "mtp.0." else module.mtp.state_dict()
    out = {}
    for k, v in init.items():
        key = k[len(prefix) :]
        out[k] = sd[key].detach().to(v.dtype).contiguous()
    return out


def stage_nextn(run: Run, target, selfdata, data):
    if run.done("nextn"):
        return torch.load(run.path("nextn_tensors.pt"))
    a = run.args
    nextn, init = _load_draft_init("nextn", None, a.seed)
    batches = _draft_batches(selfdata, data, a, a.calib_seqs)

    def loss_fn(x, step):
        return td.nextn_loss(nextn, target.embed, target.head.weight, x, td.target_outputs(target, x[:, :-1]))

    curve, secs = _train_draft(run, "nextn", nextn, loss_fn, a.nextn_steps, batches, a.draft_lr, "[4/6] nextn")
    tensors = _draft_tensors(nextn, init, "mtp.0.")
    torch.save(tensors, run.path("nextn_tensors.pt"))
    hold = torch.stack([torch.tensor(s) for s in selfdata["greedy"][-a.calib_seqs :]])
    with torch.no_grad():
        _, st = td.nextn_loss(nextn, target.embed, target.head.weight, hold, td.target_outputs(target, hold[:, :-1]))
    run.finish(
        "nextn", steps=a.nextn_steps, loss_curve=curve, seconds=secs, heldout_greedy_top1_agreement=round(st["acc1"], 4)
    )
    return tensors


def stage_dspark(run: Run, target, selfdata, data):
    if run.done("dspark"):
        return torch.load(run.path("dspark_tensors.pt"))
    a = run.args
    draft, init = _load_draft_init("dspark", None, a.seed)
    batches = _draft_batches(selfdata, data, a, a.calib_seqs)
    gamma, lids = target.cfg.dspark_block_size, target.cfg.dspark_target_layer_ids

    def loss_fn(x, step):
        tgt = td.target_outputs(target, x[:, :-1], lids)
        return td.dspark_loss(
            draft,
            target.embed,
            target.head.weight,
            x,
            tgt,
            gamma,
            a.anchors,
            torch.Generator().manual_seed(a.seed * 17 + step),
        )

    curve, secs = _train_draft(run, "dspark", draft, loss_fn, a.dspark_steps, batches, a.draft_lr, "[5/6] dspark")
    tensors = _draft_tensors(draft, init, "mtp.")
    torch.save(tensors, run.path("dspark_tensors.pt"))
    torch.save(draft.state_dict(), run.path("dspark_module.pt"))
    run.finish("dspark", steps=a.dspark_steps, gamma=gamma, anchors_per_seq=a.anchors, loss_curve=curve, seconds=secs)
    return tensors


def stage_sts(run: Run, target, selfdata, dspark_tensors):
    if run.done("sts"):
        return json.load(open(run.path("dspark_sts.json")))
    a = run.args
    draft, _ = _load_draft_init("dspark", None, a.seed)
    draft.load_state_dict(torch.load(run.path("dspark_module.pt")))
    draft.eval()
    gamma, lids = target.cfg.dspark_block_size, target.cfg.dspark_target_layer_ids
    hold = torch.stack([torch.tensor(s) for s in selfdata["greedy"][-a.calib_seqs :]])
    S = hold.shape[1] - 1
    tgt = td.target_outputs(target, hold[:, :-1], lids)
    L = torch.arange(a.gen_prompt, S - gamma + 1).expand(hold.shape[0], -1)  # every anchor in the generated part
    e, ok = td.dspark_greedy_rollout(draft, target.embed, target.head.weight, hold, tgt, L, gamma)
    temps, rep = td.sequential_temperatures(e, ok)
    sts = {
        "temperatures": temps,
        "method": "sequential temperature scaling (train_drafts.sequential_temperatures)",
        "positions": rep,
    }
    with open(run.path("dspark_sts.json"), "w") as f:
        json.dump(sts, f, indent=2)
        f.write("\n")
    acc = ok.float().mean(0).tolist()
    run.finish(
        "sts",
        anchors=int(e.shape[0]),
        greedy_survival_by_position=[round(v, 4) for v in acc],
        mean_accepted_drafts=round(float(ok.float().sum(1).mean()), 4),
        temperatures=temps,
    )
    return sts


# -- assembly ----------------------------------------------------------------------------------------
def assemble(run: Run, tok, target_dir, nextn_tensors, dspark_tensors, sts):
    from safetensors.torch import load_file

    trunk = load_file(os.path.join(target_dir, "model-00001-of-00002.safetensors"))
    p = mk.PRESETS[PRESET]
    ds, nx = os.path.join(run.out, "dspark"), os.path.join(run.out, "nextn")
    for d in (ds, nx):
        if os.path.exists(d):
            shutil.rmtree(d)
    mk.write_files(ds, mk.build_config(p, "dspark"), {**trunk, **dspark_tensors}, tok)
    with open(os.path.join(ds, "dspark_sts.json"), "w") as f:
        json.dump(sts, f, indent=2)
        f.write("\n")
    mk.write_files(nx, mk.build_config(p, "nextn"), {**trunk, **nextn_tensors}, tok)
    # one copy of the trunk and tokenizer: the NextN variant links to the DSpark one's files
    for fname in ("model-00001-of-00002.safetensors", "tokenizer.json"):
        os.remove(os.path.join(nx, fname))
        os.symlink(os.path.join("..", "dspark", fname), os.path.join(nx, fname))
    sizes = {
        d: sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if not os.path.islink(os.path.join(d, f)))
        for d in (ds, nx)
    }
    run.report["files"] = {os.path.basename(k): v for k, v in sizes.items()}
    run.save_report()
    return ds, nx


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--gen-seqs", type=int, default=64)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--gen-prompt", type=int, default=48)
    ap.add_argument("--gen-new", type=int, default=272)
    ap.add_argument("--calib-seqs", type=int, default=8)
    ap.add_argument("--nextn-steps", type=int, default=300)
    ap.add_argument("--dspark-steps", type=int, default=400)
    ap.add_argument("--draft-batch", type=int, default=8)
    ap.add_argument("--draft-seq-len", type=int, default=256)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--save-every", type=int, default=25)
    ap.add_argument("--smoke", action="store_true", help="every stage for a few steps (checks the pipeline)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.target_steps, a.nextn_steps, a.dspark_steps = 3, 3, 3
        a.batch, a.seq_len, a.gen_seqs, a.gen_batch, a.gen_new, a.calib_seqs = 2, 160, 8, 8, 40, 2
        a.gen_prompt, a.draft_seq_len, a.anchors, a.save_every = 32, 64, 4, 2
    for name in (
        "target_steps",
        "batch",
        "seq_len",
        "gen_seqs",
        "nextn_steps",
        "dspark_steps",
        "draft_batch",
        "anchors",
    ):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.calib_seqs >= a.gen_seqs:
        ap.error(f"--calib-seqs ({a.calib_seqs}) must be smaller than --gen-seqs ({a.gen_seqs})")
    torch.manual_seed(a.seed)
    run = Run(a.out_dir, a)
    run.extend_target(a.target_steps)
    run.report["config"] = {k: v for k, v in vars(a).items() if k != "out_dir"}
    run.report["torch"], run.report["python"] = torch.__version__, sys.version.split()[0]
    t0 = time.time()
    tok, data = stage_tokenizer(run)
    target_dir, _ = stage_target(run, tok, data)
    from ..models.weights import load_model_from_dir

    target = load_model_from_dir(target_dir)  # the frozen target as served (bf16 weights, fp32 math)
    selfdata = stage_selfdata(run, tok, data, target)
    nextn_tensors = stage_nextn(run, target, selfdata, data)
    dspark_tensors = stage_dspark(run, target, selfdata, data)
    sts = stage_sts(run, target, selfdata, dspark_tensors)
    ds, nx = assemble(run, tok, target_dir, nextn_tensors, dspark_tensors, sts)
    run.report["total_seconds_this_run"] = round(time.time() - t0, 1)
    run.save_report()
    print(f"wrote {ds} and {nx}; report {run.report_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
