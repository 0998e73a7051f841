"""The docs' lists of shipped configs and mesh axes name every one the repository has."""

import re

from functrain.config.sections import MeshConfig
from tests.conftest import REPO_ROOT


def _section(text: str, heading: str) -> str:
    """The body of the markdown section under ``heading`` (up to the next heading of any level)."""
    return text.split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]


def test_the_shipped_config_table_lists_every_config():
    table = _section((REPO_ROOT / "docs" / "config.md").read_text(), "## Shipped configs (`configs/`)")
    named = set(re.findall(r"`([\w.]+\.yaml)`", "\n".join(line.split(" | ")[0] for line in table.splitlines())))
    assert named == {path.name for path in (REPO_ROOT / "configs").glob("*.yaml")}


def test_the_readme_names_every_mesh_axis():
    axes = {name for name, field in MeshConfig.model_fields.items() if field.annotation is int}
    assert {"data", "fsdp", "tensor", "expert", "pipeline", "context", "dcn_pipeline"} <= axes
    sharding = next(line for line in (REPO_ROOT / "README.md").read_text().split("\n- ") if "Sharding by" in line)
    assert set(re.findall(r"`mesh\.(\w+)`", sharding)) == axes
