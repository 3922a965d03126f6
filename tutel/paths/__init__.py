"""The execution paths: how a routed call's rows reach the experts and come back.

Every path is a row of tutel.paths.table: the routing it takes and three stages, each a function of
the call's ``Work`` (tutel.paths.work):

* **prepare** (tutel.paths.prepare): the routing -> the rows' plan: the choices sorted by expert, a
  grouped buffer of static size planned on the device, Tutel's [E, C, M] slots, megablocks' occupied
  rows, or the choices as a fused operator takes them;
* **experts** (one module per implementation: experts_grouped, experts_per_expert, experts_pieces,
  experts_one_call, experts_decode, experts_module): the products;
* **finalize** (tutel.paths.finalize): the outputs back in token order, weighted.

``run(path, work)`` runs one; moe_layer (tutel.impls.layer_paths), routed experts
(tutel.experts.routed) and transformers' "tutel" experts all call it.  Which path a call takes is
tutel.rules.paths' choice, on the facts built in tutel.paths.facts.
"""
from .table import STAGES, run
from .work import GatedWeights, ModuleExperts, QuantizedExperts, WeightExperts, Work

__all__ = ["GatedWeights", "ModuleExperts", "QuantizedExperts", "STAGES", "WeightExperts", "Work", "run"]
