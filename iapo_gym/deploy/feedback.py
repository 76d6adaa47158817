"""``serve --log DIR``'s side of the outcome log: the row of an answered request, and ``POST /v1/feedback``.

``outcome_row`` turns a ``Routed`` answer into the ``iapo_gym.outcome_log.LogRow`` recorded for it (no key, the
query text only with ``--log-queries``). ``read_feedback`` checks a feedback body,
``{"id": <a response's id>, "reward": true/false | a number | a vector of one number per objective}``, naming
the bad field (400 for a body that is not a JSON object or lacks a field, 422 for a field of the wrong type or
length); ``answer_feedback`` joins it to the logged row: 200 recorded (or the same reward again: idempotent),
404 an id this log never held, 409 another reward already recorded for the id, 410 an id older than the log
keeps (its file was rotated out), each in the OpenAI error shape.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from iapo_gym.deploy.params import RequestError
from iapo_gym.outcome_log import LogRow, OutcomeLog, response_time

__all__ = ["answer_feedback", "outcome_row", "read_feedback", "unit_costs"]

#: Objective values a feedback vector may hold at most (a policy has a handful).
MAX_VECTOR = 64
#: A response id is at most this long (ours are 41 characters).
MAX_ID = 128


def unit_costs(policy: Any) -> dict[str, float]:
    """Per prompt id, the policy's cost per completion (``arm_estimates``: the unit its cost weights are in); empty
    when the policy has no estimates."""
    doc = getattr(policy, "arm_estimates", None) or {}
    return {str(e["id"]): float(e["cost"]) for e in doc.get("prompts", ())}


def outcome_row(rid: str, routed: Any, query: str | None, *, objectives: tuple[str, ...], cost: float | None,
                unit_cost: float | None, propensity: float = 1.0) -> LogRow:
    """The log row of the request answered as ``routed`` with response id ``rid`` (its time is the id's)."""
    ctx = routed.context
    if routed.answers is not None:
        outcomes: dict[str, Any] = {"aggregator": "mv", "answers": routed.answers,
                                    "votes": [[a, v] for a, v in routed.votes], "tied": routed.tied,
                                    "chosen": routed.chosen, "winner": routed.answers[routed.chosen]}
    else:
        raw = routed.objective_scores or []
        outcomes = {"aggregator": "bon", "scores": routed.scores, "chosen": routed.chosen,
                    "objective_scores": [[float(s[name]) for name in objectives] for s in raw]}
    learn = getattr(routed, "learn", None) or {}
    if "explored" in learn:  # serve --learn: the whole distribution the arm was drawn from (learn.Choice)
        outcomes["learn"] = {"explored": bool(learn["explored"]), "greedy": list(learn["greedy"]),
                             "share": float(learn["share"])}
        if learn.get("contender") is not None:  # the directed part's arm
            outcomes["learn"]["contender"] = list(learn["contender"])
        if learn.get("spread"):  # the uniform part: its mass and its candidate arms (prompts x Ns)
            outcomes["learn"]["spread"] = dict(learn["spread"])
    if "shadow" in learn:  # serve --shadow: the candidate policy's arm for the request (not served)
        outcomes["shadow"] = dict(learn["shadow"])
    rule = getattr(ctx, "rule", None)
    born = response_time(rid)
    return LogRow(id=rid, time=born if born is not None else 0.0, context=ctx.name,
                  weights=tuple(float(w) for w in ctx.weights), prompt=routed.prompt_id, n=int(ctx.n),
                  rule=rule.to_dict() if rule is not None else None, drawn=routed.n, propensity=float(propensity),
                  outcomes=outcomes, prompt_tokens=routed.prompt_tokens, completion_tokens=routed.completion_tokens,
                  cost=cost, unit_cost=unit_cost, query=query, reward=None, reward_time=None)


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def read_feedback(raw: bytes, objectives: tuple[str, ...]) -> tuple[str, bool | float | list[float]]:
    """The (id, reward) of a feedback body, or the ``RequestError`` naming the bad field."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise RequestError(400, "the feedback body is not valid JSON", "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the feedback body must be a JSON object {{\"id\": ..., \"reward\": ...}}, got "
                                f"{type(body).__name__}", "invalid_json")
    for key in ("id", "reward"):
        if key not in body:
            raise RequestError(400, f"the feedback body has no field {key!r}", "missing_field", key)
    extra = sorted(set(body) - {"id", "reward"})
    if extra:
        raise RequestError(400, f"unknown field {extra[0]!r}: a feedback body has the fields 'id' and 'reward'",
                           "unknown_parameter", extra[0])
    rid = body["id"]
    if not isinstance(rid, str) or not rid or len(rid) > MAX_ID:
        raise RequestError(422, f"field 'id' must be a response id (a string of 1 to {MAX_ID} characters), got "
                                f"{str(rid)[:80]!r}", "invalid_value", "id")
    reward = body["reward"]
    if isinstance(reward, bool):
        return rid, reward
    if _number(reward):
        return rid, float(reward)
    if isinstance(reward, list):
        if len(reward) != len(objectives) or len(reward) > MAX_VECTOR:
            raise RequestError(422, f"field 'reward' as a vector needs one number per objective {list(objectives)}, "
                                    f"got {len(reward)} values", "invalid_value", "reward")
        if not all(_number(v) for v in reward):
            raise RequestError(422, "field 'reward' as a vector must hold finite numbers", "invalid_value", "reward")
        return rid, [float(v) for v in reward]
    raise RequestError(422, f"field 'reward' must be true/false, a finite number or a vector of "
                            f"{len(objectives)} numbers, got {json.dumps(reward)[:80]}", "invalid_value", "reward")


async def answer_feedback(log: OutcomeLog | None, raw: bytes, objectives: tuple[str, ...]) -> dict[str, Any]:
    """Join the feedback in ``raw`` to its row of ``log`` (committed before this returns); the answer's body, or
    the ``RequestError`` of a refusal (module docstring)."""
    if log is None:
        raise RequestError(404, "this server keeps no outcome log to join feedback to (start it with serve --log DIR)",
                           "not_found")
    rid, reward = read_feedback(raw, objectives)
    result = await asyncio.wrap_future(log.feedback(rid, reward))
    if result.status == 404:
        raise RequestError(404, f"no response with id {rid!r} is in this server's outcome log", "unknown_id", "id")
    if result.status == 410:
        raise RequestError(410, f"the response {rid!r} is older than this server's outcome log keeps (its file was "
                                "rotated out; see --log-max-bytes and --log-keep)", "expired_id", "id")
    if result.status == 409:
        raise RequestError(409, f"another reward ({json.dumps(result.previous)}) is already recorded for the response "
                                f"{rid!r}; a reward is recorded once", "feedback_conflict", "reward")
    return {"id": rid, "reward": reward, "recorded": True}
