"""Request validation at the server boundary: what a request may ask, checked before it reaches
the scheduler, refused with a 4xx that names the field and the allowed range.

One bad request must never take the server down. Stock SGLang 0.5.23 lets through requests that
crash the scheduler process, and with it every other request in flight:

* `input_ids` outside [0, vocab): the embedding gather indexes out of bounds (an IndexError on
  CPU; on an accelerator an out-of-range gather can read garbage or fault the device);
* `top_logprobs_num` (OpenAI: completions `logprobs`, chat `top_logprobs`) above the vocabulary:
  `topk` in SGLang's logprob processor raises "selected index k out of range";
* numeric sampling values that SGLang's own checks (`SamplingParams.verify` and the context-length
  check) let through but its scheduler cannot hold: a `temperature` past float32's range (1e39 is
  finite for SGLang's check but inf in the sampler's float32 tensor, and the speculative accept
  step raised on it), `top_k` past int32 (the sampler's top-k tensor, with or without
  speculation), `min_new_tokens` past int32 when `max_new_tokens` is null (the min-new-tokens
  penalizer's tensor).

Other requests are accepted and answered as if they said something else (the DeepSeek-V4 model
ignores `input_embeds`; `text` together with `input_ids` silently uses the ids), or cost every
other user a long stall (a multi-megabyte body spends seconds in the tokenizer before it is
refused; `n=1000` runs a thousand generations). Those are refused too, with documented,
configurable limits:

    SGLANG_DSV4_MAX_REQUEST_BYTES   largest HTTP request body (default: max(1 MiB, 32 bytes per
                                    context token)); bigger bodies get 413 before they are read
    SGLANG_DSV4_MAX_N               largest `n` (parallel samples) per request (default 64)

What `check_sampling` adds to SGLang's own checks, which already refuse a negative or non-finite
temperature, top_p outside (0, 1], min_p outside [0, 1], penalties outside their ranges,
max_new_tokens < 0 or past the context, min_new_tokens above max_new_tokens, sampling_seed outside
int64 and logit_bias keys outside the vocabulary:

    n                 an integer in [1, SGLANG_DSV4_MAX_N] (`n: 0` reached SGLang's range() as
                      "range() arg 3 must not be zero"), checked before SGLang expands it
    temperature       a number in [0, 3.4028235e38], float32's largest (the value SGLang's sampler
                      and the speculative path compute with)
    top_k             -1 (every token) or an integer >= 1, on every route and at any temperature
                      (SGLang lets 0 through when the temperature is 0, so `top_k: 0` was a 200 or
                      a 400 depending on the other fields). A top_k above the vocabulary keeps every
                      token: it is served as -1 (clamped, not refused; SGLang's own "every token"
                      value, 2**30, is above any vocabulary and clients send such values)
    min_new_tokens    at most the context length
    logit_bias        values in [-100, 100], OpenAI's documented range (a larger bias divided by a
                      small temperature overflows float32 in the sampler)
    stream_interval   an integer in [0, 2**31 - 1] (0: the server's --stream-interval)
    stop_token_ids    token ids in [0, vocab)

Where the checks run (hooks in integration/hooks/, all written down in patches/README.md):
* `check_request` is called by the BEFORE hook `request_validation` on
  `TokenizerManager._validate_one_request`, the one per-request validation step SGLang runs for
  single, batched, OpenAI completion and chat requests, after tokenization and before anything is
  sent to the scheduler. A ValueError there becomes SGLang's own 400 response.
* `check_n` runs first in the AROUND hook `request_normalize_errors` on
  `GenerateReqInput.normalize_batch_and_arguments`, before SGLang expands the request into n
  copies; that hook turns any error of the step (it only reshapes the client's fields) into a 400.
* `RequestGate` is an ASGI middleware the hook `http_request_gate` adds to SGLang's FastAPI app
  when the HTTP server launches: an oversized body is refused before it is parsed or tokenized,
  and a body of a shape SGLang's own parsing would crash on (a JSON list instead of an object, a
  string where an object belongs, nesting deeper than MAX_JSON_DEPTH) gets a 400 naming the field.
* the hook `generate_stream_refusals` on `http_server.serve_generate_request` gives a streamed
  /generate request that any validation refuses the same 4xx as a non-streamed one instead of a
  200 whose stream carries the error, as SGLang's OpenAI routes already do.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass

from .. import settings

MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_CONTEXT_TOKEN = 32  # a JSON token id is ~6 bytes, a text token ~4 chars (x6 escaped)
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1
LOGIT_BIAS_MAX = 100.0
# Far deeper than any real request (chat content parts, JSON schemas, tools) and far below where
# Python's json (a RecursionError) and the libraries after it give up (orjson parses 1024 levels
# but serializes only 255: echoing or logging a deeper body fails).
MAX_JSON_DEPTH = 64


class RequestRejected(ValueError):
    """A request the server will not run; SGLang answers ValueErrors from validation with 400."""


def max_n() -> int:
    return settings.MAX_N.get()


def max_body_bytes(context_len: int | None) -> int:
    default = max(MIN_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * int(context_len or 0))
    return settings.MAX_REQUEST_BYTES.get(default=default)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fits_float32(x) -> bool:
    """Whether x stays a finite number once stored as float32 (rounding as torch does)."""
    try:
        return math.isfinite(struct.unpack("f", struct.pack("f", float(x)))[0])
    except OverflowError:  # an integer beyond float64 (older Pythons also refuse to round to inf)
        return False


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def check_n(params: dict) -> None:
    n = params.get("n", 1)
    limit = max_n()
    if not _is_int(n) or n < 1:
        raise RequestRejected(f"n = {_short(n)}: expected an integer in [1, {limit}] (parallel samples per request)")
    if n > limit:
        raise RequestRejected(
            f"n = {n}: at most {limit} parallel samples per request, expected an integer in "
            f"[1, {limit}] ({settings.MAX_N.name} to change)"
        )


def check_sampling(params: dict, *, vocab_size: int, context_len: int | None = None) -> dict:
    """Refuse (RequestRejected naming the field and its range) the numeric sampling values listed in
    the module docstring. Returns the parameters to serve: `params` itself, or a copy whose top_k
    above the vocabulary is -1."""
    check_n(params)
    t = params.get("temperature")
    if _is_number(t) and not (_fits_float32(t) and t >= 0):
        raise RequestRejected(
            f"temperature = {_short(t)}: expected a number in [0, {FLOAT32_MAX:.8g}] (float32, "
            "what the sampler computes in; 0 = greedy)"
        )
    k = params.get("top_k")
    if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
        raise RequestRejected(
            f"top_k = {_short(k)}: expected -1 (every token) or an integer in [1, {vocab_size}] "
            "(the vocabulary size; a larger top_k keeps every token, as -1 does)"
        )
    if k is not None and k > vocab_size:
        params = {**params, "top_k": -1}  # past int32 it would crash SGLang's sampler; the meaning is the same
    m = params.get("min_new_tokens")
    most = context_len or INT32_MAX
    if _is_int(m) and m > most:
        raise RequestRejected(f"min_new_tokens = {_short(m)}: expected an integer in [0, {most}] (the context length)")
    bias = params.get("logit_bias")
    if isinstance(bias, dict):
        for token, b in bias.items():
            if _is_number(b) and not (_fits_float32(b) and abs(b) <= LOGIT_BIAS_MAX):
                raise RequestRejected(
                    f"logit_bias[{token!r}] = {_short(b)}: expected a number in "
                    f"[-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]"
                )
    every = params.get("stream_interval")
    if every is not None and (not _is_int(every) or not 0 <= every <= INT32_MAX):
        raise RequestRejected(
            f"stream_interval = {_short(every)}: expected an integer in [0, {INT32_MAX}] "
            "(0: the server's --stream-interval)"
        )
    stops = params.get("stop_token_ids")
    if isinstance(stops, (list, tuple, set)):
        bad = next((i for i in stops if not _is_int(i) or not 0 <= i < vocab_size), None)
        if bad is not None:
            raise RequestRejected(
                f"stop_token_ids: {_short(bad)} is not a token id in [0, {vocab_size}) (the vocabulary)"
            )
    return params


# ------------------------------------------------------------------------------------------------
# Requests the scheduler can never run. SGLang 0.5.23 accepts them, then retries the one at the head
# of its queue on every loop (100 % CPU, every later request waiting behind it), or clips their
# output budget to nothing and answers an empty success after the whole prefill.

CLIP_MAX_NEW_TOKENS = 4096  # schedule_policy.py:89 (env SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION)
IGNORE_EOS_RESERVE_TOKENS = 1  # schedule_policy.py:122
NO_LIMIT = 1 << 30  # what the scheduler reads a null max_new_tokens as (scheduler.py:2698)


@dataclass(frozen=True)
class PoolLimits:
    """What the scheduler sizes one request against, as the tokenizer process learns it."""

    pool_tokens: int  # the scheduler's max_total_num_tokens: --max-total-tokens, or what memory allows
    page_size: int
    context_len: int
    decode_reserve: int = 0  # KV rows a speculative decode round allocates past the committed length; 0 without
    radix_disabled: bool = False  # --disable-radix-cache: ignore_eos requests take another admission path


def _ceil(x: int, page: int) -> int:
    return -(-x // page) * page


def output_budget(
    prompt: int, max_new_tokens: int | None, lim: PoolLimits, *, ignore_eos: bool = False
) -> tuple[int, int | None]:
    """(clipped, served) for a request of `prompt` tokens asking for `max_new_tokens` (None: as many
    as fit): `clipped` is the budget SGLang 0.5.23's scheduler cuts it to when the request is queued,
    `served` the largest budget up to that with which the scheduler admits the request and can run it
    to its last token, or None if it never admits the request, not even with no budget. Computed
    for the request alone in an otherwise empty pool, its best case: what does not fit there never
    fits, and waits at the head of the queue forever. Paths below are under sglang/srt/.

    P = page size, C = pool_tokens, A = C // P * P what the paged allocator can hand out
    (mem_cache/allocator/paged.py:153 num_pages = size // page_size, :169 available_size; page 0 is
    padding outside the count, :397).

    1. The clip (managers/scheduler.py:2693 init_req_max_new_tokens):
         m = max(0, min(m, max_req_len - n - 1, C - ceil_P(n) - P - 1))
       max_req_len = min(context_len - 1, C - 1) (managers/tp_worker.py:568); the last term is
       mem_cache/allocator/base.py:102-105 (max_new_tokens_for_memory), which reserves the page
       admission charges below plus one token.
    2. Admission (managers/schedule_policy.py:1395 PrefillAdder.add_one_req):
         n + min(m, CLIP_MAX_NEW_TOKENS) + P < A
       (:1412 total_tokens, with per_req_token_overhead = one page, :733; the strict `<` is
       mem_cache/prefill_budget.py:128 against available + evictable, :91-97). A radix hit does not
       help: its prefix is locked out of the evictable count while the extend shrinks by as much.
       A refused head of the queue with nothing running leaves batch_is_full False
       (scheduler.py:4282), so the next loop tries it again: that is the spin.
       With ignore_eos and the radix cache disabled, add_one_req_ignore_eos (:1401, :1241) admits
       instead iff ceil_P(n) + P <= A (:1243-1256) and, for m > 0,
       A - ceil_P(n) - P - m > IGNORE_EOS_RESERVE_TOKENS (:1295-1303): one token less than the clip.
    3. With speculation, the last decode round (speculative/eagle_utils.py:866-872, which both of
       our workers call): a round at committed length L allocates up to ceil_P(L + R) with
       R = get_alloc_reserve_per_decode() (mem_cache/allocation_sizing.py:64-88; 2 x the draft
       tokens for a chain or DSpark, 2 x topk x 2 pages for a tree with pages > 1). The last round
       runs at L = n + m - 2 (a round's bonus token enters the KV in the next one), so
       n + m - 2 + R <= A. Short of it, retract_decode aborts the lone request with a 500 "Out of
       memory even after retracting all other requests" (managers/schedule_batch.py:3508-3530),
       after its whole prefill (seen on a tree server: 6500 + 1400 tokens, topk 4, pool 8192).
       Without speculation a round takes one page at a page boundary, which the clip's page covers.

    `served` is the largest budget up to `clipped` that meets 2. and 3. SGLang page-aligns its pool
    (model_executor/pool_configurator.py:646), so C = A and a budget clipped by memory is always
    admitted (n + C - ceil_P(n) - 1 < A); the clip is 0 for every prompt above A - 2P tokens, and
    such a prompt is then never admitted if n + P >= A (the spin), otherwise answered with no
    output. A request slot (the req_to_token row: context_len + get_req_to_token_extra_context_len(),
    allocation_sizing.py:96-116; our cache slot is that row, its last speculative rows kept as ring
    slack) holds context_len plus a round's reservation by construction, so it adds no limit of its
    own; SGLANG_MAX_NEW_TOKENS_LIMIT only lowers m, which never makes a request that fits stop fitting.
    """
    n, page = prompt, lim.page_size
    avail = lim.pool_tokens // page * page
    paged = _ceil(n, page)
    max_req_len = min(lim.context_len - 1, lim.pool_tokens - 1)
    m = NO_LIMIT if max_new_tokens is None else max_new_tokens
    clipped = max(0, min(m, max_req_len - n - 1, lim.pool_tokens - paged - page - 1))
    bounds = [clipped]  # each constraint, as the largest budget it lets through
    if ignore_eos and lim.radix_disabled:
        if paged + page > avail:
            return clipped, None
        bounds.append(avail - paged - page - IGNORE_EOS_RESERVE_TOKENS - 1)
    else:
        if n + page >= avail:
            return clipped, None
        if n + CLIP_MAX_NEW_TOKENS + page >= avail:
            bounds.append(avail - n - page - 1)
    if lim.decode_reserve:
        bounds.append(max(1, avail - n - lim.decode_reserve + 2))  # one token needs no decode round
    return clipped, max(0, min(bounds))


def max_input_len(lim: PoolLimits) -> int:
    """The scheduler's own prompt limit: longer prompts it answers with an error itself
    (managers/tp_worker.py:568-572, managers/utils.py:260 validate_input_length)."""
    return min(lim.context_len - 1, lim.pool_tokens - 1) - 5


def largest_prompt(lim: PoolLimits, *, ignore_eos: bool = False) -> int:
    """The longest prompt the scheduler takes that still gets at least one new token (0: none)."""
    lo, hi = 0, max(0, max_input_len(lim) - 1)  # output_budget is non-increasing in the prompt length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if (output_budget(mid, 1, lim, ignore_eos=ignore_eos)[1] or 0) >= 1:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_fits(
    obj, prompt: int, params: dict, lim: PoolLimits, *, checks_total: bool = True, truncates: bool = False
) -> None:
    """Refuse (RequestRejected with the numbers) a request the scheduler would never admit, or would
    answer with no output although output was asked for; lower max_new_tokens where SGLang's own
    clip would leave the request unfinishable (the ignore_eos and speculative terms of
    `output_budget`). Requests SGLang answers with an error of its own are left to it; under
    --allow-auto-truncate the prompt and budget checked are those SGLang would cut them to."""
    asked = params.get("max_new_tokens")
    if asked is not None and not _is_int(asked):
        return  # SGLang's SamplingParams check names the type
    n, ctx, cut = prompt, lim.context_len, False
    if truncates:  # tokenizer_manager.py:1337-1368, then the scheduler's validate_input_length
        if n >= ctx:
            n, asked = ctx, (None if asked is None else 0)
        elif asked is not None and n + asked > ctx:
            asked = ctx - n
        cut = n != prompt or asked != params.get("max_new_tokens") or n >= max_input_len(lim)
        n = min(n, max_input_len(lim))
    elif n >= ctx or (checks_total and asked is not None and n + asked > ctx) or n >= max_input_len(lim):
        return  # SGLang refuses it, naming the context length or its input limit
    ignore_eos = bool(params.get("ignore_eos"))
    clipped, served = output_budget(n, asked, lim, ignore_eos=ignore_eos)
    if served is not None and (served > 0 or asked == 0):
        if served < clipped:
            obj.sampling_params = {**params, "max_new_tokens": served}
        return
    page = lim.page_size
    pages = _ceil(n, page) // page
    most = largest_prompt(lim, ignore_eos=ignore_eos)
    at_most = (output_budget(most, None, lim, ignore_eos=ignore_eos)[1] or 0) if most else 0
    spec = (
        f", and each speculative decode round reserves {lim.decode_reserve} rows past the committed length"
        if lim.decode_reserve
        else ""
    )
    if asked == 0:
        why = (
            f"the scheduler admits a request only while its prompt plus one page ({n} + {page}) stays below the "
            "pool, so it would wait forever"
        )
    else:
        why = (
            f"its {pages} pages of {page} tokens ({pages * page}) plus the page the scheduler keeps free per "
            "request leave no room for a new token"
        )
    raise RequestRejected(
        f"input_ids: {n} prompt tokens + max_new_tokens {'null' if asked is None else asked}"
        f"{' (as --allow-auto-truncate cuts them)' if cut else ''} cannot be served: {why}; this server's KV pool "
        f"holds {lim.pool_tokens} tokens in {page}-token pages (--max-total-tokens; --context-length {ctx}){spec}. "
        f"At most {most} prompt tokens leave room to generate (up to {at_most} new tokens at that length)"
    )


# Sampling fields the NextN worker's verify does not apply (SGLang applies them in its sampler,
# which speculative verify bypasses): refused under speculation rather than silently ignored.
# name -> the value that means "off".
_SPEC_UNSUPPORTED_SAMPLING = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "logit_bias": None,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
}


def _speculative_problem(obj) -> str | None:
    if getattr(obj, "return_logprob", False):
        return "return_logprob (OpenAI: logprobs): "
    if getattr(obj, "custom_logit_processor", None):
        return "custom_logit_processor: "
    params = getattr(obj, "sampling_params", None) or {}
    if isinstance(params, dict):
        for name, off in _SPEC_UNSUPPORTED_SAMPLING.items():
            value = params.get(name, off)
            if value not in (off, None) and value != {} and value != []:
                return f"sampling_params.{name} = {value!r}: "
    return None


def check_request(
    obj,
    input_ids,
    *,
    vocab_size: int,
    dsv4: bool,
    speculative: str | None = None,
    context_len: int | None = None,
    limits: PoolLimits | None = None,
    checks_total: bool = True,
    truncates: bool = False,
) -> None:
    """Raise RequestRejected naming the field if one (already tokenized) generate request cannot
    be served as asked. `obj` is SGLang's per-request GenerateReqInput (or EmbeddingReqInput).

    Checks that prevent crashes apply to every model; refusals of inputs only our DeepSeek-V4
    model cannot honour (`dsv4`) apply to it alone, and so does the pool check (`limits`, see
    `output_budget`: its arithmetic is that of the paged allocator our DeepSeek-V4 pool gets).
    `obj.sampling_params` may be replaced by the parameters to serve (`check_sampling`,
    `check_fits`)."""
    if input_ids is not None and len(input_ids) == 0 and getattr(obj, "input_embeds", None) is None:
        raise RequestRejected("input_ids: the prompt is empty (a batch entry with no tokens?)")
    if input_ids:
        # a nested list reaches here as one prompt when `text` is given beside it (SGLang then takes
        # input_ids as they are): comparing a list with the vocabulary size was a 500
        wrong = next((t for t in input_ids if not _is_int(t)), None)
        if wrong is not None:
            raise RequestRejected(
                f"input_ids: expected one prompt's token ids (integers), got an element {wrong!r:.60} "
                f"of type {type(wrong).__name__} (a batch takes a list of prompts, without `text`)"
            )
        lo, hi = min(input_ids), max(input_ids)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise RequestRejected(f"input_ids: token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    if getattr(obj, "return_logprob", False):
        k = getattr(obj, "top_logprobs_num", None)
        if k is not None and (not _is_int(k) or not 0 <= k <= vocab_size):
            raise RequestRejected(
                f"top_logprobs_num (OpenAI: logprobs / top_logprobs) = {k!r}: expected an integer in "
                f"[0, {vocab_size}] (the vocabulary size)"
            )
        start = getattr(obj, "logprob_start_len", None)
        n_in = len(input_ids) if input_ids is not None else 0
        if start is not None and (not _is_int(start) or not -1 <= start < max(n_in, 1)):
            raise RequestRejected(
                f"logprob_start_len = {start!r}: expected -1 (output tokens only) or an integer in "
                f"[0, {n_in}) (the prompt has {n_in} tokens)"
            )
    params = getattr(obj, "sampling_params", None)
    if isinstance(params, dict):
        served = check_sampling(params, vocab_size=vocab_size, context_len=context_len)
        if served is not params:
            obj.sampling_params = served
    if not dsv4:
        return
    if getattr(obj, "input_embeds", None) is not None:
        raise RequestRejected(INPUT_EMBEDS_REFUSED)
    if getattr(obj, "text", None) is not None and getattr(obj, "input_ids", None) is not None:
        raise RequestRejected("text and input_ids: give one prompt, not both (the server would use only one)")
    if speculative:
        problem = _speculative_problem(obj)
        if problem:
            raise RequestRejected(
                f"{problem}not supported with --speculative-algorithm {speculative} on DeepSeek-V4 in "
                "sglang-dsv4-ascend yet (its verify step applies temperature, top_k, top_p and min_p only); "
                "drop the field or serve without speculation"
            )
    params = getattr(obj, "sampling_params", None)
    if limits is not None and input_ids is not None and isinstance(params, dict):
        check_fits(obj, len(input_ids), params, limits, checks_total=checks_total, truncates=truncates)


def _scheduler_info() -> dict:
    """What the scheduler reported at launch (max_total_num_tokens among it). SGLang hands the
    tokenizer manager only max_req_input_len, which does not reveal a pool as large as the
    context; the HTTP server keeps the whole record in its global state (http_server.py:283-291,
    also in each --tokenizer-worker-num worker). An offline Engine keeps it to itself: {} there."""
    http = sys.modules.get("sglang.srt.entrypoints.http_server")
    state = getattr(http, "_global_state", None)
    return getattr(state, "scheduler_info", None) or {}


def _decode_reserve(server_args) -> int:
    """SGLang's own per-round speculative reservation (see `output_budget`, 3.), from the config
    the tokenizer process published; 0 without speculation or where it cannot be read (the
    check then leaves out only the speculative term)."""
    if not getattr(server_args, "speculative_algorithm", None):
        return 0
    try:
        from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode

        return int(get_alloc_reserve_per_decode())
    except Exception:  # no published config in this process
        return 0


def _published_config() -> tuple[int, bool]:
    """(page size, radix cache disabled) as resolved and published for this process, which the
    tokenizer manager reads too: a ServerArgs attribute holds what the command line said (None
    where the plugin's model override chose the 128-token pages)."""
    from sglang.srt.runtime_context import get_memory, get_schedule

    return int(get_schedule().page_size or 1), bool(get_memory().disable_radix_cache)


def pool_limits(tm) -> PoolLimits | None:
    """The PoolLimits of TokenizerManager `tm`'s server, or None before the scheduler reported (or
    where the published config cannot be read: no pool check then)."""
    pool = _scheduler_info().get("max_total_num_tokens")
    ctx = getattr(tm, "context_len", None)
    if not pool or not ctx:
        return None
    try:
        page, radix_disabled = _published_config()
    except Exception:  # nothing published in this process
        return None
    return PoolLimits(
        pool_tokens=int(pool),
        page_size=page,
        context_len=int(ctx),
        decode_reserve=_decode_reserve(tm.server_args),
        radix_disabled=radix_disabled,
    )


INPUT_EMBEDS_REFUSED = (
    "input_embeds: not supported by the DeepSeek-V4 model of sglang-dsv4-ascend (it would be "
    "ignored and the answer would be for a different prompt); send text or input_ids"
)


class RequestGate:
    """ASGI middleware in front of SGLang's routes: POST/PUT bodies larger than `max_body_bytes()`
    get 413 before anything parses them (Content-Length first, then what actually arrives), and
    bodies SGLang's own parsing would answer with a 500 (`shape_error`) get a 400 that names the
    field. The limit is resolved on the first request, once SGLang knows the context length."""

    def __init__(self, app, context_len_fn=None):
        self.app = app
        self.context_len_fn = context_len_fn
        self.limit = None

    def _limit(self) -> int:
        if self.limit is None:
            ctx = None
            if self.context_len_fn is not None:
                try:
                    ctx = self.context_len_fn()
                except Exception:  # not up yet: fall back to the fixed default for now
                    return max_body_bytes(None)
            self.limit = max_body_bytes(ctx)
        return self.limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self._limit()
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _drain(receive)
            return await self._reject(
                send,
                413,
                f"request body of {int(declared)} bytes exceeds the limit of "
                f"{limit} bytes ({settings.MAX_REQUEST_BYTES.name} to change)",
            )
        # Read the (bounded) body here; a chunked one has no length header, so count what arrives.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                if message.get("more_body", False):
                    await _drain(receive)
                return await self._reject(
                    send,
                    413,
                    f"request body of {size}+ bytes exceeds the limit of "
                    f"{limit} bytes ({settings.MAX_REQUEST_BYTES.name} to change)",
                )
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        error = shape_error(scope.get("path", ""), body)
        if error is not None:
            return await self._reject(send, 400, error)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices

        return await self.app(scope, replay, send)

    @staticmethod
    async def _reject(send, status: int, message: str):
        body = json.dumps({"object": "error", "type": "BadRequestError", "code": status, "message": message}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


# Routes whose JSON body SGLang's own parsing would turn into a 500 for some wrong shapes (model
# validators that call .get() on whatever arrives, before pydantic checks the type).
GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def _deeper_than(data, limit: int) -> bool:
    stack = [(data, 1)]  # no recursion: the point is to measure what would overflow it
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def shape_error(path: str, body: bytes) -> str | None:
    """The structural fault of a request body that stock SGLang answers with a 500, or None:
    for any route, JSON nested deeper than MAX_JSON_DEPTH (a RecursionError somewhere in the
    parsing, or a 500 from a library after it); for the generation routes, shapes its model
    validators call .get() on (an AttributeError). A body that is not JSON at all is left to
    SGLang, which answers 400."""
    nested = body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH  # a cheap bound before walking anything
    if path not in GENERATION_ROUTES and not nested:
        return None
    too_deep = f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        data = json.loads(body)
    except RecursionError:
        return too_deep
    except (ValueError, UnicodeDecodeError):
        return None
    if nested and _deeper_than(data, MAX_JSON_DEPTH):
        return too_deep
    if path not in GENERATION_ROUTES:
        return None
    if not isinstance(data, dict):
        return f"request body: expected a JSON object, got {type(data).__name__}"
    if path == "/generate":
        params = data.get("sampling_params")
        if isinstance(params, list):
            prompts = data.get("text") if data.get("text") is not None else data.get("input_ids")
            batch = (
                len(prompts)
                if isinstance(prompts, list)
                and (data.get("text") is not None or any(isinstance(p, list) for p in prompts))
                else 1
            )
            if len(params) != batch or not all(isinstance(p, dict) for p in params):
                return (
                    f"sampling_params: a list must hold one object per prompt ({batch} here), got "
                    f"{len(params)} entr{'y' if len(params) == 1 else 'ies'}"
                )
    if path == "/v1/chat/completions":
        fmt = data.get("response_format")
        if fmt is not None and not isinstance(fmt, dict):
            return f"response_format: expected an object like {{'type': 'json_object'}}, got {fmt!r:.80}"
        for key in ("json_schema", "schema"):
            if isinstance(fmt, dict) and fmt.get(key) is not None and not isinstance(fmt[key], dict):
                return f"response_format.{key}: expected an object, got {fmt[key]!r:.80}"
        reasoning = data.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, (dict, str)):
            return f"reasoning: expected an object or a string, got {reasoning!r:.80}"
    return None


# Up to this much of a refused body is read and dropped before the 413, so that clients which send
# the whole body before reading the answer (urllib, requests) see the 413 rather than a broken
# pipe; reading is cheap next to parsing and tokenizing. Past it the connection is closed.
DRAIN_MAX_BYTES = 256 << 20


async def _drain(receive) -> None:
    drained = 0
    while drained <= DRAIN_MAX_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
