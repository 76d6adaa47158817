"""Running the protocol: agent and task specs (``specs``), the sweep and its executors (``runner``),
the result store (``store``)."""
