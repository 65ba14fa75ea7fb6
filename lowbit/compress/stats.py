"""Calibration statistics of every Linear input, and the STATS file that stores them.

One `InputStats` per *input site*: the Linears that read the same tensor (q/k/v after the
input norm, gate/up after the MLP norm, o_proj, down_proj) share one site, so their Hessian is
computed and stored once. Everything a method needs comes from here:
  hessian   E[x xᵀ] float32 [K, K] (the sum Σ x xᵀ divided by `tokens`); GPTQ's H and the exact
            output MSE of any weight error E as tr(E H Eᵀ), which is how AWQ scores its scales
  mean_abs  E|x| per input channel [K] (AWQ's activation term)
  sq_mean   E[x²] per channel [K] (outlier salience, RTN's scale-search weights)
  max_abs   max |x| per channel [K]

The STATS file is safetensors: `<site>.hessian|mean_abs|sq_mean|max_abs` tensors plus a JSON
header (metadata key "lowbit_stats") holding the model's identity — its name, architecture,
a hash of config.json and the shape of every Linear — the calibration settings and the site map.
`check_identity` refuses stats from another model with one line, so a STATS file can be reused
by any later `lowbit quantize` of the same model in any format.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lowbit.errors import LowbitError

STATS_VERSION = 1
_META_KEY = "lowbit_stats"
_FIELDS = ("hessian", "mean_abs", "sq_mean", "max_abs")
# Keys of config.json that say how a checkpoint was saved, not what the model computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "torch_dtype", "dtype", "transformers_version", "quantization_config", "use_cache"}


@dataclass(slots=True)
class InputStats:
    """What calibration measured about one input site (see the module docstring)."""

    hessian: torch.Tensor
    mean_abs: torch.Tensor | None  # None when not measured (GPTQ's staged pass needs only H)
    sq_mean: torch.Tensor
    max_abs: torch.Tensor | None  # likewise
    tokens: int
    # E[(x_float − x) xᵀ] [K, K]: how the float model's inputs differ from these, measured only by
    # the staged pass with float targets (compress/staged.py); never stored in a STATS file.
    shift: torch.Tensor | None = None

    @property
    def channels(self) -> int:
        return int(self.sq_mean.numel())

    def scaled(self, s: torch.Tensor) -> InputStats:
        """The statistics of x / s (AWQ divides a site's input by s and multiplies the weights by it)."""
        s = s.to(self.hessian.dtype)
        inv = 1.0 / s
        return InputStats(
            hessian=self.hessian * inv[:, None] * inv[None, :],
            mean_abs=None if self.mean_abs is None else self.mean_abs * inv,
            sq_mean=self.sq_mean * inv * inv,
            max_abs=None if self.max_abs is None else self.max_abs * inv,
            tokens=self.tokens,
            shift=None if self.shift is None else self.shift * inv[:, None] * inv[None, :],
        )


# Rows of Σxxᵀ per product. Smaller blocks skip more of the part below the diagonal (at
# K = 1536: 58% of the full product with 256, 67% with 512) and measured fastest on 2 cores at
# K = 576 and 1536 (bf16, 8192 tokens); 128 is no faster.
_HESSIAN_BLOCK = 256


class StatsAccumulator:
    """Running sums for one site; `add(x)` with x [..., K] in any float dtype, `finish()` → InputStats.

    Products are taken in float32 and summed in float64 so the result does not depend on how
    many batches the tokens came in beyond float32 rounding of each batch's product.
    moments=False skips mean |x| and max |x| (left None): GPTQ needs only Σxxᵀ, and the two
    reductions cost a quarter as much as the Hessian itself.
    """

    __slots__ = ("xtx", "abs_sum", "max_abs", "tokens", "first_weight", "weight_sum", "first_rows")

    def __init__(self, channels: int, moments: bool = True, first_weight: float = 1.0):
        if not first_weight >= 1.0:
            raise ValueError(f"first_weight must be at least 1, got {first_weight}")
        self.xtx = torch.zeros(channels, channels, dtype=torch.float64)
        self.abs_sum = torch.zeros(channels, dtype=torch.float64) if moments else None
        self.max_abs = torch.zeros(channels, dtype=torch.float32) if moments else None
        self.tokens = 0
        self.first_weight = first_weight
        self.weight_sum = 0.0  # Σ of the tokens' weights: `tokens` plus (first_weight − 1) per window
        self.first_rows: list[torch.Tensor] = []  # each window's position 0, weighed in by `finish`

    def add(self, x: torch.Tensor) -> None:
        """Add the tokens of x: [windows, positions, K] (position 0 weighs `first_weight`), or [tokens, K]."""
        extra = self.first_weight - 1.0
        # a copy, never a view: the rows are kept until `finish`, and a view would keep all of x
        first = x[:, 0, :].to(torch.float32, copy=True) if extra and x.dim() == 3 else None
        x = x.reshape(-1, x.shape[-1])
        if x.dtype != torch.bfloat16:
            x = x.float()
        # bf16 inputs multiply exactly with float32 accumulation at twice the float32 speed; only
        # the batch's product is rounded to bf16 (2^-9 relative), and those roundings average out
        # over the batches. Σxxᵀ is symmetric, so only the blocks on and above the diagonal are
        # computed (2/3 of the work at K = 1536); `finish` mirrors them.
        k = x.shape[1]
        for i in range(0, k, _HESSIAN_BLOCK):
            block = x[:, i : i + _HESSIAN_BLOCK]
            self.xtx[i : i + _HESSIAN_BLOCK, i:] += (block.T @ x[:, i:]).double()
        if self.abs_sum is not None:
            a = x.abs()
            self.abs_sum += a.sum(0, dtype=torch.float32).double()
            self.max_abs = torch.maximum(self.max_abs, a.amax(0).float())
        self.tokens += x.shape[0]
        self.weight_sum += x.shape[0]
        if first is not None:
            # The windows' first position counts first_weight times (see `first_token_weight`):
            # `finish` adds its product (first_weight − 1) more times, in one float64 product of
            # all the windows' rows (a [K, K] update per batch cost ~3% of a 2048-token run).
            self.first_rows.append(first)
            if self.abs_sum is not None:
                self.abs_sum += first.abs().sum(0).double().mul_(extra)
            self.weight_sum += extra * first.shape[0]

    def finite(self) -> bool:
        """False once any input so far held a NaN or inf. A non-finite x_i makes Σx_i² (the
        diagonal) non-finite, so K values say it, cheaply enough to ask after every batch."""
        return bool(torch.isfinite(torch.diagonal(self.xtx)).all())

    def finish(self) -> InputStats:
        n = max(self.tokens, 1) if self.weight_sum == self.tokens else self.weight_sum
        upper = torch.triu(self.xtx)
        xtx = upper + torch.triu(upper, 1).T
        if self.first_rows:
            first = torch.cat(self.first_rows).double()
            xtx += (first.T @ first).mul_(self.first_weight - 1.0)
        return InputStats(
            hessian=(xtx / n).float(),
            mean_abs=None if self.abs_sum is None else (self.abs_sum / n).float(),
            sq_mean=(torch.diagonal(xtx) / n).float(),  # Σx² is diag(Σxxᵀ)
            max_abs=None if self.max_abs is None else self.max_abs.clone(),
            tokens=self.tokens,
        )


class ShiftAccumulator:
    """Σ (x_float − x) xᵀ for one site, weighted like `StatsAccumulator` (the first position of each
    window counts `first_weight` times); `finish()` divides by the same total weight."""

    __slots__ = ("sum", "first_weight", "weight_sum")

    def __init__(self, channels: int, first_weight: float = 1.0):
        self.sum = torch.zeros(channels, channels, dtype=torch.float64)
        self.first_weight = first_weight
        self.weight_sum = 0.0

    def add(self, x_float: torch.Tensor, x: torch.Tensor) -> None:
        """x_float, x: [windows, positions, K], the float model's and the quantized model's inputs."""
        diff = x_float.float() - x.float()
        extra = self.first_weight - 1.0
        if extra and x.dim() == 3:
            first_diff, first = diff[:, 0, :], x[:, 0, :].float()
            self.sum += (first_diff.T @ first).double().mul_(extra)
            self.weight_sum += extra * first.shape[0]
        diff = diff.reshape(-1, diff.shape[-1])
        x = x.reshape(-1, x.shape[-1])
        if x.dtype == torch.bfloat16:  # same speed argument as StatsAccumulator.add
            diff = diff.to(torch.bfloat16)
        else:
            x = x.float()
        self.sum += (diff.T @ x).double()
        self.weight_sum += x.shape[0]

    def finish(self) -> torch.Tensor:
        return (self.sum / max(self.weight_sum, 1.0)).float()


def config_hash(config: dict) -> str:
    """sha256 of config.json without the keys that only describe how it was saved."""
    kept = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def model_identity(config: dict, shapes: dict[str, list[int]], name: str) -> dict:
    """What a STATS file must agree with: name, architecture, config hash, every Linear's [N, K]."""
    archs = config.get("architectures") or [config.get("model_type", "?")]
    return {"name": name, "architecture": str(archs[0]), "config_hash": config_hash(config), "shapes": shapes}


def check_identity(stored: dict, expected: dict, where: str) -> None:
    if stored.get("config_hash") != expected["config_hash"] or stored.get("shapes") != expected["shapes"]:
        raise LowbitError(
            f"{where} was calibrated on {stored.get('name', '?')} ({stored.get('architecture', '?')}, config "
            f"{stored.get('config_hash', '?')}), not on {expected['name']} ({expected['architecture']}, config "
            f"{expected['config_hash']}); run `lowbit calibrate` on this model"
        )


def save_stats(
    path: str | Path,
    sites: dict[str, InputStats],
    site_modules: dict[str, list[str]],
    identity: dict,
    calibration: dict,
    expert_tokens: dict[str, list[int]] | None = None,
) -> None:
    """Write a STATS file to `path` (callers wrap it in atomic_file). expert_tokens: MoE block ->
    calibration tokens the router sent each expert (kept in the header for quantize's summary)."""
    tensors: dict[str, torch.Tensor] = {}
    tokens = {}
    for site, st in sites.items():
        for f in _FIELDS:
            tensors[f"{site}.{f}"] = getattr(st, f).detach().float().contiguous().cpu()
        tokens[site] = st.tokens
    header = {
        "version": STATS_VERSION,
        "identity": identity,
        "calibration": calibration,
        "sites": site_modules,
        "tokens": tokens,
    }
    if expert_tokens:
        header["expert_tokens"] = expert_tokens
    save_file(tensors, str(path), metadata={_META_KEY: json.dumps(header, sort_keys=True)})


class StatsFile:
    """A STATS file opened lazily: `header`, `site_of(module)`, `site(name)` → InputStats.

    Everything in the file is checked before a method uses it (the header's structure on open, every
    tensor's shape and values in `check`), so a damaged or foreign file is one LowbitError line
    naming the part, before any work folder or output exists."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise LowbitError(f"stats file not found: {self.path}")
        try:
            self._handle = safe_open(str(self.path), framework="pt")
            meta = self._handle.metadata() or {}
            self.header = json.loads(meta[_META_KEY])
        except Exception as exc:  # noqa: BLE001 - safetensors and json raise unrelated types for a bad file
            raise LowbitError(f"{self.path} is not a lowbit STATS file (make one with `lowbit calibrate`): {type(exc).__name__}") from None
        if not isinstance(self.header, dict):
            self._corrupt("its header is not a JSON object")
        version = self.header.get("version", 0)
        if isinstance(version, bool) or not isinstance(version, int):
            self._corrupt(f"version {json.dumps(version)[:40]} is not an integer")
        if version > STATS_VERSION:
            raise LowbitError(f"{self.path}: stats version {version} is newer than this lowbit reads")
        sites, tokens, identity = (self.header.get(k) for k in ("sites", "tokens", "identity"))
        if not isinstance(identity, dict):
            self._corrupt("its header has no identity object")
        if not isinstance(sites, dict) or not all(
            isinstance(mods, list) and mods and all(isinstance(m, str) for m in mods) for mods in sites.values()
        ):
            self._corrupt("its site map is not {site: [module, ...]}")
        if not isinstance(tokens, dict) or set(tokens) != set(sites) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in tokens.values()
        ):
            self._corrupt("its token counts do not give a positive integer for every site")
        if not isinstance(self.header.get("calibration", {}), dict):
            self._corrupt("its calibration settings are not an object")
        self.site_modules: dict[str, list[str]] = sites
        self._site_of = {m: site for site, mods in self.site_modules.items() for m in mods}

    def _corrupt(self, why: str):
        raise LowbitError(f"{self.path} is a damaged lowbit STATS file: {why} (make a new one with `lowbit calibrate`)")

    @property
    def identity(self) -> dict:
        return self.header["identity"]

    def check(self, expected_identity: dict) -> None:
        """The file was made on this model, and every site holds finite statistics of the right shapes."""
        check_identity(self.identity, expected_identity, str(self.path))
        shapes = expected_identity["shapes"]
        # a file measured on routed tokens only (`lowbit calibrate --routed-experts`) has nothing for
        # an MoE expert the router sent no token; quantize falls back to RTN for it
        routed_only = self.header.get("calibration", {}).get("all_experts", True) is False
        for module in shapes:
            if not (routed_only and ".experts." in module):
                self.site_of(module)
        for site, modules in self.site_modules.items():
            stray = [m for m in modules if m not in shapes]
            if stray:
                self._corrupt(f"site {site} lists {stray[0]}, which is not a Linear of this model")
            widths = {int(shapes[m][1]) for m in modules}
            if len(widths) != 1:
                self._corrupt(f"site {site} groups Linears of different input widths")
            k = widths.pop()
            for f in _FIELDS:
                self._checked(site, f, (k, k) if f == "hessian" else (k,))

    def _checked(self, site: str, field: str, shape: tuple[int, ...]) -> torch.Tensor:
        name = f"{site}.{field}"
        try:
            t = self._handle.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - a missing or unreadable tensor, as safetensors reports it
            self._corrupt(f"tensor {name} cannot be read ({type(exc).__name__})")
        if tuple(t.shape) != shape or not t.is_floating_point():
            self._corrupt(f"tensor {name} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, expected float {list(shape)}")
        if not torch.isfinite(t.float() if t.element_size() == 1 else t).all():
            self._corrupt(f"tensor {name} holds NaN/inf values")
        return t

    def site_of(self, module: str) -> str:
        try:
            return self._site_of[module]
        except KeyError:
            raise LowbitError(f"{self.path} has no statistics for {module}") from None

    def site(self, name: str) -> InputStats:
        if name not in self.site_modules:
            raise LowbitError(f"{self.path} has no statistics for site {name}")
        tensors = {f: self._handle.get_tensor(f"{name}.{f}") for f in _FIELDS}
        return InputStats(tokens=int(self.header["tokens"][name]), **tensors)

    def layer_expert_tokens(self, prefix: str) -> dict[str, list[int]]:
        """MoE block -> tokens routed to each expert, for the blocks under `prefix` (empty before
        STATS files recorded them)."""
        return {b: list(c) for b, c in self.header.get("expert_tokens", {}).items() if b.startswith(prefix)}

    def layer_sites(self, prefix: str) -> dict[str, list[str]]:
        """The sites (and their modules) whose names start with `prefix` (e.g. 'model.layers.3.')."""
        return {s: m for s, m in self.site_modules.items() if s.startswith(prefix)}
