"""Cost in money: an arm's price per completion, the expected spend per request, and a cost weight from a spend target.

With prices in the collection spec (``input_price_per_million``, ``output_price_per_million`` per
endpoint), a collected table's cost of an arm is its mean price per completion from the tokens
actually used (prompt plus completion), in the spec's currency, so the utility's cost term
``w_cost * N * cost`` is money. ``cost_weight`` turns "one unit of quality is worth V of money" into
that ``w_cost`` (docs/deploy.md, "Cost weight from a spend target"; it lives in ``iapo_gym.llm.spec``, which
applies it to a spec's ``[[contexts]]``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from iapo_gym.llm.spec import Spec, SpecError, cost_weight, load_spec

__all__ = ["CHAT_TOKENS_PER_MESSAGE", "CHAT_TOKENS_PER_REQUEST", "PROMPT_EXTRA_TOKENS", "cost_weight", "live_costs",
           "log_costs", "prompt_bytes", "prompt_token_bound", "rendered_bytes", "spend_per_request", "spend_report"]

#: Prompt tokens an upstream may count beyond one per UTF-8 byte of the prompt and two per space: a
#: begin-of-sequence token, and the space SentencePiece puts in front, written as U+2581 (3 bytes in UTF-8).
PROMPT_EXTRA_TOKENS = 4
#: Tokens a chat template may add around each message (role header, separators, end of turn): ChatML and Llama 3
#: about 5 with their special tokens; Llama 2's ``[INST] ... [/INST]`` markers are text, about 20 tokens where a
#: vocabulary spells them byte by byte (llama.cpp's default template; the tiny test model does).
CHAT_TOKENS_PER_MESSAGE = 32
#: Tokens a chat template may add once per request: the reply's header and a template's own preamble (Llama 3.1's
#: dated system preamble is about 25).
CHAT_TOKENS_PER_REQUEST = 64


def log_costs(spec: Spec, records: Sequence[dict[str, Any]], prompt_ids: Sequence[str],
              where: str | os.PathLike[str] = "log") -> np.ndarray:
    """Mean price per completion of each arm in ``prompt_ids`` (a table's prompt order) from collected log records.

    Each record's price is its ``prompt_tokens`` at its endpoint's input price plus its ``tokens``
    (completion tokens) at the output price, per million tokens.
    """
    if not spec.priced:
        raise SpecError(f"{spec.path}: the spec gives no prices (input_price_per_million, output_price_per_million)")
    arm = {p.id: i for i, p in enumerate(spec.prompts)}
    index = np.empty(len(records), dtype=np.int64)
    prompt_tokens = np.empty(len(records), dtype=np.float64)
    completion_tokens = np.empty(len(records), dtype=np.float64)
    for i, rec in enumerate(records):
        if "prompt_tokens" not in rec:
            raise SpecError(f"{where}: the line of {rec.get('key')!r} has no prompt_tokens (it was logged without "
                            "them), so its price cannot be computed; collect into a new --out folder")
        index[i], prompt_tokens[i], completion_tokens[i] = arm[rec["prompt"]], rec["prompt_tokens"], rec["tokens"]
    endpoint = np.array([p.endpoint for p in spec.prompts], dtype=np.int64)[index]
    price = np.zeros(len(records), dtype=np.float64)
    for j, e in enumerate(spec.endpoints):  # Endpoint.price: the one formula of money from tokens
        mine = endpoint == j
        price[mine] = e.price(prompt_tokens[mine], completion_tokens[mine])
    counts = np.bincount(index, minlength=len(arm))
    missing = [p.id for p, n in zip(spec.prompts, counts, strict=True) if n == 0 and p.id in prompt_ids]
    if missing:
        raise SpecError(f"{where}: no completion of arm(s) {missing} is logged, so their cost is unknown")
    mean = np.bincount(index, weights=price, minlength=len(arm)) / np.maximum(counts, 1)
    return mean[[arm[p] for p in prompt_ids]]


def rendered_bytes(rendered: str | Sequence[Mapping[str, str]]) -> int:
    """UTF-8 bytes of a rendered prompt (chat: the messages' contents)."""
    if isinstance(rendered, str):
        return len(rendered.encode("utf-8"))
    return sum(len(m["content"].encode("utf-8")) for m in rendered)


def prompt_token_bound(rendered: str | Sequence[Mapping[str, str]]) -> int:
    """At least the prompt tokens an upstream counts for ``rendered``, known before the call.

    A token covers at least one UTF-8 byte of the text the tokenizer sees; SentencePiece tokenizers see
    each space as U+2581 (3 bytes), which a vocabulary without it spells byte by byte (byte fallback), so
    a space counts 3; plus ``PROMPT_EXTRA_TOKENS`` (begin of sequence, a prefix space) and, for chat
    messages, the chat template's allowance (``CHAT_TOKENS_PER_MESSAGE`` per message and
    ``CHAT_TOKENS_PER_REQUEST`` once).
    """
    texts = [rendered] if isinstance(rendered, str) else [m["content"] for m in rendered]
    bound = sum(len(t.encode("utf-8")) + 2 * t.count(" ") for t in texts) + PROMPT_EXTRA_TOKENS
    if not isinstance(rendered, str):
        bound += CHAT_TOKENS_PER_MESSAGE * len(rendered) + CHAT_TOKENS_PER_REQUEST
    return bound


def prompt_bytes(spec: Spec) -> np.ndarray:
    """Mean UTF-8 bytes of each arm's rendered prompt over the spec's queries (chat: the messages' contents)."""
    out = np.empty(len(spec.prompts), dtype=np.float64)
    for i, p in enumerate(spec.prompts):
        out[i] = float(np.mean([rendered_bytes(p.render(q.text)) for q in spec.queries]))
    return out


def live_costs(spec: Spec) -> tuple[np.ndarray, str | None]:
    """The per-completion cost of each arm in the live env, and its unit (the currency, or None: normalized).

    ``[live] cost`` if the spec gives it (in the currency when the spec has prices); else, with
    prices, a bound from above before any request: the rendered prompt's UTF-8 bytes as its tokens
    (a token covers at least one byte; a chat template's own tokens are not counted) and ``max_tokens``
    completion tokens; else ``build.cost_scale``.
    """
    if spec.live_cost is not None:
        return np.asarray(spec.live_cost, dtype=np.float64), spec.cost_unit
    if spec.priced:
        bound = np.array([spec.endpoint_of(p).price(b, spec.sampling.max_tokens)
                          for p, b in zip(spec.prompts, prompt_bytes(spec), strict=True)], dtype=np.float64)
        return bound, spec.cost_unit
    return np.full(len(spec.prompts), spec.build.cost_scale), None


def spend_per_request(policy: Any, cost: Sequence[float] | np.ndarray) -> list[float]:
    """Per context of ``policy`` (a ``PolicyFile``): N times its arm's cost per completion (``cost`` in prompt order)."""
    index = {p.id: i for i, p in enumerate(policy.prompts)}
    return [float(c.n * cost[index[c.prompt]]) for c in policy.contexts]


def _target_costs(policy: Any, target: str) -> tuple[np.ndarray, str | None, str]:
    """The cost per completion of each policy prompt, its unit, and where it came from."""
    if Path(target).suffix.lower() in (".toml", ".json"):
        spec = load_spec(target)
        cost, unit = live_costs(spec)
        how = ("the spec's [live] cost" if spec.live_cost is not None else
               "a bound from above (prompt bytes as tokens, max_tokens completion tokens) at the spec's prices"
               if unit is not None else "the live env's normalized cost")
        return cost, unit, how
    from iapo_gym.tables import read_table

    if Path(target).is_file():
        table = read_table(target)
    else:  # a task name: the table of the policy's run (a synthetic task has one instance per run)
        from iapo_gym.data import load_task_table
        from iapo_gym.tasks import get_task

        name = str(policy.learned.get("target") or target)
        instance = int(policy.learned.get("run") or 0) if get_task(name).synthetic else 0
        table = load_task_table(name, instance=instance)
    if list(table.prompts) != [p.id for p in policy.prompts]:
        raise ValueError(f"the table's prompts {list(table.prompts)} are not the policy's")
    return table.cost_matrix().mean(axis=1), table.cost_unit, "the table's cost, averaged over its queries"


def spend_report(policy: Any, target: str) -> str:
    """A ``report.md`` section: per context the expected spend per request (N x the arm's cost per completion)."""
    cost, unit, how = _target_costs(policy, target)
    spend = spend_per_request(policy, cost)
    label = unit if unit is not None else "normalized cost units"
    lines = ["", "## Expected spend per request", "",
             f"N x the chosen arm's cost per completion ({how}), in {label}.", "",
             f"| context | prompt | N | cost per completion | spend per request ({label}) |", "|---|---|---:|---:|---:|"]
    index = {p.id: i for i, p in enumerate(policy.prompts)}
    for c, s in zip(policy.contexts, spend, strict=True):
        lines.append(f"| {c.name} | {c.prompt} | {c.n} | {cost[index[c.prompt]]:.6g} | {s:.6g} |")
    mean = sum(c.probability * s for c, s in zip(policy.contexts, spend, strict=True))
    lines += ["", f"Over the contexts' distribution: {mean:.6g} {label} per request.", ""]
    return "\n".join(lines)
