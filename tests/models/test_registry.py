"""models/registry.py: one registration per family, consistent with transformers' own names."""

import pytest
import transformers

from encdec_engine.models.registry import FAMILIES, resolve_model_class, supported_architectures


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model_type)
def test_each_family_serves_its_architectures_and_its_model_type(family):
    for arch in family.architectures:
        assert hasattr(transformers, arch), f"transformers has no {arch}"
        config = transformers.AutoConfig.for_model(family.model_type, architectures=[arch])
        assert resolve_model_class(config) is family.model_class
    bare = transformers.AutoConfig.for_model(family.model_type)  # no architectures named: by model_type
    assert not bare.architectures and resolve_model_class(bare) is family.model_class


def test_an_unknown_architecture_names_what_is_supported():
    config = transformers.AutoConfig.for_model("bert", architectures=["BertForMaskedLM"])
    with pytest.raises(ValueError, match=r"unsupported model architecture \['BertForMaskedLM'\]; supported: Bart"):
        resolve_model_class(config)
    assert len(supported_architectures()) == sum(len(f.architectures) for f in FAMILIES)
