"""Writing a cluster config to a test's directory, and the error loading it raises."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from glm53.server.config import ConfigError
from glm53.server.config_parse import load_config


def write(tmp_path, d) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def error(tmp_path, d) -> ConfigError:
    """The ConfigError loading `d` raises; it must name the file."""
    p = write(tmp_path, d)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value), "the error must name the file"
    return e.value
