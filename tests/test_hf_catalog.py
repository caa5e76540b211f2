"""The documentation's model tables are the importer's own: generated from its family
tables (and not stale), every family and wrapper described on the models page, and
every wrapper read as the text model the tables name."""

import re

import pytest

import moe_eqx as me
from moe_eqx._hf import catalog
from moe_eqx._hf.config import text_config
from moe_eqx._hf.families import FAMILIES, REFUSED, WRAPPERS

transformers = pytest.importorskip("transformers")


def test_the_tables_are_generated_and_current():
    assert catalog.main(["--check"]) == 0, "run `python -m moe_eqx._hf.catalog`"
    readme = (catalog._ROOT / "README.md").read_text()
    assert catalog.supported_table() in readme
    # And the check can fail: a table edited by hand is stale.
    edited = readme.replace("`mixtral`", "`mixtral_x`")
    assert catalog.render(edited) != edited


def test_the_models_page_describes_every_family():
    """Each family (and each wrapper of one) has a row of the models page's table,
    and nothing is described there that the importer does not read."""
    page = (catalog._ROOT / "docs/models.md").read_text()
    lines = page.splitlines()
    start = next(i for i, l in enumerate(lines) if "`config_from_hf` reads" in l)
    described = set()
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        described |= set(re.findall(r"`([\w-]+)`", line.split(" | ")[0]))
    reachable = set(FAMILIES) | {w for w, t in WRAPPERS.items() if t in FAMILIES}
    missing = sorted(
        m
        for m in FAMILIES
        if m not in described
        and not any(w in described for w, t in WRAPPERS.items() if t == m)
    )
    assert missing == []
    # A model type described there that the importer does not read (the other names
    # in a row's first cell are keys, e.g. `mlp_bias`).
    stray = described - reachable - set(REFUSED)
    assert sorted(d for d in stray if d in transformers.CONFIG_MAPPING) == []


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_wrappers_read_their_text_model(wrapper):
    """The wrapper's default `transformers` config leads to the text model the table
    names."""
    if wrapper not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers has no config class for {wrapper}")
    hf = transformers.CONFIG_MAPPING[wrapper]().to_dict()
    if wrapper == "mistral3":  # Mistral-Small-4: a Mistral-4 text model
        hf["text_config"] = transformers.CONFIG_MAPPING["mistral4"]().to_dict()
    assert text_config(hf)["model_type"] == WRAPPERS[wrapper]


def test_mistral_small_4_reads_as_mistral4():
    """Mistral-Small-4's `config.json` declares the `mistral3` wrapper around a
    Mistral-4 text model: its MoE blocks read exactly as Mistral-4's."""
    text = transformers.CONFIG_MAPPING["mistral4"](
        hidden_size=16, moe_intermediate_size=8, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1,
    ).to_dict()  # fmt: skip
    wrapped = transformers.CONFIG_MAPPING["mistral3"](text_config=text).to_dict()
    assert me.config_from_hf(wrapped) == me.config_from_hf(text)
