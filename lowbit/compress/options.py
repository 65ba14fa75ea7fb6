"""Typed method options for `lowbit quantize`: one frozen dataclass per concern, each validating
itself, grouped in `MethodOptions`. cli/quantize_cmd.py builds them once from the flags; the
pipeline, the method factories and the layer loop read their fields (no options dict).

  CalibrationSource   where the statistics come from: a STATS file (`calib`) or a text (`data`,
                      with the windows `samples` × `seqlen`, `seed`, the `sink_weight` and, for
                      MoE models, whether `all_experts` see every token)
  GptqOptions         `refit` rounds of least-squares scale refitting, `float_target`
  OutlierOptions      `keep_outliers` / `keep_channels` percentages and the `salience` ranking
  MethodOptions       the method name, the three above, the resume folder, and `custom` options
                      of a method registered by an API user (compress/methods.register_method)
  SpecOptions         a recipe rule's `options`: parse_spec's keywords (compress/recipe.py)

`MethodOptions.record()` is the flat form written into config.json (`method_options`) and into the
resume fingerprint; it lists what was asked for, as the flags spell it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowbit.compress.outliers import DEFAULT_SALIENCE, SALIENCES
from lowbit.errors import UsageError

CALIBRATED_METHODS = ("gptq", "awq", "awq+gptq")
BUILTIN_METHODS = ("rtn", *CALIBRATED_METHODS)
REFIT_METHODS = ("gptq", "awq+gptq")


@dataclass(frozen=True, slots=True)
class CalibrationSource:
    calib: str | None = None  # a STATS file from `lowbit calibrate`
    data: str | None = None  # or a text to calibrate on, sequentially
    samples: int = 128
    seqlen: int = 2048
    seed: int = 0
    sink_weight: float | None = None  # what each window's first position counts for (None: seqlen / 32)
    # MoE: every calibration token through every expert for the statistics (False: each expert's
    # routed tokens alone; an expert without any is quantized with RTN)
    all_experts: bool = True

    def __post_init__(self):
        if (self.calib is None) == (self.data is None):
            raise UsageError("give exactly one of --calib STATS or --data TEXT")
        if self.sink_weight is not None and self.calib is not None:
            raise UsageError("--sink-weight goes with --data; a STATS file was measured with its own (lowbit calibrate --sink-weight)")
        if not self.all_experts and self.calib is not None:
            raise UsageError("--routed-experts goes with --data; a STATS file was measured with its own (lowbit calibrate --routed-experts)")
        # the windows' sizes and the sink weight's range are checked where the windows are cut
        # (compress/calibrate.py), for `lowbit calibrate` too

    def record(self) -> dict[str, Any]:
        if self.calib is not None:
            return {"calib": self.calib}
        out: dict[str, Any] = {"data": self.data, "samples": self.samples, "seqlen": self.seqlen, "seed": self.seed}
        if self.sink_weight is not None:
            out["sink_weight"] = self.sink_weight
        if not self.all_experts:
            out["routed_experts"] = True
        return out


@dataclass(frozen=True, slots=True)
class GptqOptions:
    refit: int = 1  # rounds of scale refitting after GPTQ (compress/gptq.py), 0 = off
    float_target: bool = False  # with --data: match the float model's outputs (GPTAQ-style)

    def __post_init__(self):
        if not 0 <= self.refit <= 100:
            raise UsageError(f"--refit-rounds must be between 0 and 100, got {self.refit}")

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.refit != 1:
            out["refit"] = self.refit
        if self.float_target:
            out["float_target"] = True
        return out


@dataclass(frozen=True, slots=True)
class OutlierOptions:
    keep_outliers: float = 0.0  # percent of each matrix's weights kept in bf16
    keep_channels: float = 0.0  # percent of input channels kept whole in bf16
    salience: str = DEFAULT_SALIENCE  # compress/outliers.py

    def __post_init__(self):
        for flag, value in (("--keep-outliers", self.keep_outliers), ("--keep-channels", self.keep_channels)):
            if not 0 <= value < 100:
                raise UsageError(f"{flag} is a percentage in [0, 100), got {value:g}")
        if self.salience not in SALIENCES:
            raise UsageError(f"--outlier-salience must be one of {', '.join(SALIENCES)}, got '{self.salience}'")

    @property
    def active(self) -> bool:
        return bool(self.keep_outliers or self.keep_channels)

    def record(self) -> dict[str, Any]:
        if not self.active:
            return {}
        return {"keep_outliers": self.keep_outliers, "keep_channels": self.keep_channels, "outlier_salience": self.salience}


@dataclass(frozen=True, slots=True)
class SpecOptions:
    """A recipe rule's `options` (parse_spec's keywords), read when the recipe loads."""

    scale_rule: str | None = None  # e.g. absmax, mse (quant/spec.py)
    scale_dtype: str | None = None  # e.g. float16, bfloat16
    double_quant: bool | None = None

    def __post_init__(self):
        for name, kind, value in (("scale_rule", str, self.scale_rule), ("scale_dtype", str, self.scale_dtype),
                                  ("double_quant", bool, self.double_quant)):
            if value is not None and not isinstance(value, kind):
                raise UsageError(f"option {name} must be a {'string' if kind is str else 'boolean'}, got {value!r}")

    @classmethod
    def from_mapping(cls, options: object, where: str) -> SpecOptions:
        """The `options` of a recipe rule (`where` names it in every error)."""
        keys = cls.__dataclass_fields__
        if not isinstance(options, dict) or set(options) - set(keys):
            raise UsageError(f"{where}: options must be a mapping with keys among {', '.join(sorted(keys))}")
        try:
            return cls(**options)
        except UsageError as exc:
            raise UsageError(f"{where}: {exc}") from None

    def keywords(self) -> dict[str, Any]:
        """The options that were given, as parse_spec keywords."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if getattr(self, name) is not None}


