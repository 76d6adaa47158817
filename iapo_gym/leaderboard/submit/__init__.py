"""Submitting results: bundles of a results folder (``bundle``), merging them (``merge``), re-running a sample
(``verify``), and where merged runs came from (``provenance``: the one module a report reads)."""
