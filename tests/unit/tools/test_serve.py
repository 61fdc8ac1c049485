"""serve's extra_model_paths.yaml, read back as ComfyUI reads it (YAML)."""
import pytest

from sdopt.errors import UserError
from sdopt.tools.serve import write_model_paths

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
