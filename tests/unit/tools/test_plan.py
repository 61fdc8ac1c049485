"""``python -m sdopt plan``: input errors as one line, a plan for mini at 512, the predicted VAE
decode peak at 512 against the peak RSS growth of a real decode in a fresh process, and SDXL: two
text encoders, the UNet's ``y`` vector (diffusers' added_cond_kwargs) and its checkpoints' architecture;
SD3.5 and Flux: their text encoders, the transformer step's inputs as diffusers takes them, Flux's
latent packing, their checkpoints' architecture and SD3.5's largest side."""
import json

import math

import pytest
import torch

from sdopt.tools.cli import main

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from sdopt.optim.memory_plan import fake_module, fake_tensor, fake_tensor_mode, module_bytes, predict_peak  # noqa: E402
from sdopt.tools.plan import (  # noqa: E402
    PLANNER_TOLERANCE,
    SETTINGS,
    TEXT_ENCODE,
    UNET_STEP,
    VAE_DECODE,
    Planner,
    architecture,
    build_modules,
    lowmem_setting,
    measure_stage,
    stage_call,
)

# The planner's target: predicted peak within 20% of the measured peak RSS growth (CPU, fp32).
PREDICTION_TOLERANCE = PLANNER_TOLERANCE


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdopt: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("budget", ["lots", "8 parsecs", "0GiB"])
def test_bad_budget_names_the_option(capsys, budget):
    assert "--budget" in _one_line_error(capsys, ["plan", "--budget", budget])


def test_bad_size_names_the_option(capsys):
    assert "--width: 500 px" in _one_line_error(capsys, ["plan", "--width", "500"])


def test_missing_checkpoint_names_the_option(capsys, tmp_path):
    assert "--model" in _one_line_error(capsys, ["plan", "--model", str(tmp_path / "none.safetensors")])


def test_checkpoint_architecture_from_its_keys(tmp_path):
    from safetensors.torch import save_file

    from sdopt.tools.modelgen import UNET_PREFIX, checkpoint_specs

    unet = {k: torch.zeros(spec.shape, dtype=torch.float16).expand(spec.shape).contiguous()
            for k, spec in checkpoint_specs("mini").items() if k.startswith(UNET_PREFIX)}
    save_file(unet, tmp_path / "mini.safetensors")
    assert architecture(str(tmp_path / "mini.safetensors")) == "mini"


