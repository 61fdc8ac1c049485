"""The planner: fake-weight models of one architecture, each stage's predicted peak under each setting,
and the plan that fits a budget (the fastest settings, the least offload) with the largest square side."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from ...errors import UserError
from ...families import UNetConfig, checkpoint_config, resolve_model
from ...measure.report import markdown_table
from ...optim.precision import DTYPES
from ...measure.memory_model import PLANNER_TOLERANCE, MemoryPlanConfig, fake_module, fake_tensor, fake_tensor_mode, largest_fitting, module_bytes, predict_peak
from .models import architecture, build_modules, largest_side, text_encoder_modules, text_encoders
from .settings import (
    MIB,
    OFFLOADS,
    SEARCH_SETTINGS,
    SETTINGS,
    STAGE_MODEL,
    STAGES,
    UNET_STEP,
    VAE_SETTINGS,
    Setting,
)
from .stages import stage_call

# A streamed UNet holds the layer that runs and the copies in flight on ComfyUI's two async offload streams.
_STREAMED_LAYERS = 3
SEARCH_LIMIT = 8192  # largest square side searched, in pixels
# Tracing a tiled VAE costs about 2 s per tile on this CPU; above this many tiles the peak is
# extrapolated linearly in the image area from the traces of 1x1 and 2x2 tiles (what grows with the
# area is what the tiler keeps between passes; measured against direct traces at 2048 px, the
# extrapolation over-states the peak by 16% for 512 px tiles and 24% for 256 px tiles).
_TILES_TRACED = 4


@dataclass(frozen=True)
class StagePrediction:
    stage: str
    setting: str
    size: int
    peak_bytes: int  # working memory: what the stage allocates at most, its output included
    input_bytes: int
    weight_bytes: int  # the stage's own model
    peak_op: str
    output_bytes: int = 0
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Plan:
    model: str
    width: int
    height: int
    dtype: str
    budget_bytes: int
    weights: dict[str, int]
    stock: list[StagePrediction] = field(default_factory=list)
    low_memory: list[StagePrediction] = field(default_factory=list)
    chosen: list[StagePrediction] = field(default_factory=list)
    offload: str | None = None
    streamed_unet_bytes: int = 0
    unet_resident_bytes: int = 0  # with offload "budget": the UNet's weights kept resident
    searched: bool = False
    largest_square: int | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "width": self.width, "height": self.height, "dtype": self.dtype,
            "budget_bytes": self.budget_bytes, "weights_bytes": self.weights, "offload": self.offload,
            "streamed_unet_bytes": self.streamed_unet_bytes, "unet_resident_bytes": self.unet_resident_bytes,
            "fits": self.offload is not None,
            "largest_square": self.largest_square if self.searched else "not searched",
            "stock": [p.to_dict() for p in self.stock], "low_memory": [p.to_dict() for p in self.low_memory],
            "plan": [{**p.to_dict(), "total_bytes": self.total(p, self.offload)} for p in self.chosen] if self.offload else [],
            "notes": self.notes,
        }

    def total(self, p: StagePrediction, offload: str) -> int:
        resident = self.unet_resident_bytes if offload == "budget" else self.streamed_unet_bytes
        return _resident(self.weights, p.stage, offload, resident) + p.input_bytes + p.peak_bytes


def _all_weights(weights: dict[str, int]) -> int:
    return weights["text_encoder"] + weights["unet"] + weights["vae"]


def _resident(weights: dict[str, int], stage: str, offload: str, unet_resident_bytes: int) -> int:
    """Weights resident during ``stage``; ``unet_resident_bytes`` is the UNet's part under ``budget``
    and ``sequential`` offload (the least a budget can keep: the streamed layers)."""
    if offload == "none":
        return _all_weights(weights)
    if offload in ("budget", "sequential") and stage == UNET_STEP:
        return unet_resident_bytes
    return weights[STAGE_MODEL[stage]]


class Planner:
    """Fake-weight models of one architecture and the stage predictions made with them (cached)."""

    def __init__(self, model: str, dtype: str = "fp32", workspace: str = "cpu"):
        self.model, self.dtype_name, self.dtype, self.workspace = model, dtype, DTYPES[dtype], workspace
        self.mode = fake_tensor_mode()
        self.modules = {name: fake_module(m, self.mode, "cpu", self.dtype) for name, m in build_modules(model).items()}
        self.weights = {"text_encoder": sum(module_bytes(m) for m in text_encoder_modules(self.modules)),
                        "unet": module_bytes(self.modules["unet"]), "vae": module_bytes(self.modules["vae"])}
        layers = [m for m in self.modules["unet"].modules() if next(m.children(), None) is None]
        self.streamed_unet_bytes = _STREAMED_LAYERS * max(module_bytes(m) for m in layers)
        self._cache: dict[tuple, StagePrediction] = {}

    def _make(self, shape, dtype):
        return fake_tensor(self.mode, shape, dtype)

    def predict(self, stage: str, setting: Setting, width: int, height: int) -> StagePrediction:
        if setting.tile:
            try:
                return self._predict_tiled(stage, setting, width, height)
            except (DataDependentOutputException, DynamicOutputShapeException):
                return self._tile_model(stage, setting, width, height)
        return self._trace(stage, setting, width, height)

    def _tile_model(self, stage: str, setting: Setting, width: int, height: int) -> StagePrediction:
        """The tiler branches on tensor values, which fake tensors cannot answer: one tile's untiled
        peak plus the whole output, which leaves out what the tiler keeps between passes."""
        tile = self._trace(stage, VAE_SETTINGS[0], min(width, setting.tile), min(height, setting.tile))
        fn, inputs = stage_call(self.model, stage, self.modules, width, height, self.dtype, self._make)
        whole = self._trace(stage, VAE_SETTINGS[0], 64, 64).output_bytes * (width // 64) * (height // 64)
        return StagePrediction(stage, setting.name, max(width, height), tile.peak_bytes + whole, _bytes(inputs),
                               tile.weight_bytes, tile.peak_op, output_bytes=whole,
                               note="modelled: one tile's peak + the output (the tiler did not run on fake tensors)")

    def _predict_tiled(self, stage: str, setting: Setting, width: int, height: int) -> StagePrediction:
        tiles = (width / setting.tile) * (height / setting.tile)
        if tiles > _TILES_TRACED:
            one, four = (self._trace(stage, setting, setting.tile * n, setting.tile * n) for n in (1, 2))
            peak = one.peak_bytes + (four.peak_bytes - one.peak_bytes) / 3 * (tiles - 1)
            fn, inputs = stage_call(self.model, stage, self.modules, width, height, self.dtype, self._make)
            return StagePrediction(stage, setting.name, max(width, height), int(peak), _bytes(inputs), one.weight_bytes,
                                   four.peak_op, output_bytes=one.output_bytes * int(tiles),
                                   note="extrapolated from 1x1 and 2x2 tiles")
        return self._trace(stage, setting, width, height)

    def _trace(self, stage: str, setting: Setting, width: int, height: int) -> StagePrediction:
        key = (stage, setting, width, height)
        if key not in self._cache:
            config = MemoryPlanConfig(setting.config.attention, setting.config.attention_budget_bytes,
                                      setting.config.low_memory, self.workspace)
            fn, inputs = stage_call(self.model, stage, self.modules, width, height, self.dtype, self._make, setting)
            estimate = predict_peak(fn, *inputs, config=config, mode=self.mode)
            self._cache[key] = StagePrediction(
                stage, setting.name, max(width, height), estimate.peak_bytes,
                _bytes(inputs), self.weights[STAGE_MODEL[stage]], estimate.peak_op, output_bytes=estimate.output_bytes)
        return self._cache[key]

    def first_fitting(self, stage: str, width: int, height: int, budget: int, offload: str) -> StagePrediction | None:
        for setting in SETTINGS[stage]:
            p = self.predict(stage, setting, width, height)
            if _resident(self.weights, stage, offload, self.streamed_unet_bytes) + p.input_bytes + p.peak_bytes <= budget:
                return p
        return None

    def fits_with_search_settings(self, side: int, budget: int) -> bool:
        return all(_resident(self.weights, stage, OFFLOADS[-1], self.streamed_unet_bytes) + p.input_bytes + p.peak_bytes <= budget
                   for stage in STAGES for p in [self.predict(stage, SEARCH_SETTINGS[stage], side, side)])

    def fits(self, width: int, height: int, budget: int, offload: str) -> list[StagePrediction] | None:
        chosen = []
        for stage in STAGES:
            p = self.first_fitting(stage, width, height, budget, offload)
            if p is None:
                return None
            chosen.append(p)
        return chosen


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def budget_resident_bytes(planner: Planner, step: StagePrediction, budget_bytes: int) -> int | None:
    """The UNet weights (whole MiB) that sdopt Offload's budget mode may keep resident beside ``step``'s
    inputs and working peak plus ``PLANNER_TOLERANCE``; None where that is no more than sequential
    offload keeps (the streamed layers)."""
    working = step.input_bytes + int(step.peak_bytes * (1 + PLANNER_TOLERANCE))
    resident = min(planner.weights["unet"], budget_bytes - working) // MIB * MIB
    return resident if resident > planner.streamed_unet_bytes else None


def make_plan(model: str, width: int, height: int, budget_bytes: int, dtype: str = "fp32", workspace: str = "cpu",
              search: bool = True) -> Plan:
    """Predictions for every stage (stock and low-memory settings), the fastest settings that fit the
    budget (without offload if possible) and, with ``search``, the largest square side (multiple of
    64) that fits with ``SEARCH_SETTINGS`` and the UNet streamed (sequential offload)."""
    for name, value in (("--width", width), ("--height", height)):
        if value < 64 or value % 64:
            raise UserError(f"{name}: {value} px must be a positive multiple of 64")
    name = architecture(model)
    limit = largest_side(name)
    for option, value in (("--width", width), ("--height", height)):
        if limit and value > limit:
            raise UserError(f"{option}: {value} px is over {name}'s largest side, {limit} px "
                            "(the position grid its transformer stores)")
    planner = Planner(name, dtype, workspace)
    plan = Plan(model, width, height, dtype, budget_bytes, planner.weights, streamed_unet_bytes=planner.streamed_unet_bytes)
    plan.stock = [planner.predict(stage, SETTINGS[stage][0], width, height) for stage in STAGES]
    plan.low_memory = [planner.predict(stage, SEARCH_SETTINGS[stage], width, height) for stage in STAGES]
    for offload in OFFLOADS:
        chosen = planner.fits(width, height, budget_bytes, offload)
        if chosen and offload == "budget":
            resident = budget_resident_bytes(planner, next(p for p in chosen if p.stage == UNET_STEP), budget_bytes)
            if resident is None:
                continue
            plan.unet_resident_bytes = resident
        if chosen:
            plan.chosen, plan.offload = chosen, offload
            break
    if search:
        plan.searched = True
        plan.largest_square = largest_fitting(lambda side: planner.fits_with_search_settings(side, budget_bytes),
                                              high=min(SEARCH_LIMIT, limit or SEARCH_LIMIT))
    for p in dict.fromkeys(p for p in [*plan.stock, *plan.low_memory, *plan.chosen] if p.note):
        plan.notes.append(f"{p.stage}, {p.setting}: {p.note}")
    plan.notes.append(f"{name}: the {resolve_model(name)[0].title} architecture, {dtype}, kernel workspaces modelled for {workspace}; "
                      "working peaks exclude weights and inputs, totals add them")
    if not isinstance(checkpoint_config(name).diffusion_model, UNetConfig):
        plan.notes.append(f"text encode runs {name}'s CLIP encoders only ({len(text_encoders(name))}): no T5-XXL, which sdopt "
                          "does not generate (a real checkpoint's T5 adds 4.7B parameters and 256-512 tokens); "
                          "the UNet step row is the diffusion transformer's step")
    return plan


def plan_table(plan: Plan) -> str:
    mib = lambda b: f"{b / MIB:,.0f}"
    lines = [f"{plan.model} at {plan.width}x{plan.height} ({plan.dtype}), budget {mib(plan.budget_bytes)} MiB; weights MiB: "
             + ", ".join(f"{k} {mib(v)}" for k, v in plan.weights.items()), ""]
    rows = [[s.stage, s.setting, mib(s.peak_bytes), l.setting, mib(l.peak_bytes)] for s, l in zip(plan.stock, plan.low_memory)]
    lines += markdown_table(["stage", "stock", "working peak MiB", "low memory", "working peak MiB"], rows, right={2, 4})
    lines.append("")
    if plan.offload:
        if plan.offload == "sequential":
            lines.append(f"sequential: the UNet streamed layer by layer (sdopt Offload, mode sequential), "
                         f"{mib(plan.streamed_unet_bytes)} MiB of its weights resident at a time")
        if plan.offload == "budget":
            lines.append(f"budget: sdopt Offload, mode budget, budget_mb {plan.unet_resident_bytes // MIB}: that much of the "
                         f"UNet's {mib(plan.weights['unet'])} MiB resident, the rest streamed layer by layer")
        rows = [[p.stage, p.setting, plan.offload, mib(p.peak_bytes), mib(plan.total(p, plan.offload))] for p in plan.chosen]
        lines.append(f"plan that fits {mib(plan.budget_bytes)} MiB:")
        lines += markdown_table(["stage", "settings", "offload", "working peak MiB", "total MiB (weights + inputs + peak)"],
                                rows, right={3, 4})
    else:
        lines.append(f"nothing fits {mib(plan.budget_bytes)} MiB at {plan.width}x{plan.height}, even with the low-memory settings and sequential offload")
    if plan.searched:
        side = plan.largest_square
        lines.append("")
        lines.append(f"largest square that fits (low memory 64 MiB UNet, 256 px VAE tiles, sequential offload): {f'{side}x{side}' if side else 'none'}")
    lines += [""] + [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
