"""Integrations with other frameworks.

Each subpackage imports its framework when it is imported itself, never before: ``import tutel``
does not import any of them.

* ``tutel.integrations.transformers``: Hugging Face transformers' MoE models run their experts
  through tutel (``experts_implementation="tutel"``).
"""