def test_cli_prints_a_plan_for_mini_at_512(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "mini", "--width", "512", "--height", "512", "--budget", "4GiB", "--no-search",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| UNet step | sdpa, CFG batch 2 |" in printed and "plan that fits 4,096 MiB" in printed
    plan = json.loads(out.read_text())
    assert plan["fits"] and plan["offload"] == "none"
    assert [row["stage"] for row in plan["plan"]] == ["text encode", "UNet step", "VAE decode", "VAE encode"]
    for row in plan["plan"]:
        assert row["total_bytes"] <= 4 * 2**30
        assert row["total_bytes"] == (sum(plan["weights_bytes"].values()) + row["input_bytes"] + row["peak_bytes"])
    # A UNet step with CFG at 512 holds its batch-2 activations: tens of MiB at least, and not GiBs.
    unet = plan["stock"][1]
    assert 32 * 2**20 < unet["peak_bytes"] < 2 * 2**30


@pytest.mark.skipif(not __import__("pathlib").Path("/proc/self/clear_refs").exists(), reason="peak RSS is read from /proc")
def test_vae_decode_prediction_matches_measured_rss_at_512():
    mode = fake_tensor_mode()
    modules = {"vae": fake_module(build_modules("full", names=("vae",))["vae"], mode)}
    fn, inputs = stage_call("full", VAE_DECODE, modules, 512, 512, torch.float32, lambda shape, dtype: fake_tensor(mode, shape, dtype))
    predicted = predict_peak(fn, *inputs, mode=mode).peak_bytes
    measured = measure_stage("full", VAE_DECODE, 512, 512)
    assert abs(predicted - measured) <= PREDICTION_TOLERANCE * measured, (predicted / 2**20, measured / 2**20)


def test_check_prints_predicted_against_measured(capsys, tmp_path, monkeypatch):
    from sdopt.tools import plan as plan_module

    monkeypatch.setattr(plan_module, "CHECK_CASES", (("mini", plan_module.UNET_STEP, 64), ("mini", plan_module.UNET_STEP, 4096)))
    assert main(["plan", "--check", "--repeats", "1", "--max-size", "128", "--json", str(tmp_path / "c.json")]) == 0
    (row,) = json.loads((tmp_path / "c.json").read_text())
    assert (row["model"], row["size"]) == ("mini", 64) and len(row["measured_bytes"]) == 1, "the 4096 case is left out"
    assert row["predicted_bytes"] > 0 and row["median_bytes"] > 0
    assert "| mini unet" in capsys.readouterr().out.lower()
    assert "--repeats" in _one_line_error(capsys, ["plan", "--check", "--repeats", "0"])


def test_sequential_offload_streams_the_unet_when_its_weights_do_not_fit():
    planner = Planner("mini")
    predictions = [planner.predict(UNET_STEP, setting, 128, 128) for setting in SETTINGS[UNET_STEP]]
    budget = planner.streamed_unet_bytes + min(p.input_bytes + p.peak_bytes for p in predictions)
    assert 0 < planner.streamed_unet_bytes < planner.weights["unet"]
    assert planner.first_fitting(UNET_STEP, 128, 128, budget, "model") is None
    assert planner.first_fitting(UNET_STEP, 128, 128, budget, "sequential") is not None


def test_budget_offload_keeps_what_the_budget_leaves_of_the_unet_resident():
    from sdopt.tools.plan import make_plan, plan_table

    planner = Planner("full")  # its UNet outweighs its text encoder, as in every real checkpoint
    budget = planner.weights["unet"] - 2**20
    plan = make_plan("full", 128, 128, budget, search=False)
    step = next(p for p in plan.chosen if p.stage == UNET_STEP)
    assert plan.offload == "budget", "the whole UNet does not fit, and streaming all of it would keep less than the budget allows"
    margin = int(step.peak_bytes * PLANNER_TOLERANCE)  # the planner's accuracy, left free beside the step
    assert plan.unet_resident_bytes == (budget - step.input_bytes - step.peak_bytes - margin) // 2**20 * 2**20
    assert planner.streamed_unet_bytes < plan.unet_resident_bytes < planner.weights["unet"]
    assert plan.total(step, "budget") <= budget
    assert f"mode budget, budget_mb {plan.unet_resident_bytes // 2**20}" in plan_table(plan)
    stock_step = planner.predict(UNET_STEP, SETTINGS[UNET_STEP][0], 512, 512)
    tight_budget = planner.streamed_unet_bytes + stock_step.input_bytes + int(stock_step.peak_bytes * (1 + PLANNER_TOLERANCE))
    tight = make_plan("full", 512, 512, tight_budget, search=False)
    assert tight.offload == "sequential", "a budget that leaves no more than the streamed layers is sequential offload"


@pytest.fixture(scope="module")
def sdxl_tiny():
    return Planner("sdxl-tiny")


def test_sdxl_text_encode_runs_both_encoders(sdxl_tiny):
    from sdopt.families import checkpoint_config

    clip_l, clip_g = checkpoint_config("sdxl-tiny").text_encoders
    encoders = {name: type(module).__name__ for name, module in sdxl_tiny.modules.items() if name.startswith("text_encoder")}
    assert encoders == {"text_encoder": "CLIPTextModel", "text_encoder_2": "CLIPTextModelWithProjection"}
    assert sdxl_tiny.weights["text_encoder"] == sum(module_bytes(sdxl_tiny.modules[name]) for name in encoders)
    fn, inputs = stage_call("sdxl-tiny", TEXT_ENCODE, sdxl_tiny.modules, 64, 64, torch.float32, sdxl_tiny._make)
    with sdxl_tiny.mode:
        hidden = fn(*inputs)
    assert tuple(hidden.shape) == (1, 77, clip_l.hidden_size + clip_g.hidden_size)


def test_sdxl_unet_step_takes_the_y_vector(sdxl_tiny):
    from sdopt.families import checkpoint_config

    config = checkpoint_config("sdxl-tiny")
    fn, inputs = stage_call("sdxl-tiny", UNET_STEP, sdxl_tiny.modules, 128, 64, torch.float32, sdxl_tiny._make)
    x, sigma, context, pooled, time_ids = inputs
    down = config.vae.downscale
    assert tuple(x.shape) == (2, 4, 64 // down, 128 // down) and tuple(context.shape) == (2, 77, config.diffusion_model.context_dim)
    # y = pooled CLIP-G text + six size and crop ids, each embedded to the same width: adm_in_channels in all.
    unet = sdxl_tiny.modules["unet"]
    assert tuple(pooled.shape) == (2, config.text_encoders[-1].projection_dim) and tuple(time_ids.shape) == (2, 6)
    assert pooled.shape[1] + 6 * unet.config.addition_time_embed_dim == config.diffusion_model.adm_in_channels
    stock = sdxl_tiny.predict(UNET_STEP, SETTINGS[UNET_STEP][0], 128, 128)
    # Sequential CFG must split y with the latent, or the UNet's batch-1 halves meet a batch-2 vector.
    low = sdxl_tiny.predict(UNET_STEP, lowmem_setting(1), 128, 128)
    assert 0 < low.peak_bytes < stock.peak_bytes
    assert stock.input_bytes == sum(t.numel() * t.element_size() for t in stage_call(
        "sdxl-tiny", UNET_STEP, sdxl_tiny.modules, 128, 128, torch.float32, sdxl_tiny._make)[1])


def test_sdxl_checkpoint_architecture_from_its_keys(tmp_path):
    from safetensors.torch import save_file

    from sdopt.tools.modelgen import UNET_PREFIX, checkpoint_specs

    unet = {k: torch.zeros(spec.shape, dtype=torch.float16) for k, spec in checkpoint_specs("sdxl-tiny").items()
            if k.startswith(UNET_PREFIX)}
    save_file(unet, tmp_path / "xl.safetensors")
    assert architecture(str(tmp_path / "xl.safetensors")) == "sdxl-tiny"
    save_file({f"{UNET_PREFIX}input_blocks.0.0.weight": torch.zeros(1)}, tmp_path / "other.safetensors")
    with pytest.raises(Exception, match="matches none of the architectures"):
        architecture(str(tmp_path / "other.safetensors"))


def test_cli_plans_sdxl_mini(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "sdxl-mini", "--width", "512", "--height", "512", "--budget", "8GiB", "--no-search",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "sdxl-mini: the SDXL architecture" in printed
    plan = json.loads(out.read_text())
    assert plan["fits"] and [row["stage"] for row in plan["plan"]] == ["text encode", "UNet step", "VAE decode", "VAE encode"]
    # CLIP-L and OpenCLIP-G in fp32: about 0.47 and 2.6 GiB.
    assert 3.0 * 2**30 < plan["weights_bytes"]["text_encoder"] < 3.2 * 2**30
    unet = plan["stock"][1]
    assert 32 * 2**20 < unet["peak_bytes"] < 2 * 2**30


def test_check_takes_the_cases_of_one_model(capsys, monkeypatch):
    from sdopt.tools import plan as plan_module

    asked = []
    monkeypatch.setattr(plan_module, "check_predictions", lambda cases, repeats, dtype, workspace: asked.extend(cases) or [])
    assert main(["plan", "--check", "--model", "sdxl-mini"]) == 0
    assert [(model, stage) for model, stage, _ in asked] == [("sdxl-mini", UNET_STEP)] * 3
    assert sorted(size for *_, size in asked) == [512, 1024, 2048]
    assert "the checked models are mini, full, sdxl-mini, sd35-mini, flux-mini" in _one_line_error(capsys, ["plan", "--check", "--model", "sdxl-full"])
    assert "--max-size 10: it leaves out every case; the smallest checked size is 512" in _one_line_error(
        capsys, ["plan", "--check", "--max-size", "10"])


def test_check_on_the_gpu_needs_one(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--check --workspace cuda measures on a GPU, and torch sees none here" in _one_line_error(
        capsys, ["plan", "--check", "--workspace", "cuda", "--dtype", "fp16"])


def test_a_measurement_on_the_gpu_is_the_growth_of_torchs_peak_allocation(monkeypatch):
    """What the GPU check reads, on a fake of torch's CUDA allocator statistics: the stage's peak
    over what was allocated before it, after the peak is reset."""
    from sdopt.tools import plan as plan_module

    state = {"allocated": 500, "peak": 9_000}
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=state["allocated"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: state["peak"])

    def stage():
        calls.append("stage")
        state["peak"] = max(state["peak"], state["allocated"] + 300)

    assert plan_module._allocated_growth(stage, torch.device("cuda")) == 300, "the peak before the stage is not the stage's"
    assert calls == ["sync", "stage", "sync"], "the stage's kernels have finished before the peak is read"


def test_the_gpu_check_caps_the_stage_at_the_prediction_plus_its_headroom(monkeypatch):
    """Under the cap, cuDNN cannot take free memory as workspace; a stage that needs more than the cap
    is out of memory, which the row and the table report as an under-prediction."""
    from types import SimpleNamespace

    from sdopt.tools import plan as plan_module

    fractions = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1000)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=10_000))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def set_fraction(fraction, device):
        if not isinstance(device, int) and torch.device(device).index is None:  # as torch's own check
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        fractions.append(fraction)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)

    def needs_too_much():
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert plan_module._allocated_growth(needs_too_much, torch.device("cuda"), cap_bytes=1500) is None
    assert fractions == [0.25], "what torch holds now plus the cap, over the device's memory"
    row = plan_module.CheckRow("full", plan_module.VAE_DECODE, 1024, 100 * 2**20, [None], cap_bytes=120 * 2**20)
    assert not row.fits and math.isnan(row.error)
    assert "needs more than 120 (the prediction + 20%)" in plan_module.check_table([row])
    fitting = plan_module.CheckRow("full", plan_module.VAE_DECODE, 1024, 100 * 2**20, [80 * 2**20], cap_bytes=120 * 2**20)
    assert fitting.fits and fitting.error == pytest.approx(0.25)
    traced = plan_module.CheckRow("full", plan_module.VAE_DECODE, 1024, 100 * 2**20, [80 * 2**20], 120 * 2**20,
                                  [(100 * 2**20, "aten.silu.default")])
    assert "| 100 at aten.silu.default |" in plan_module.check_table([traced])


