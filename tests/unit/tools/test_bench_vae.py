"""The VAE bench: a 2048x2048 decode untiled and tiled, each in a fresh process, on a narrow VAE with
SD1.5's layout (the full VAE at 2048 takes minutes; ``python -m sdopt bench vae`` measures it).

The memory claim is checked on the decode's own growth of the peak RSS (the peak minus the RSS just
before decoding): with 8-16 channels the interpreter and libraries would otherwise dominate.
"""
import json
import math

import pytest
import torch

from sdopt.errors import UserError
from sdopt.tools import bench_vae as bench_vae_module
from sdopt.tools.bench_vae import TILED, UNTILED, VAEBenchRow, bench_vae, psnr, vae_table
from sdopt.tools.cli import main

# 8/16 channels, one residual block per level (plus the decoder's extra one), no mid-block
# attention (65536 latent tokens at 2048 px would dominate the run).
NARROW = dict(block_out_channels=[8, 16, 16, 16], layers_per_block=1, norm_num_groups=4, mid_block_add_attention=False)
TILE = 256
# Tiled with recomputed intermediates against untiled, decode growth. Measured over repeated runs:
# 129-167 of 1041-1069 MiB (12-16%); heap fragmentation moves the tiled figure by tens of MiB.
MAX_PEAK_RATIO = 0.25
MIN_PSNR_DB = 40


@pytest.fixture(scope="module")
def rows():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("the memory figures assume PyTorch's oneDNN CPU convolutions")
    return bench_vae([2048], tile=TILE, keep_intermediates=["no"], overrides=NARROW, progress=False)


def test_tiled_2048_decode_needs_a_quarter_of_the_untiled_memory(rows):
    untiled, tiled = rows
    assert (untiled.mode, tiled.mode) == (UNTILED, TILED)
    assert tiled.decode_rss_bytes <= MAX_PEAK_RATIO * untiled.decode_rss_bytes, vae_table(rows)
    assert tiled.peak_rss_bytes < untiled.peak_rss_bytes


def test_rows_describe_the_runs(rows):
    untiled, tiled = rows
    assert untiled.size == tiled.size == 2048 and untiled.model == "full" and untiled.device == "cpu"
    assert untiled.tile is None and untiled.psnr_vs_untiled_db is None
    assert (tiled.tile, tiled.tiles, tiled.kept_intermediates, tiled.oom_retries) == (TILE, 64, False, 0)
    assert tiled.psnr_vs_untiled_db >= MIN_PSNR_DB
    assert tiled.peak_vs_untiled == pytest.approx(tiled.peak_rss_bytes / untiled.peak_rss_bytes)
    assert all(r.seconds > 0 and 0 < r.decode_rss_bytes < r.peak_rss_bytes for r in rows)


def test_rows_round_trip_through_json_and_fill_the_table(rows):
    assert [VAEBenchRow(**data) for data in json.loads(json.dumps([r.to_dict() for r in rows]))] == rows
    lines = vae_table(rows).splitlines()
    assert lines[0].startswith("| size | mode | tile |") and len(lines) == 2 + len(rows)
    assert lines[3].startswith("| 2048x2048 | tiled | 256 | 64 |") and "| recomputed |" in lines[3]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"sizes": [500]}, "--sizes: 500 px must be a multiple of 64"),
    ({"sizes": [512], "tile": 100}, "--tile: 100 px is not a multiple of 8"),
    ({"sizes": [512], "keep_intermediates": ["maybe"]}, "--keep-intermediates 'maybe'"),
    ({"sizes": [512], "model": "huge"}, "--model 'huge'"),
    ({"sizes": [64], "model": "mini", "budget_mb": -5}, "--budget-mb must be a positive number of MiB, not -5"),
    ({"sizes": [64], "model": "mini", "budget_mb": 0}, "--budget-mb must be a positive number of MiB, not 0"),
])
def test_bad_arguments_are_user_errors(kwargs, message):
    with pytest.raises(UserError, match=f"^{message}"):
        bench_vae(progress=False, **kwargs)


@pytest.fixture
def decodes(monkeypatch):
    """The spec of every decode the bench asks a child process for; each "decodes" a black image at once."""
    specs = []

    def fake_child(spec):
        specs.append(spec)
        torch.save(torch.zeros(1, 3, spec["size"], spec["size"]), spec["out"])
        return {"seconds": 1.0, "peak_rss_bytes": 2 * 2**20, "decode_rss_bytes": 2**20}

    monkeypatch.setattr(bench_vae_module, "_run_child", fake_child)
    return specs


def test_the_cli_refuses_a_negative_budget_before_any_decode(decodes, capsys):
    assert main(["bench", "vae", "--sizes", "64", "--model", "mini", "--budget-mb", "-5"]) == 2
    err = capsys.readouterr().err
    assert err == "sdopt: error: --budget-mb must be a positive number of MiB, not -5 (0, or none given, is the free RAM)\n"
    assert decodes == []


def test_the_cli_s_budget_0_is_the_free_ram(decodes):
    assert main(["bench", "vae", "--sizes", "64", "--model", "mini", "--budget-mb", "0", "--keep-intermediates", "auto"]) == 0
    assert [spec["budget_bytes"] for spec in decodes] == [None, None]


def test_psnr_of_images_in_minus_one_to_one():
    image = torch.zeros(1, 3, 4, 4)
    assert psnr(image, image) == math.inf
    assert psnr(image + 0.02, image) == pytest.approx(40.0)  # 0.01 on the [0, 1] scale


def test_the_cli_takes_comma_separated_sizes(capsys):
    from sdopt.tools.cli import build_parser

    args = build_parser().parse_args(["bench", "vae", "--sizes", "512,1024,2048", "--keep-intermediates", "no"])
    assert (args.sizes, args.tile, args.keep_intermediates, args.model) == ([512, 1024, 2048], 512, ["no"], "full")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "vae", "--sizes", "512,big"])
    assert "not a comma-separated list of pixel sizes" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["tiny", "sdxl-tiny"])
def test_the_vae_holds_the_generated_checkpoints_weights(model):
    """The bench decodes with the weights make-model writes (fp16 in the file), and the SDXL VAE
    keeps its statistics: its decode passes fp16's range where SD1.5's does not."""
    from sdopt.families import VAE_PREFIX
    from sdopt.tools.bench_vae import build_vae
    from sdopt.tools.modelgen import checkpoint_specs, generate_tensor

    vae = build_vae(model, seed=3)
    specs = checkpoint_specs(model)
    for ldm_key, module in (("decoder.conv_in.weight", vae.decoder.conv_in),
                            ("decoder.mid.block_1.conv1.weight", vae.decoder.mid_block.resnets[0].conv1)):
        key = VAE_PREFIX + ldm_key
        assert torch.equal(module.weight, generate_tensor(key, specs[key], 3, torch.float16).float())
    latent = torch.randn(1, vae.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    peak = {}

    def record_peak(_module, _inputs, out):
        peak["max"] = out.abs().max().item()

    hook = vae.decoder.mid_block.resnets[0].conv1.register_forward_hook(record_peak)
    with torch.no_grad():
        image = vae.decode(latent).sample
    hook.remove()
    assert torch.isfinite(image).all()
    assert (peak["max"] > torch.finfo(torch.float16).max) == (model == "sdxl-tiny"), peak
