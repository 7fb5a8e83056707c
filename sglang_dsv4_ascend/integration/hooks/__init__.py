"""Every SGLang function the plugin hooks, one file each, named as the hook.

A hook exists only where SGLang has no registry for what we need. Each file holds the hook's body,
its target ("module:qualname"), the parameters that target must have, the kind (BEFORE / AROUND,
SGLang's HookType) and why it exists, and declares its `HOOK` right below the body.
`patches/README.md` is the register (what each does, why, the upstream change that removes it),
in the order below; tests/unit/test_docs.py fails when the two differ.

`plugin.register()` checks every target's signature first and installs all of them or none
(`compat.install_hooks`). Importing this package imports no SGLang module: bodies import what they
need when they run.
"""

from __future__ import annotations

from . import (
    cpu_compile_fake_ops,
    cpu_dp_attention_sync,
    cpu_spec_assign_slots,
    cpu_spec_last_loc,
    dspark_args_on_cpu,
    dsv4_kv_pool,
    eagle_tree_page_check,
    generate_stream_refusals,
    http_request_gate,
    nextn_info_record,
    nextn_worker_on_builtin_platforms,
    pd_draft_input,
    pd_mla_layout,
    pd_nixl_host_memory,
    pd_request_state,
    pd_timeout_peer,
    request_normalize_errors,
    request_validation,
    spec_accept_length_from_rounds,
    spec_stats_every_chat_chunk,
    spec_stats_every_completion_chunk,
    spec_stats_every_output,
    tree_kv_reservation,
)

# The order of patches/README.md (its numbers).
HOOKS = [
    dsv4_kv_pool.HOOK,
    request_validation.HOOK,
    request_normalize_errors.HOOK,
    http_request_gate.HOOK,
    eagle_tree_page_check.HOOK,
    cpu_spec_last_loc.HOOK,
    cpu_spec_assign_slots.HOOK,
    nextn_worker_on_builtin_platforms.HOOK,
    dspark_args_on_cpu.HOOK,
    spec_stats_every_chat_chunk.HOOK,
    spec_stats_every_completion_chunk.HOOK,
    spec_stats_every_output.HOOK,
    cpu_dp_attention_sync.HOOK,
    generate_stream_refusals.HOOK,
    spec_accept_length_from_rounds.HOOK,
    cpu_compile_fake_ops.HOOK,
    pd_request_state.HOOK,
    pd_nixl_host_memory.HOOK,
    pd_mla_layout.HOOK,
    pd_draft_input.HOOK,
    nextn_info_record.HOOK,
    pd_timeout_peer.HOOK,
    tree_kv_reservation.HOOK,
]
