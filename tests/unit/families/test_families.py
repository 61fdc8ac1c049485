"""Model names, checkpoint file names and ComfyUI's model-config classes each lead to one family."""
import pytest

from sdopt.errors import UserError
from sdopt.families import (
    FAMILIES,
    MODEL_NAMES,
    SD15,
    SDXL,
    family_of_config_class,
    model_name_of_file,
    resolve_model,
)


def test_every_model_name_and_file_name_leads_back_to_its_family_and_size():
    files = set()
    for family in FAMILIES.values():
        for size in family.sizes:
            name = family.model_name(size)
            assert resolve_model(name) == (family, size)
            assert model_name_of_file(family.checkpoint_filename(size)) == name
            files.add(family.checkpoint_filename(size))
    assert len(set(MODEL_NAMES)) == len(MODEL_NAMES) == len(files)


def test_only_sd15_answers_to_a_bare_size():
    assert resolve_model("mini") == (SD15, "mini")
    assert resolve_model("sdxl-mini") == (SDXL, "mini")
    with pytest.raises(UserError, match=r"^unknown model 'sd15-mini': choose one of tiny, mini, full, ref-sd15, sdxl-tiny"):
        resolve_model("sd15-mini")


def test_a_file_sdopt_did_not_generate_has_no_model_name():
    assert model_name_of_file("v1-5-pruned-emaonly.safetensors") is None
    assert model_name_of_file("sdopt-mini-sdxl.ckpt") is None


def test_comfyuis_config_classes_and_their_subclasses_lead_to_the_family():
    # ComfyUI's supported_models classes, as fakes: fine-tune configs subclass them (Pony's is SDXL's).
    SDXL_config = type("SDXL", (), {})
    fine_tune = type("SDXLFineTune", (SDXL_config,), {})
    for family in FAMILIES.values():
        for config_name in family.comfy_configs:
            assert family_of_config_class(type(config_name, (), {})) is family
    assert family_of_config_class(fine_tune) is SDXL
    assert family_of_config_class(type("HunyuanVideo", (), {})) is None
