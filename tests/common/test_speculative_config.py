"""--speculative-config: vLLM's JSON, validated once with the field named, and the normalised
form the scheduler and the workers compare."""

import argparse

import pytest

from services.common.spec_decode_config import SpeculativeConfig, speculative_config_arg


def test_vllm_forms_parse_and_round_trip():
    ngram = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
    assert ngram == SpeculativeConfig("ngram", 4, 4, 4)  # min follows max, as in vLLM
    assert ngram.num_lookahead_slots == 0
    draft = SpeculativeConfig.parse('{"model": "/m", "num_speculative_tokens": 3}')
    assert draft is not None and draft.method == "draft_model" and draft.num_lookahead_slots == 3
    for config in (ngram, draft):
        assert SpeculativeConfig.parse(config.to_json()) == config
        assert config.as_flag_value() == config.to_json()
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse(" ") is None
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 2}').prompt_lookup_min == 5


@pytest.mark.parametrize("text, field", [
    ("[4]", "JSON object"), ("{", "not valid JSON"), ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": 0}', "1..16"), ('{"num_speculative_tokens": 17}', "1..16"),
    ('{"num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
    ('{"num_speculative_tokens": 2, "typo": 1}', "typo"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
    ('{"method": "ngram", "model": "/m", "num_speculative_tokens": 2}', "takes no model"),
    ('{"num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size"),
])
def test_bad_configs_name_the_field(text, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(text)
    with pytest.raises(argparse.ArgumentTypeError):
        speculative_config_arg(text)
