"""Checkpoints of MoE models across world sizes: ``from tutel import checkpoint``.

* ``load_resharded(model, pattern, saved_world_size)`` -- resume a model on M processes
  from the per-rank files of N processes (one call on every process).
* ``moe_layer.load_state_dict`` also accepts a gathered checkpoint (all experts in one
  file, as a single process would save it) on any number of processes.
* ``gather_state_dicts`` / ``scatter_state_dict`` / ``reshard_state_dicts`` -- the same
  conversions on state dicts in memory; ``python3 -m tutel.checkpoint.gather`` and
  ``python3 -m tutel.checkpoint.scatter`` on files.

Every conversion checks that each global expert is present exactly once
(``ExpertCoverageError`` names the missing and duplicated ones) and is exact.
See docs/checkpoints.md.
"""
from .layouts import ShapeError
from .loading import load_resharded
from ..rules.placement import Placement
from .reshard import ExpertCoverageError, gather_state_dicts, reshard_state_dicts, scatter_state_dict

__all__ = ["ExpertCoverageError", "Placement", "ShapeError", "gather_state_dicts", "load_resharded",
           "reshard_state_dicts", "scatter_state_dict"]
