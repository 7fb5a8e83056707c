"""Hook `pd_timeout_peer` (patches/README.md #22): a PD transfer that times out names its peer.

Why a hook: SGLang's KV managers record a timed-out request as "Request <room> timed out after
<s>s in KVPoll.<state>" (common/conn.py), naming the request only. With several prefill and decode
servers behind a router, the operator needs the other side: which decode server claimed the room
(or that none did), which prefill server never sent. Both sides record a timeout through
`CommonKVManager.record_failure`, the one place that sees the reason and the manager's peer tables
together; the message gains the peer and is otherwise SGLang's (its log line adds rid and room).
A transfer error (NIXL's NIXL_ERR_REMOTE_DISCONNECT when the decode server dies mid-transfer)
already says what failed and takes another path; it is left as it is.
"""

from __future__ import annotations

from ..compat import Hook


def timeout_peer(kv_mgr, bootstrap_room: int) -> str:
    """Who this side waited for on `bootstrap_room`, from the manager's own tables."""
    if hasattr(kv_mgr, "transfer_infos"):  # prefill side: decode peers send their indices here
        infos = kv_mgr.transfer_infos.get(bootstrap_room, {}).values()
        claimed = [f"{t.endpoint}:{t.dst_port} (agent {t.agent_name})" for t in infos]
        if claimed:
            return "decode peer " + ", ".join(claimed)
        known = sorted({f"{a.endpoint}:{a.dst_port}" for a in getattr(kv_mgr, "decode_kv_args_table", {}).values()})
        return (
            f"no decode peer claimed the room at this prefill server's bootstrap server "
            f"{kv_mgr.bootstrap_host}:{kv_mgr.bootstrap_port} (decode peers registered: {', '.join(known) or 'none'})"
        )
    tracker = getattr(kv_mgr, "addr_to_rooms_tracker", {})  # decode side: rooms by prefill bootstrap address
    addrs = sorted(addr for addr, rooms in tracker.items() if bootstrap_room in rooms)
    if not addrs:
        return "prefill peer unknown (never bootstrapped)"
    return f"prefill peer at bootstrap address {', '.join(addrs)}"


def name_peer(orig, self, bootstrap_room, failure_reason):
    if "timed out" in str(failure_reason):
        try:
            failure_reason = f"{failure_reason}; {timeout_peer(self, bootstrap_room)}"
        except Exception as e:  # a message must never fail the failure path
            failure_reason = f"{failure_reason}; peer unavailable ({e!r})"
    return orig(self, bootstrap_room, failure_reason)


HOOK = Hook(
    "pd_timeout_peer",
    "sglang.srt.disaggregation.common.conn:CommonKVManager.record_failure",
    ("self", "bootstrap_room", "failure_reason"),
    "AROUND",
    name_peer,
)
