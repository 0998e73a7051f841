"""The docs' lists of shipped configs, mesh axes and config keys name every one the repository has, and no other."""

import re
import typing

import pydantic

from functrain.config.schema import Config
from functrain.config.sections import MeshConfig
from tests.conftest import REPO_ROOT
from tools import doc_markers

CONFIG_MD = (REPO_ROOT / "docs" / "config.md").read_text()


def _section(text: str, heading: str) -> str:
    """The body of the markdown section under ``heading`` (up to the next heading of any level)."""
    return text.split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]


def test_the_shipped_config_table_lists_every_config():
    table = _section(CONFIG_MD, "## Shipped configs (`configs/`)")
    named = set(re.findall(r"`([\w.]+\.yaml)`", "\n".join(line.split(" | ")[0] for line in table.splitlines())))
    assert named == {path.name for path in (REPO_ROOT / "configs").glob("*.yaml")}


def test_the_lists_of_mesh_axes_name_every_axis():
    axes = {name for name, field in MeshConfig.model_fields.items() if field.annotation is int}
    assert {"data", "fsdp", "tensor", "expert", "pipeline", "context", "dcn_pipeline"} <= axes
    sharding = next(line for line in (REPO_ROOT / "README.md").read_text().split("\n- ") if "Sharding by" in line)
    assert set(re.findall(r"`mesh\.(\w+)`", sharding)) == axes
    mesh_page = (REPO_ROOT / "docs" / "sharding-and-memory.md").read_text()
    first_paragraph = _section(mesh_page, "## Sharding by configuration").strip().split("\n\n")[0]
    assert set(re.findall(r"`mesh\.(\w+)`", first_paragraph)) - {"rules"} == axes


def _keys(model: type[pydantic.BaseModel], prefix: str = "") -> set[str]:
    """A config section's keys, dotted below its nested sections (``samples.count``)."""
    keys = set()
    for name, field in model.model_fields.items():
        nested = isinstance(field.annotation, type) and issubclass(field.annotation, pydantic.BaseModel)
        keys |= _keys(field.annotation, f"{prefix}{name}.") if nested else {prefix + name}
    return keys


def _documented(heading: str) -> set[str]:
    """The keys the tables under ``heading`` of docs/config.md name in their first column."""
    rows = [line for line in _section(CONFIG_MD, heading).splitlines() if line.startswith("| `")]
    return {key for row in rows for key in re.findall(r"`([\w.]+)`", row.split(" | ")[0])}


def test_the_config_reference_names_every_key_and_no_other():
    sections = {name for name, field in Config.model_fields.items()
                if isinstance(field.annotation, type) and issubclass(field.annotation, pydantic.BaseModel)}
    headings = re.findall(r"^## `(\w+)\.\*`$", CONFIG_MD, re.M)  # run.* is in the top level's table
    assert sorted(headings) == sorted((sections - {"run"}) | {"model"})
    for section in sections - {"run"}:  # the model section is each family's own (config.md lists them per family)
        wanted = _keys(Config.model_fields[section].annotation)
        assert _documented(f"## `{section}.*`") == wanted, f"docs/config.md's {section}.* table"
    top = {name for name in Config.model_fields if name not in sections and name != "model"}
    assert _documented("## Top level") == top | {f"run.{key}" for key in _keys(Config.model_fields["run"].annotation)}


def test_every_config_key_the_docs_name_exists():
    """`train.max_steps`, `data.sources.0.weight=2`, `eval.samples`: a key (or section) of the schema, list
    indices left out; model.* keys are each family's own (config.md lists them per family)."""
    sections = [name for name, field in Config.model_fields.items()
                if isinstance(field.annotation, type) and issubclass(field.annotation, pydantic.BaseModel)]
    known = {name for section in sections for name in _keys(Config.model_fields[section].annotation, f"{section}.")}
    known |= {".".join(key.split(".")[:depth]) for key in known for depth in (1, 2)}  # sections, sub-sections
    containers = {f"{section}.{name}" for section in sections  # a list's items, a mapping's keys: any below them
                  for name, field in Config.model_fields[section].annotation.model_fields.items()
                  if typing.get_origin(field.annotation) in (list, dict)
                  or any(typing.get_origin(arm) in (list, dict) for arm in typing.get_args(field.annotation))}
    named = {(path.name, re.sub(r"\.\d+(?=\.|$)", "", match.group(1)))
             for path in doc_markers.documents()
             for match in re.finditer(rf"`((?:{'|'.join(sections)})\.[a-z_.0-9]*[a-z_0-9])(?:[=: ][^`]*)?`",
                                      path.read_text())}
    unknown = sorted((page, key) for page, key in named
                     if key not in known and ".".join(key.split(".")[:2]) not in containers and not key.endswith(".py"))
    assert len(named) > 150 and unknown == []
