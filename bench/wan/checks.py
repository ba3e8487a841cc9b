"""What a chaos scenario must show at its end, judged from a run's record (``run.run``'s result).

A scenario states its expectations as data (``"expect"`` in its JSON); each becomes one verdict
``{"check", "ok", "detail"}``:

- always: every held-out loss any node reported was finite, and every node that was not told to
  leave (or killed without a restart) answered at the end;
- ``learns``: each node's last held-out loss is at least this far below the untrained model's
  (node 0's first evaluation: a joiner's own history starts wherever the swarm was);
- ``recovers``: after a kill, a partition or a slow link, the node named is back in the swarm: it
  sees every other node, applied peer fragments after the last event, its lowest version is at
  most ``versions_within`` behind the others' and its held-out loss at most ``loss_within`` above
  their mean;
- ``peers_at_end``: each node still up sees this many live peers (a node that left is gone from
  its peers' view);
- ``joins``: every node but the first started from a peer's snapshot (none gave up joining),
  as its last status before the end (or before it left) says;
- ``rounds_with_fresh``: for each node up at the end, at least this fraction of the outer steps
  seen in the samples applied a peer fragment at age 0 or 1 (on a thin link the bytes go to
  fragments that count);
- ``applied_from_each``: each node up at the end applied at least this many fragments from every
  other node up at the end (behind NAT too: through relays or the peers that re-serve them);
  ``applied_from_each_after_last_event``: the same, counting only what was applied after the
  scenario's last event (a public node killed: the others still exchange, through the one left);
- ``listed_within``: within this many seconds of the last node's start, node 0 (where a user's
  ``cgad-node swarm`` asks first) sees every other node live.

Beside the verdicts, ``costs_per_round`` says what a round cost each node up at the end: bytes
received, DHT records it stored, its looks at the DHT, and the DHT requests it answered for others
(where a swarm's records land, the load a growing swarm puts on the DHT's servers).

And where the scenario names its floor (``"floor"``: the same nodes, each training alone, run in
the same invocation), ``check_floor`` makes one more verdict, ``below_floor``: the swarm's mean
final held-out loss (each node's last evaluation, over the nodes up at the end) is below the
floor's, the two runs being comparable: the same commit, run seed and per-node data seeds, the
same minutes, started within the hour of each other.
"""

from __future__ import annotations

import itertools
import math
from datetime import datetime
from typing import Any

__all__ = [
    "COSTS",
    "EXPECTATIONS",
    "SAME_HOUR_SECONDS",
    "check",
    "check_floor",
    "costs_per_round",
    "final_losses",
]

EXPECTATIONS = {
    "learns", "recovers", "peers_at_end", "joins", "rounds_with_fresh", "applied_from_each", "listed_within",
    "applied_from_each_after_last_event",
}  # fmt: skip
SAME_HOUR_SECONDS = 3600.0


def _verdict(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"check": name, "ok": bool(ok), "detail": detail}


def _gone(scenario: dict[str, Any]) -> set[int]:
    """Nodes not expected to answer at the end: left, or killed and never restarted."""
    gone: set[int] = set()
    for event in sorted(scenario["events"], key=lambda e: e["at"]):
        for key in ("kill", "leave"):
            if key in event:
                gone.add(event[key])
        if "restart" in event:
            gone.discard(event["restart"])
    return gone


