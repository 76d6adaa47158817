"""Completions to outcomes: answer extractors for majority vote, objective scorers for Best-of-N."""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable
from typing import Any

from iapo_gym.llm.spec import Scorer

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _canonical_number(text: str) -> str:
    """``1,234.0`` -> ``1234``: numbers compare as the table builder compares them."""
    clean = text.replace(",", "")
    try:
        value = float(clean)
    except ValueError:
        return clean
    if math.isfinite(value) and value.is_integer():
        return str(int(value))
    return repr(value)


def last_number(text: str) -> str | None:
    """The last number in the text, canonical (integral values without a decimal point)."""
    found = _NUMBER.findall(text)
    return _canonical_number(found[-1]) if found else None


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces allowed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                inner = text[i + 1:j].strip()
                return (_canonical_number(inner) if _NUMBER.fullmatch(inner) else inner) or None
    return None


def choice_letter(text: str, choices: str = "ABCDE") -> str | None:
    """The last standalone choice letter (``(B)``, ``B.``, ``answer: B``)."""
    found = re.findall(rf"(?<![A-Za-z])([{re.escape(choices)}])(?![A-Za-z])", text)
    return found[-1] if found else None


def make_extractor(scorer: Scorer) -> Callable[[str], str | None]:
    """The majority-vote extractor the spec names."""
    if scorer.extractor == "last_number":
        return last_number
    if scorer.extractor == "boxed":
        return boxed
    if scorer.extractor == "choice":
        letters = scorer.choices
        return lambda text: choice_letter(text, letters)
    if scorer.extractor == "regex":
        pattern = re.compile(str(scorer.pattern))

        def regex(text: str) -> str | None:
            found = list(pattern.finditer(text))
            if not found:
                return None
            m = found[-1]
            value = m.group(1) if m.groups() else m.group(0)
            return value.strip() or None if value is not None else None
        return regex
    raise ValueError(f"unknown extractor {scorer.extractor!r}")


ScoreFn = Callable[[str, str], dict[str, float]]


def _check_scores(scores: Any, objectives: tuple[str, ...], source: str) -> dict[str, float]:
    if not isinstance(scores, dict) or not scores:
        raise ValueError(f"{source} must return an object of named scores, got {scores!r}")
    out: dict[str, float] = {}
    for name, value in scores.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{source} gave score {name!r} = {value!r}; scores must be finite numbers")
        out[str(name)] = float(value)
    if objectives and set(out) != set(objectives):
        raise ValueError(f"{source} gave objectives {sorted(out)}, the spec names {sorted(objectives)}")
    return out


def make_scorer(scorer: Scorer, timeout: float = 60.0) -> ScoreFn:
    """The Best-of-N scorer: ``(completion, query) -> {objective: score}`` from a callable or a reward endpoint."""
    if scorer.callable is not None:
        module_name, attr = scorer.callable.split(":", 1)
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"scorer.callable {scorer.callable!r} cannot be loaded: {exc}") from None
        return lambda completion, query: _check_scores(fn(completion, query), scorer.objectives, scorer.callable or "")
    url = str(scorer.reward_url)

    def reward(completion: str, query: str) -> dict[str, float]:
        import urllib.request

        body = json.dumps({"query": query, "completion": completion}).encode("utf-8")
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (URL checked to be http(s))
            payload = json.loads(resp.read())
        scores = payload.get("scores", payload) if isinstance(payload, dict) else payload
        return _check_scores(scores, scorer.objectives, f"reward endpoint {url}")
    return reward
