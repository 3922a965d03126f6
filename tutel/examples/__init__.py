"""Runnable examples: ``python3 -m tutel.examples.<name> --help``."""