def check(result: dict[str, Any]) -> list[dict[str, Any]]:
    scenario = result["scenario"]
    expect = scenario.get("expect", {})
    final = {int(i): status for i, status in result["final"].items()}
    gone = _gone(scenario)
    up = {i: s for i, s in final.items() if s is not None and i not in gone}
    verdicts = []

    losses = [
        loss
        for sample in result["samples"]
        if sample.get("status")
        for _, loss in sample["status"]["eval_history"]
    ]
    bad = [loss for loss in losses if not math.isfinite(loss)]
    read = f"{len(losses)} losses read, {len(bad)} not finite"
    verdicts.append(_verdict("finite", not bad and losses, read))
    missing = sorted(i for i in range(scenario["nodes"]) if i not in gone and final.get(i) is None)
    verdicts.append(_verdict("answering", not missing, f"silent at the end: {missing}" if missing else "all"))

    if "learns" in expect:
        start = final.get(0) or next(iter(up.values()), None)
        untrained = start["eval_history"][0][1] if start and start["eval_history"] else math.inf
        ends = {i: s["eval_history"][-1][1] for i, s in up.items() if s["eval_history"]}
        ok = len(ends) == len(up) and all(loss < untrained - expect["learns"] for loss in ends.values())
        verdicts.append(_verdict("learns", ok, f"untrained {untrained:.3f}; last {_fmt(ends)}"))

    if "recovers" in expect:
        rule = expect["recovers"]
        index = rule["node"]
        node = up.get(index)
        others = [s for i, s in up.items() if i != index and s["eval_loss"] is not None]
        if node is None or not others or node["eval_loss"] is None or not node["versions"]:
            verdicts.append(_verdict("recovers", False, f"node {index} not training at the end"))
        else:
            swarm_version = max(min(s["versions"]) for s in others)
            behind = swarm_version - min(node["versions"])
            mean_loss = sum(s["eval_loss"] for s in others) / len(others)
            above = node["eval_loss"] - mean_loss
            # back in the swarm, not beside it: it sees its peers and takes their fragments again
            applied_since = node["applied"] - _applied_after_last_event(result, index)
            ok = (behind <= rule["versions_within"] and above <= rule["loss_within"]
                  and node["peers"] == len(others) and applied_since > 0)  # fmt: skip
            verdicts.append(_verdict(
                "recovers", ok,
                f"node {index}: {behind} versions behind (≤ {rule['versions_within']}), "
                f"loss {above:+.3f} vs the others' mean (≤ {rule['loss_within']}), "
                f"sees {node['peers']} of {len(others)} peers, applied {applied_since} fragments since",
            ))  # fmt: skip

    if "peers_at_end" in expect:
        seen = {i: s["peers"] for i, s in up.items()}
        ok = all(n == expect["peers_at_end"] for n in seen.values())
        verdicts.append(_verdict("peers_at_end", ok, f"peers seen {seen} (want {expect['peers_at_end']})"))

    if expect.get("joins"):
        last = {s["node"]: s["status"] for s in result["samples"] if s.get("status")}  # a leaver too
        joiners = {i: s["started_from"] for i, s in last.items() if i != 0}
        ok = len(joiners) == scenario["nodes"] - 1 and all(f.startswith("peer ") for f in joiners.values())
        verdicts.append(_verdict("joins", ok, f"started from {joiners}"))

    if "rounds_with_fresh" in expect:
        shares = {i: _share_of_steps_with_fresh(result["samples"], i) for i in up}
        ok = all(share >= expect["rounds_with_fresh"] for share in shares.values())
        verdicts.append(_verdict("rounds_with_fresh", ok, f"share of outer steps {_fmt(shares)}"))
    if "applied_from_each" in expect:
        ids = {i: s["peer_id"] for i, s in up.items() if s.get("peer_id")}
        counts = {
            (i, j): (up[i].get("applied_by_peer") or {}).get(ids[j], 0) for i in ids for j in ids if i != j
        }
        ok = len(ids) == len(up) and all(n >= expect["applied_from_each"] for n in counts.values())
        detail = ", ".join(f"{i}<-{j} {n}" for (i, j), n in sorted(counts.items()))
        verdicts.append(_verdict("applied_from_each", ok, f"applied (node<-from) {detail}"))
    if "applied_from_each_after_last_event" in expect:
        ids = {i: s["peer_id"] for i, s in up.items() if s.get("peer_id")}
        before = {i: _status_after_last_event(result, i) for i in ids}
        counts = {  # a node not sampled between the event and the end shows nothing since
            (i, j): (up[i].get("applied_by_peer") or {}).get(ids[j], 0)
            - (before[i].get("applied_by_peer") or {}).get(ids[j], 0)
            if before[i] is not None
            else 0
            for i in ids
            for j in ids
            if i != j
        }
        ok = len(ids) == len(up) and all(
            n >= expect["applied_from_each_after_last_event"] for n in counts.values()
        )
        detail = ", ".join(f"{i}<-{j} {n}" for (i, j), n in sorted(counts.items()))
        verdicts.append(
            _verdict("applied_from_each_after_last_event", ok, f"applied since (node<-from) {detail}")
        )
    if "listed_within" in expect:
        others = scenario["nodes"] - 1
        seen = [
            s["t"]
            for s in result["samples"]
            if s.get("node") == 0 and (s.get("status") or {}).get("peers", 0) >= others
        ]
        first = seen[0] if seen else None  # t counts from the moment every node had started
        ok = first is not None and first <= expect["listed_within"]
        detail = (
            f"node 0 saw all {others} others live after {first:.0f} s"
            if first is not None
            else (f"node 0 never saw all {others} others live")
        )
        verdicts.append(_verdict("listed_within", ok, detail))
    return verdicts


