"""Submitting results: bundles with their provenance (``bundle``), merging them (``merge``), re-running a sample (``verify``)."""
