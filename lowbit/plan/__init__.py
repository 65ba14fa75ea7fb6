"""`lowbit plan`: memory, capacity and roofline speed of a model per number format, from its config alone.

    from lowbit.plan import make_plan, Scenario, lookup_gpu
    plan = make_plan("llama-3-8b", lookup_gpu("h100"), Scenario(context=4096, concurrency=16))
    plan.to_dict()
"""

from lowbit.plan.estimate import Scenario, estimate_format
from lowbit.plan.hardware import Hardware, custom_hardware, lookup_gpu, measure_cpu
from lowbit.plan.model_shape import ModelShape, shape_from_config
from lowbit.plan.report import DEFAULT_FORMATS, Plan, load_shape, make_plan

__all__ = [
    "DEFAULT_FORMATS",
    "Hardware",
    "ModelShape",
    "Plan",
    "Scenario",
    "custom_hardware",
    "estimate_format",
    "load_shape",
    "lookup_gpu",
    "make_plan",
    "measure_cpu",
    "shape_from_config",
]
