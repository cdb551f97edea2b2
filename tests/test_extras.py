"""Extra package sets (``gradkit.stacks.extras``): what some example jobs need, kept out of the kit's environment."""
import importlib.util

import pytest

from gradkit import config
from gradkit.stacks import extras


def test_an_unknown_set_is_refused_before_anything_installs():
    with pytest.raises(config.ConfigError, match="extra package sets are trl, llamafactory, axolotl, not 'nope'"):
        extras.ensure("nope")


def test_every_extra_is_pinned_and_datasets_stays_out_of_the_kits_environment():
    """An installed ``datasets`` is imported by every older transformers the kit overlays, and needs a newer
    huggingface-hub than their companions carry: the Trainer stacks of notebook 01 and the watch's 4.46.3 job would
    fail to import. TRL, LLaMA-Factory and datasets live in their overlays only."""
    for name, pins in extras.EXTRAS.items():
        assert all("==" in p for p in pins), name
    assert importlib.util.find_spec("datasets") is None and importlib.util.find_spec("trl") is None
