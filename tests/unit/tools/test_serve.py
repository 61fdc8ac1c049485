"""serve's model-paths file, read back as ComfyUI reads it (YAML), and what serve leaves alone."""
import pytest

from sdopt.errors import UserError
from sdopt.tools.serve import MODEL_PATHS, serve, write_model_paths

yaml = pytest.importorskip("yaml")


def test_every_model_folder_is_offered_under_its_own_name(tmp_path):
    models = tmp_path / "my models: v2"
    for kind in ("checkpoints", "text_encoders", "loras"):
        (models / kind).mkdir(parents=True)
    (models / "README.txt").write_text("not a folder")
    config = yaml.safe_load(write_model_paths(models, tmp_path / "config").read_text())
    assert config == {"sdopt": {kind: str((models / kind).resolve()) for kind in ("checkpoints", "loras", "text_encoders")}}


def test_a_models_folder_without_checkpoints_is_refused_with_the_fix(tmp_path):
    (tmp_path / "loras").mkdir()
    with pytest.raises(UserError, match="it has no checkpoints/ folder; create one, e.g. with: python -m sdopt make-model"):
        write_model_paths(tmp_path, tmp_path)


def test_comfyuis_own_model_paths_file_is_never_written(tmp_path):
    (tmp_path / "models" / "checkpoints").mkdir(parents=True)
    users = tmp_path / "extra_model_paths.yaml"
    users.write_text("my_a1111:\n  base_path: /home/me/sd\n")
    written = write_model_paths(tmp_path / "models", tmp_path)
    assert written.name == MODEL_PATHS and users.read_text() == "my_a1111:\n  base_path: /home/me/sd\n"
    assert write_model_paths(tmp_path / "models", tmp_path) == written, "serve's own file is rewritten"


def test_a_file_of_that_name_serve_did_not_write_is_refused_and_kept(tmp_path):
    (tmp_path / "models" / "checkpoints").mkdir(parents=True)
    foreign = tmp_path / MODEL_PATHS
    foreign.write_text("mine: {}\n")
    with pytest.raises(UserError, match="was not written by sdopt serve: move it away"):
        write_model_paths(tmp_path / "models", tmp_path)
    assert foreign.read_text() == "mine: {}\n"


def test_a_bad_models_folder_stops_serve_before_the_pack_is_linked(tmp_path):
    comfyui = tmp_path / "ComfyUI"
    (comfyui / "custom_nodes").mkdir(parents=True)
    (comfyui / "main.py").write_text("")
    with pytest.raises(UserError, match="it has no checkpoints/ folder"):
        serve(comfyui, tmp_path / "no models", 8188, config_dir=tmp_path)
    assert list((comfyui / "custom_nodes").iterdir()) == []
