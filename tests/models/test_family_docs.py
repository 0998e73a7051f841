"""The docs' lists and table of model families agree with the families' declarations (tools/family_docs.py renders
them; ``python tools/family_docs.py --write`` brings them up to date)."""

import re

from functrain.models import family_names
from tools import doc_markers, family_docs

# Where the docs list families, and which: a list that left its document would no longer be checked.
EXPECTED_LISTS = {
    "README.md": ["all", "hf_conversion"],
    "docs/config.md": ["all", "hf_conversion !expert_parallel", "expert_parallel", "scans_layers", "!scans_layers",
                       "batch_invariant"],
    "docs/hf-conversion.md": ["hf_conversion"],
    "docs/cli.md": ["generation_cache"],
    "docs/data.md": ["language_model"],
    "docs/eval.md": ["generation_cache"],
    "docs/distill.md": ["language_model", "hf_conversion"],
    "docs/moe.md": ["expert_parallel"],
    "docs/sharding-and-memory.md": ["expert_parallel", "context_parallel", "expert_parallel", "!context_parallel",
                                    "language_model"],
    "docs/torch-bridge.md": ["torch_twin"],
}


def test_the_docs_lists_and_table_of_families_are_the_registry_s():
    assert family_docs.stale() == [], "run: python tools/family_docs.py --write"
    lists = {}
    for path in doc_markers.documents():
        selectors = [match.group("selector") for match in family_docs.LIST.finditer(path.read_text())]
        if selectors:
            lists[str(path.relative_to(doc_markers.ROOT))] = selectors
    assert lists == EXPECTED_LISTS
    table = family_docs.TABLE.search((doc_markers.ROOT / "docs" / "config.md").read_text()).group("body")
    assert [line.split(" | ")[0].strip("| `") for line in table.splitlines()[2:]] == list(family_docs.shipped())
    assert list(family_docs.shipped()) == family_names()  # no plugin installed here: the registry is what ships


def test_a_list_that_leaves_the_registry_is_found_stale():
    text = "MoE: <!-- families: expert_parallel -->`mixtral`, `qwen2_moe`, `qwen3_moe`<!-- /families -->."
    moe = family_names("expert_parallel")
    assert {"deepseek_v3", "gpt_oss", "mixtral"} <= set(moe)
    assert family_docs.rendered(text) == (
        f"MoE: <!-- families: expert_parallel -->{', '.join(f'`{name}`' for name in moe)}<!-- /families -->.")
    assert family_docs.family_list("language_model !context_parallel") == (
        "`gemma2`, `gemma3_text`, `gemma4`, `gpt2`, `llama4`, `qwen3_5_moe_text`, `qwen3_5_text`, `qwen3_next`")


def test_the_moe_table_has_a_row_per_mixture_of_experts():
    moe = (doc_markers.ROOT / "docs" / "moe.md").read_text().split("\n## Families and keys\n", 1)[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(\w+)` \|", moe, re.M)
    assert sorted(rows) == family_names("expert_parallel") and len(rows) == len(set(rows))
