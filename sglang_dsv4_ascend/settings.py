"""Every `SGLANG_DSV4_*` environment setting, in one typed table. A leaf: imports only the stdlib.

Each `Setting` has its name, its type, its default, what it means and how it is checked; every
reader in the package goes through `Setting.get()`, so one rule parses them all:

* unset or empty (after stripping blanks): the default;
* flag: `1`, `true`, `yes`, `on` are true, `0`, `false`, `no`, `off` false (any case); anything
  else is refused;
* int: a whole number, at least `minimum`;
* choice: one of `choices` (any case, blanks stripped);
* text: the string as set (its reader checks the form, e.g. `replay:FILE`).

A refused value raises ValueError naming the variable, its value and what is expected.

Test-only settings (`test_only=True`: the replay drafter, the desync injection) are refused
unless `SGLANG_DSV4_TESTING` is on, which the test suite sets: a production server never runs a
test drafter by accident.

The README's tables of settings are rendered from this table (`python -m sglang_dsv4_ascend.settings`
prints them); tests/unit/test_docs.py fails when they differ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_DEFAULT = object()


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # "flag" | "int" | "choice" | "text"
    default: object
    shape: str  # what the README shows after `NAME=`
    meaning: str
    choices: tuple = ()
    minimum: int | None = None
    test_only: bool = False
    group: str = "server"  # "server": read by the plugin / tools; "harness": by the test harness

    def raw(self) -> str | None:
        """The value as set, blanks stripped; None when unset or empty."""
        value = os.environ.get(self.name, "").strip()
        return value or None

    def is_set(self) -> bool:
        return self.raw() is not None

    def get(self, default=_DEFAULT):
        """The parsed value, or `default` (the table's when not given) when unset."""
        raw = self.raw()
        if raw is None:
            return self.default if default is _DEFAULT else default
        if self.test_only and not TESTING.get():
            raise ValueError(
                f"{self.name}={raw!r}: a test-only setting, refused unless {TESTING.name}=1 (the test suite sets it)"
            )
        return self.parse(raw)

    def parse(self, raw: str):
        if self.kind == "flag":
            low = raw.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(f"{self.name}={raw!r}: expected 1 or 0 (or true / false, yes / no, on / off)")
        if self.kind == "int":
            try:
                value = int(raw)
            except ValueError:
                value = None
            if value is None or (self.minimum is not None and value < self.minimum):
                expected = (
                    "a positive integer"
                    if self.minimum == 1
                    else f"an integer >= {self.minimum}"
                    if self.minimum is not None
                    else "an integer"
                )
                raise ValueError(f"{self.name}={raw!r}: expected {expected}")
            return value
        if self.kind == "choice":
            low = raw.lower()
            if low not in self.choices:
                raise ValueError(f"{self.name}={raw!r}: expected one of {', '.join(self.choices)}")
            return low
        return raw


SETTINGS: list[Setting] = []


def _setting(**fields) -> Setting:
    s = Setting(**fields)
    SETTINGS.append(s)
    return s


# ------------------------------------------------------------------------------------------------
# server: read by the plugin, the model and the tools

PLATFORM = _setting(
    name="SGLANG_DSV4_PLATFORM",
    kind="choice",
    default="auto",
    shape="auto\\|cpu\\|off",
    meaning="CPU reference platform: on when no accelerator (default), forced, or never",
    choices=("auto", "cpu", "off"),
)
FORCE_REFERENCE = _setting(
    name="SGLANG_DSV4_FORCE_REFERENCE",
    kind="flag",
    default=False,
    shape="1",
    meaning="run the plain-torch reference ops everywhere (bisect numerics op by op)",
)
ATTENTION = _setting(
    name="SGLANG_DSV4_ATTENTION",
    kind="choice",
    default="batched",
    shape="batched\\|segments",
    meaning="the batched forward (default) or the per-segment definition (attention per request; the oracle)",
    choices=("batched", "segments"),
)
COMPILE_BACKEND = _setting(
    name="SGLANG_DSV4_COMPILE_BACKEND",
    kind="choice",
    default="inductor",
    shape="inductor\\|aot_eager\\|eager",
    meaning="what --enable-torch-compile on CPU compiles each captured decode with: inductor (default, "
    "code generation), or only dynamo's trace (aot_eager, eager: fast capture, to debug or test the capture)",
    choices=("inductor", "aot_eager", "eager"),
)
DEVICE_GRAPHS = _setting(
    name="SGLANG_DSV4_DEVICE_GRAPHS",
    kind="flag",
    default=False,
    shape="1",
    meaning="on CUDA / NPU: the speculative worker captures its verify and draft as CUDA / ACL graphs "
    "(device_graph.py; batch sizes from --cuda-graph-bs-decode, off with --disable-cuda-graph). UNVERIFIED: never "
    "run on either device",
)
GRAPH_CONTEXT = _setting(
    name="SGLANG_DSV4_GRAPH_CONTEXT",
    kind="int",
    default=4096,
    shape="N",
    meaning="the longest committed context a captured forward holds (decode, verify), in tokens: its compressed-entry "
    "tables are that wide whatever --context-length is; a step with a longer request runs eager (default 4096; "
    "--context-length or more: every request replays, at the whole cache's width)",
    minimum=128,
)
MAX_REQUEST_BYTES = _setting(
    name="SGLANG_DSV4_MAX_REQUEST_BYTES",
    kind="int",
    default=None,
    shape="N",
    meaning="largest HTTP request body (default max(1 MiB, 32 bytes per context token)); larger: 413 before parsing",
    minimum=1,
)
MAX_N = _setting(
    name="SGLANG_DSV4_MAX_N",
    kind="int",
    default=64,
    shape="N",
    meaning="most parallel samples (`n`) per request (default 64); more: 400",
    minimum=1,
)
INT8_MATMUL = _setting(
    name="SGLANG_DSV4_INT8_MATMUL",
    kind="choice",
    default="auto",
    shape="auto\\|int_mm\\|float",
    meaning="W8A8 int8 GEMM on the reference path: probed fastest exact method (default) or forced",
    choices=("auto", "int_mm", "float"),
)
CPU_SLEEP_ON_IDLE = _setting(
    name="SGLANG_DSV4_CPU_SLEEP_ON_IDLE",
    kind="flag",
    default=True,
    shape="0",
    meaning="CPU platform: keep SGLang's busy polling when idle (default: `--sleep-on-idle` on)",
)
CPU_THREADS = _setting(
    name="SGLANG_DSV4_CPU_THREADS",
    kind="int",
    default=None,
    shape="N",
    meaning="CPU platform: intra-op threads per scheduler (default: cores - 1, at least 1)",
    minimum=1,
)
DSPARK_VERIFY = _setting(
    name="SGLANG_DSV4_DSPARK_VERIFY",
    kind="choice",
    default="adaptive",
    shape="static\\|adaptive",
    meaning="DSpark verify mode (default adaptive; SGLang's own `SGLANG_RAGGED_VERIFY_MODE` drives its CUDA worker "
    "and is left alone)",
    choices=("static", "adaptive"),
)
NEXTN_SHAPE = _setting(
    name="SGLANG_DSV4_NEXTN_SHAPE",
    kind="choice",
    default="static",
    shape="static\\|adaptive",
    meaning="NextN round shape: static (every round drafts the configured chain or tree) or adaptive (per round the "
    "tree, a chain or no draft, whichever the round cost surface says emits most tokens per second)",
    choices=("static", "adaptive"),
)
SPEC_GUARD = _setting(
    name="SGLANG_DSV4_SPEC_GUARD",
    kind="flag",
    default=True,
    shape="0",
    meaning="measure, per batch size, the tokens per second of rounds that draft and of plain decode steps, and skip "
    "drafting where plain decoding is faster (`speculative/guard.py`; default on, every speculative method); 0 "
    "drafts every round the planner asks for",
)
TREE_VERIFY = _setting(
    name="SGLANG_DSV4_TREE_VERIFY",
    kind="choice",
    default="nodes",
    shape="nodes\\|paths",
    meaning="how a NextN tree is verified and drafted: nodes (one segment per request, each node computed once "
    "against its ancestors; draft steps compute only their new leaves) or paths (one segment per root-to-leaf "
    "path, shared prefixes recomputed; the earlier form, kept to compare)",
    choices=("nodes", "paths"),
)
TEST_DRAFTER = _setting(
    name="SGLANG_DSV4_TEST_DRAFTER",
    kind="text",
    default=None,
    shape="replay:FILE",
    meaning=(
        "TESTS ONLY (refused unless `SGLANG_DSV4_TESTING=1`): the speculative worker proposes the continuations "
        "in FILE with errors injected where FILE says (`speculative/drafters.py`), to drive full / partial / "
        "zero acceptance; logged as a warning"
    ),
    test_only=True,
)
PREFIX_STATES = _setting(
    name="SGLANG_DSV4_PREFIX_STATES",
    kind="int",
    default=None,
    shape="N",
    meaning="prefix states kept for radix hits (default: one per 16 pages of the token pool, at least 16); each is "
    "`sliding_window` rows per layer plus 4 compressor rows per CSA layer",
    minimum=1,
)
SPEC_SYNC_CHECK = _setting(
    name="SGLANG_DSV4_SPEC_SYNC_CHECK",
    kind="flag",
    default=False,
    shape="1",
    meaning="all-gather every speculative round's decisions (drafts, budget, accept lengths, paths, bonus tokens) over "
    "the TP group and stop with an error naming the round and ranks if they differ (debug; one gather per round)",
)
DEBUG_DESYNC_RANK = _setting(
    name="SGLANG_DSV4_DEBUG_DESYNC_RANK",
    kind="int",
    default=None,
    shape="R",
    meaning=(
        "TESTS ONLY (refused unless `SGLANG_DSV4_TESTING=1`): offset rank R's accept seed, the broken variant "
        "the sync check must catch"
    ),
    minimum=0,
    test_only=True,
)
PROMPTS_DIR = _setting(
    name="SGLANG_DSV4_PROMPTS_DIR",
    kind="text",
    default=None,
    shape="DIR",
    meaning="prompt sets for tests / benchmarks (default: the ones shipped in `sglang_dsv4_ascend/data/prompts`)",
)

# ------------------------------------------------------------------------------------------------
# harness: the tests and the tools that start servers for them

TESTING = _setting(
    name="SGLANG_DSV4_TESTING",
    kind="flag",
    default=False,
    shape="1",
    meaning="allow the TESTS ONLY settings above (`tests/conftest.py` sets it for the suite and the servers it starts)",
    group="harness",
)
ZYGOTE = _setting(
    name="SGLANG_DSV4_ZYGOTE",
    kind="text",
    default=None,
    shape="SOCKET",
    meaning="start servers (`tools/server.py`) by forking the pre-imported launcher listening on SOCKET "
    "(`tools/zygote.py`; the tests set it)",
    group="harness",
)
TEST_ZYGOTE = _setting(
    name="SGLANG_DSV4_TEST_ZYGOTE",
    kind="flag",
    default=True,
    shape="0",
    meaning="the tests start every server the plain way instead of through the zygote",
    group="harness",
)
TEST_INDUCTOR = _setting(
    name="SGLANG_DSV4_TEST_INDUCTOR",
    kind="flag",
    default=False,
    shape="1",
    meaning="also run the inductor-compiled capture test (tests/unit/test_graph_capture.py; ~2 min of "
    "compilation on 2 cores, so off in the suite)",
    group="harness",
)
TEST_SERVERS = _setting(
    name="SGLANG_DSV4_TEST_SERVERS",
    kind="int",
    default=1,
    shape="N",
    meaning="pooled test servers running at once per test process (default 1; `tests/e2e/pool.py`)",
    minimum=1,
    group="harness",
)
TEST_WORKERS = _setting(
    name="SGLANG_DSV4_TEST_WORKERS",
    kind="int",
    default=2,
    shape="N",
    meaning="pytest-xdist workers of `scripts/test.sh` (default 2; 0 runs one process; read by the script)",
    minimum=0,
    group="harness",
)
TEST_STATS_DIR = _setting(
    name="SGLANG_DSV4_TEST_STATS_DIR",
    kind="text",
    default=None,
    shape="DIR",
    meaning=(
        "where the test processes leave their server-start timings for the run's summary (set by `tests/conftest.py`)"
    ),
    group="harness",
)

BY_NAME = {s.name: s for s in SETTINGS}


def markdown_table(group: str) -> str:
    """The README's table of the `group` settings."""
    rows = ["| variable | effect |", "|---|---|"]
    rows += [f"| `{s.name}={s.shape}` | {s.meaning} |" for s in SETTINGS if s.group == group]
    return "\n".join(rows)


if __name__ == "__main__":
    for g in ("server", "harness"):
        print(f"<!-- settings: {g} -->\n{markdown_table(g)}\n")