@dataclass(frozen=True, slots=True)
class MethodOptions:
    method: str = "rtn"
    calibration: CalibrationSource | None = None
    gptq: GptqOptions = GptqOptions()
    outliers: OutlierOptions = OutlierOptions()
    work_dir: str | None = None  # resume folder beside the output (compress/workdir.py)
    snapshot_every_s: float = 60.0  # how often the layer loop saves the hidden states there
    custom: dict[str, Any] = field(default_factory=dict)  # a registered method's own options

    def __post_init__(self):
        builtin = self.method in BUILTIN_METHODS
        if builtin and self.custom:
            raise UsageError(f"method {self.method} takes no option(s) {', '.join(sorted(self.custom))}")
        calibrated = self.method in CALIBRATED_METHODS
        if builtin and not calibrated and not self.outliers.active and self.calibration is not None:
            raise UsageError(f"--calib / --data go with --method gptq, awq or awq+gptq (or rtn with --keep-outliers), not {self.method}")
        if (calibrated or self.outliers.active) and self.calibration is None:
            what = (f"--method {self.method}" if calibrated
                    else "--keep-outliers / --keep-channels (salience needs activation statistics)")
            raise UsageError(f"{what} needs exactly one of --calib STATS or --data TEXT")
        if self.gptq.refit != 1 and self.method not in REFIT_METHODS:
            raise UsageError(f"--refit-rounds goes with --method gptq or awq+gptq, not {self.method}")
        if self.gptq.float_target and (self.method != "gptq" or self.calibration is None or self.calibration.data is None):
            raise UsageError("--float-target goes with --method gptq and --data (it runs the float model beside the quantized one)")

    @property
    def calibrated(self) -> bool:
        """Whether the calibrated layer loop (compress/sequential.py) runs: a calibrated method, or
        rtn choosing outliers from statistics."""
        return self.method in CALIBRATED_METHODS or self.outliers.active

    def record(self) -> dict[str, Any]:
        """How the weights were made, flat: the calibration, GPTQ and outlier settings that were asked
        for, and a custom method's own options (never the work folder)."""
        out: dict[str, Any] = dict(self.calibration.record()) if self.calibration is not None else {}
        out.update(self.gptq.record())
        out.update(self.outliers.record())
        out.update(self.custom)
        return out
