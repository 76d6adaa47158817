"""Bring your own LLM: collect IAPO tables from an OpenAI-compatible endpoint, or run agents on it live.

``iapo_gym.llm.spec`` reads the collection spec, ``client`` talks to the endpoint (retries, cache,
spending cap), ``collect`` writes the completion log and builds the table, ``live`` is
``IAPO-Live-v0``. The ``openai`` library (``pip install "iapo-gym[llm]"``) is imported only when a
request is made.
"""

from __future__ import annotations

from iapo_gym.llm.spec import Spec, SpecError, load_spec

__all__ = ["Spec", "SpecError", "load_spec"]
