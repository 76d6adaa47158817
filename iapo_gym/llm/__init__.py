"""Bring your own LLM: collect IAPO tables from OpenAI-compatible endpoints, or run agents on them live.

``iapo_gym.llm.spec`` reads the collection spec (one endpoint, or several whose (endpoint, prompt)
pairs are the arms), ``client`` talks to an endpoint (retries, cache, spending cap), ``collect``
writes the completion log and builds the table, ``live`` is ``IAPO-Live-v0``, ``prices`` turns
token counts into money. The ``openai`` library (``pip install "iapo-gym[llm]"``) is imported only
when a request is made.
"""

from __future__ import annotations

from iapo_gym.llm.spec import Spec, SpecError, load_spec

__all__ = ["Spec", "SpecError", "load_spec"]
