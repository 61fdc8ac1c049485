"""SDOptStepCache's record text: what it says of the image, by its settings."""
import pytest

from sdopt.nodes.step_cache import FIRST_BLOCK_QUALITY_NOTE, QUALITY_NOTE, quality_note
from sdopt.optim.step_cache import DEEPCACHE, FIRST_BLOCK, StepCacheConfig


@pytest.mark.parametrize("config,note", [
    (StepCacheConfig(DEEPCACHE, interval=3), QUALITY_NOTE),
    (StepCacheConfig(FIRST_BLOCK, threshold=0.08), FIRST_BLOCK_QUALITY_NOTE),
    (StepCacheConfig(DEEPCACHE, interval=1), "interval 1 reuses nothing: every call runs whole, so its image is the uncached one"),
    (StepCacheConfig(FIRST_BLOCK, threshold=0.0), "threshold 0.0 reuses nothing: every call runs whole, so its image is the uncached one"),
])
def test_the_record_says_the_image_differs_only_where_the_settings_reuse(config, note):
    assert quality_note(config) == note
    assert ("differs from the uncached one" in note) != config.reuses_nothing
