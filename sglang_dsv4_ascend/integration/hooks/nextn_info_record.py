"""Hook `nextn_info_record` (patches/README.md #21): NextN's round statistics in /get_server_info.

Why a hook: SGLang puts a speculative worker's own record into the server info
(`internal_states[i]`) only for DSPARK (`dspark_info_record`, from the worker's
`dump_info_records`). Our NextN worker keeps the same record (stage times per round, drafted /
verified / committed tokens, acceptance by position, rounds by shape, predicted vs measured round
time by batch size); this adds it as `nextn_info_record`, so a user sees why the planner chose what
it chose under NextN as under DSpark.
"""

from __future__ import annotations

from ..compat import Hook


def add_nextn_record(result, self, state):
    scheduler = self.scheduler
    worker = scheduler.draft_worker
    algo = scheduler.spec_algorithm
    if worker is None or algo.is_none() or algo.is_dspark() or not hasattr(worker, "stats"):
        return result
    from ...speculative.worker import DSV4SpecWorker

    if isinstance(worker, DSV4SpecWorker):
        state["nextn_info_record"] = worker.dump_info_records()
    return result


HOOK = Hook(
    "nextn_info_record",
    "sglang.srt.managers.scheduler_components.internal_state:SchedulerInternalStateController._add_speculative",
    ("self", "state"),
    "AFTER",
    add_nextn_record,
)