# --- the diffusion transformers (SD3.5, Flux) -------------------------------------------------------

@pytest.fixture(scope="module", params=["sd35-tiny", "flux-tiny"])
def dit_tiny(request):
    return Planner(request.param)


def test_dit_text_encode_runs_the_family_s_text_encoders(dit_tiny):
    """SD3.5's encoders sit in its checkpoint, Flux's CLIP-L in a file of its own: both are run."""
    from sdopt.tools.plan import text_encoder_names, text_encoders

    texts = text_encoders(dit_tiny.model)
    assert texts and set(text_encoder_names(dit_tiny.model)) == {n for n in dit_tiny.modules if n.startswith("text_encoder")}
    assert dit_tiny.weights["text_encoder"] > 0
    fn, inputs = stage_call(dit_tiny.model, TEXT_ENCODE, dit_tiny.modules, 64, 64, torch.float32, dit_tiny._make)
    with dit_tiny.mode:
        hidden = fn(*inputs)
    assert tuple(hidden.shape) == (1, 77, sum(text.hidden_size for text in texts))


def test_dit_step_takes_diffusers_inputs_and_gives_back_the_latent(dit_tiny):
    from sdopt.families import FluxConfig, checkpoint_config

    config = checkpoint_config(dit_tiny.model)
    diffusion = config.diffusion_model
    # sd35-tiny's position grid (16 patches of 2 latent pixels, VAE downscale 2) bounds it at 64 px.
    width = 128 if isinstance(diffusion, FluxConfig) else 64
    fn, inputs = stage_call(dit_tiny.model, UNET_STEP, dit_tiny.modules, width, 64, torch.float32, dit_tiny._make)
    x, t, context, pooled, *flux_inputs = inputs
    down = config.vae.downscale
    assert tuple(x.shape) == (2, 16, 64 // down, width // down) and tuple(t.shape) == (2,)
    transformer = dit_tiny.modules["unet"].config
    assert tuple(context.shape) == (2, 77, transformer.joint_attention_dim)
    assert tuple(pooled.shape) == (2, transformer.pooled_projection_dim)
    if isinstance(diffusion, FluxConfig):
        image_ids, text_ids, guidance = flux_inputs
        tokens = (64 // down // diffusion.patch_size) * (width // down // diffusion.patch_size)
        assert (tuple(image_ids.shape), tuple(text_ids.shape), tuple(guidance.shape)) == ((tokens, 3), (77, 3), (2,))
    else:
        assert flux_inputs == []
    with dit_tiny.mode:
        assert fn(*inputs).shape == x.shape
    stock = dit_tiny.predict(UNET_STEP, SETTINGS[UNET_STEP][0], width, 64)
    # Sequential CFG runs the two halves one after the other (Flux's positions have no batch to split).
    sequential = dit_tiny.predict(UNET_STEP, SETTINGS[UNET_STEP][1], width, 64)
    assert 0 < sequential.peak_bytes < stock.peak_bytes


def test_flux_latent_packing_is_diffusers_own():
    from sdopt.tools.plan import pack_latent, unpack_latent

    latent = torch.randn(2, 16, 6, 10)
    packed = pack_latent(latent, 2)
    assert torch.equal(packed, diffusers.FluxPipeline._pack_latents(latent, 2, 16, 6, 10))
    assert torch.equal(unpack_latent(packed, latent.shape, 2), latent)


def test_dit_checkpoint_architecture_from_its_keys(tmp_path):
    from safetensors.torch import save_file

    from sdopt.tools.modelgen import UNET_PREFIX, checkpoint_specs
    from sdopt.tools.plan import architecture_of_shapes

    for name in ("sd35-tiny", "flux-tiny"):
        part = {k: torch.zeros(spec.shape, dtype=torch.float16) for k, spec in checkpoint_specs(name).items()
                if k.startswith(UNET_PREFIX)}
        save_file(part, tmp_path / f"{name}.safetensors")
        assert architecture(str(tmp_path / f"{name}.safetensors")) == name
    # Flux.1-dev holds every tensor of schnell and the guidance embedder: the keys must match exactly.
    for name in ("flux-schnell", "flux-full", "sd35-medium"):
        assert architecture_of_shapes({k: spec.shape for k, spec in checkpoint_specs(name).items()}) == name


def test_sd35_plan_is_bounded_by_its_position_grid(capsys):
    from sdopt.tools.plan import make_plan

    assert "--width: 128 px is over sd35-tiny's largest side, 64 px" in _one_line_error(
        capsys, ["plan", "--model", "sd35-tiny", "--width", "128", "--height", "64"])
    plan = make_plan("sd35-tiny", 64, 64, 2**33)
    assert plan.offload == "none" and plan.largest_square == 64


def test_cli_plans_flux_mini_without_t5(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "flux-mini", "--width", "256", "--height", "256", "--budget", "8GiB", "--no-search",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "flux-mini: the Flux architecture" in printed and "no T5-XXL" in printed
    plan = json.loads(out.read_text())
    # One double and one single block at 3072 wide, 0.535B parameters in fp32; CLIP-L for text.
    assert plan["weights_bytes"]["unet"] == 535_324_480 * 4
    assert 0.45 * 2**30 < plan["weights_bytes"]["text_encoder"] < 0.5 * 2**30
    assert plan["fits"] and 16 * 2**20 < plan["stock"][1]["peak_bytes"] < 2**30