COSTS = ("bytes_in", "records_stored", "dht_lookups", "dht_served")
STEADY_AFTER = 30.0  # seconds: what came before (a joiner's snapshot, the first dials) is left out


def _cost_totals(status: dict[str, Any]) -> dict[str, float | None]:
    return {
        "bytes_in": status.get("bytes_in"),
        "records_stored": sum((status.get("records_stored") or {}).values()),
        "dht_lookups": status.get("dht_lookups"),
        "dht_served": sum(status["dht_served"].values()) if "dht_served" in status else None,
    }


def costs_per_round(
    result: dict[str, Any], steady_after: float = STEADY_AFTER, per: str = "round"
) -> dict[str, dict[str, float]]:
    """What each node up at the end spent in the steady state: its totals' growth from its first
    status sampled ``steady_after`` seconds or more into the run to its last sampled status, over
    the rounds (``per="round"``) or the seconds (``per="second"``) between the two. A mapping cost
    (``COSTS``) -> {node index: per round or second}; counts a run's record lacks (made before the
    DHT counts were reported) are left out. On one machine a node's rounds lengthen as more nodes
    share its cores, and what is sent per round with them (``--codec auto`` fills a round's share of
    the link): per second is what a node's link and DHT see whatever its CPU.

    Args:
        result: a run's record.
        steady_after: seconds into the run where the count starts.
        per: "round" or "second".
    """
    # a node (re)started by an event counts from its first sample after that event's start
    restarts: dict[str, float] = {}
    for sample in result["samples"]:
        if "restart" in sample.get("event", {}):
            restarts[str(sample["event"]["restart"])] = sample["t"]
    first: dict[str, tuple[float, dict[str, Any]]] = {}
    last: dict[str, tuple[float, dict[str, Any]]] = {}
    for sample in result["samples"]:
        status, node = sample.get("status"), str(sample.get("node"))
        if status and sample["t"] >= max(steady_after, restarts.get(node, 0.0)):
            first.setdefault(node, (sample["t"], status))
            last[node] = (sample["t"], status)
    costs: dict[str, dict[str, float]] = {name: {} for name in COSTS}
    for index, final in result["final"].items():
        index = str(index)
        if not final or index not in first:
            continue
        (t0, start), (t1, end) = first[index], last[index]
        span = end["round"] - start["round"] if per == "round" else t1 - t0
        if span <= 0:
            continue
        before = _cost_totals(start)
        for name, total in _cost_totals(end).items():
            if total is not None and before[name] is not None and total >= before[name]:
                costs[name][index] = (total - before[name]) / span
    return {name: per_node for name, per_node in costs.items() if per_node}


