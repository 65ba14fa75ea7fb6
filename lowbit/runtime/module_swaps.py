"""A process-wide count of module assignments (`parent.name = module`, `add_module`, a ModuleList
item), read through torch's global module-registration hook, plus the assignments lowbit makes
outside it (fusion.py's joined projections live in a module's __dict__).

Why: the engine's one-call decode step must notice when a module it was built from is swapped
(a draft quantized in place, projections joined again). Checking every slot it reads costs
0.08-0.15 ms a step (215 slots on SmolLM2, ~530 on a 16-layer, 8-expert MoE: the dicts are cold in
cache after the step has streamed the weights); while this count has not moved, no slot below the
layer lists can have been reassigned through those routes, so only the few top-level slots are
checked (engine/decode_chain.py)."""

from __future__ import annotations

from torch.nn.modules import module as torch_module

_count = 0


def count() -> int:
    """How many module assignments this process has made (only ever grows)."""
    return _count


def note_swap() -> None:
    """Count an assignment made outside nn.Module's own routes (a module stored in a __dict__)."""
    global _count
    _count += 1


def _registered(module, name, submodule):
    note_swap()
    return None  # keep the module as it was given


torch_module.register_module_module_registration_hook(_registered)