def final_losses(result: dict[str, Any]) -> dict[int, float]:
    """Each node's last held-out loss, for the nodes that answered at the end and were not told
    to leave (or killed without a restart)."""
    gone = _gone(result["scenario"])
    losses = {}
    for index, status in result["final"].items():
        if status is not None and int(index) not in gone and status.get("eval_history"):
            losses[int(index)] = float(status["eval_history"][-1][1])
    return losses


def check_floor(result: dict[str, Any], floor: dict[str, Any] | None) -> dict[str, Any]:
    """``below_floor``: the swarm's mean final held-out loss against its floor's (``floor``: the
    floor's run, None where there is none), or why the two do not compare."""
    name = result["scenario"].get("floor")
    if floor is None:
        return _verdict("below_floor", False, f"no run of its floor {name} beside it")
    unlike = []
    for key in ("commit", "run_seed", "data_seeds"):
        if result.get(key) != floor.get(key):
            unlike.append(f"{key} {result.get(key)} against the floor's {floor.get(key)}")
    if result["scenario"]["minutes"] != floor["scenario"]["minutes"]:
        unlike.append(f"{result['scenario']['minutes']} minutes against {floor['scenario']['minutes']}")
    apart = _seconds_apart(result.get("started_at"), floor.get("started_at"))
    if apart is None:
        unlike.append("no start time")
    elif apart > SAME_HOUR_SECONDS:
        unlike.append(f"started {apart:.0f} s apart, more than an hour")
    swarm, alone = final_losses(result), final_losses(floor)
    if not swarm or not alone:
        unlike.append(f"final losses of {len(swarm)} swarm and {len(alone)} floor nodes")
    if unlike:
        return _verdict("below_floor", False, f"not comparable with its floor {name}: {'; '.join(unlike)}")
    mean, floor_mean = sum(swarm.values()) / len(swarm), sum(alone.values()) / len(alone)
    return _verdict(
        "below_floor",
        mean < floor_mean,
        f"mean final held-out loss {mean:.3f} [{min(swarm.values()):.3f}-{max(swarm.values()):.3f}] against"
        f" {floor_mean:.3f} [{min(alone.values()):.3f}-{max(alone.values()):.3f}] for {name}"
        f" ({mean - floor_mean:+.3f}; started {apart:.0f} s apart)",
    )


def _seconds_apart(a: str | None, b: str | None) -> float | None:
    if not a or not b:
        return None
    return abs((datetime.fromisoformat(a) - datetime.fromisoformat(b)).total_seconds())


def _applied_after_last_event(result: dict[str, Any], node: int) -> int:
    """The node's count of applied fragments at its first status after the scenario's last event
    (0 where there is none: a restarted process counts from 0)."""
    status = _status_after_last_event(result, node)
    return status["applied"] if status else 0


def _status_after_last_event(result: dict[str, Any], node: int) -> dict[str, Any] | None:
    """The node's first status sampled after the scenario's last event (None: none was)."""
    events = [s["t"] for s in result["samples"] if "event" in s]
    after = max(events, default=0.0)
    for sample in result["samples"]:
        if sample.get("node") == node and sample.get("status") and sample["t"] > after:
            return sample["status"]
    return None


def _share_of_steps_with_fresh(samples: list[dict[str, Any]], node: int) -> float:
    """Of the round changes between consecutive samples of ``node``, the share over which its
    count of peer fragments applied at age 0 or 1 rose (samples come every few seconds, rounds
    every tens of seconds, so a change is nearly always one outer step)."""
    seen = [s["status"] for s in samples if s.get("node") == node and s.get("status")]
    steps = fresh_steps = 0
    for before, after in itertools.pairwise(seen):
        if after["round"] > before["round"]:
            steps += 1
            fresh_steps += _fresh(after) > _fresh(before)
    return fresh_steps / steps if steps else 0.0


def _fresh(status: dict[str, Any]) -> int:
    return sum(n for age, n in status["applied_by_age"].items() if int(age) <= 1)


def _fmt(values: dict[int, float]) -> str:
    return ", ".join(f"{i}: {v:.3f}" for i, v in sorted(values.items()))
