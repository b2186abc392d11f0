"""Each scheduler setting's default is written once: the SchedulerConfig that the scheduler's
flags build when none is given equals the dataclass's defaults, field for field, and each
field's flag shows that default."""

import argparse
import dataclasses

import pytest

from services.scheduler import server
from services.scheduler.config import SchedulerConfig

# fields without a flag of their own, and why
NO_FLAG = {
    "max_model_len": "the workers' max_model_len unless --max-model-len caps it (None)",
    "long_prefill_token_threshold": "unset = a quarter of --max-num-batched-tokens, derived",
    "pipeline_parallel_size": "the workers' pipeline stages (GetWorkerInfo), not a flag",
    "max_lora_skips": "an internal fairness bound (lora_admission.py), not a user setting",
}
FLAG_OF = {"speculative": "speculative_config"}  # field -> its flag's dest, where they differ


@pytest.fixture
def parser(monkeypatch) -> argparse.ArgumentParser:
    import os

    for name in list(os.environ):
        if name.startswith("PAGEDSERVE_"):
            monkeypatch.delenv(name)
    p = argparse.ArgumentParser()
    server.add_args(p)
    return p


def test_the_flags_defaults_are_the_config_defaults(parser):
    args = parser.parse_args([])
    built = server.scheduler_config(args, max_model_len=SchedulerConfig().max_model_len)
    default = SchedulerConfig()
    for f in dataclasses.fields(SchedulerConfig):
        if f.name in NO_FLAG:
            continue
        flag_default = parser.get_default(FLAG_OF.get(f.name, f.name))
        assert flag_default == f.default, f"--{f.name}: flag {flag_default!r}, field {f.default!r}"
        assert getattr(built, f.name) == getattr(default, f.name), f.name
    assert set(NO_FLAG) <= {f.name for f in dataclasses.fields(SchedulerConfig)}


def test_async_scheduling_is_on_where_it_can_run(parser):
    from services.common.spec_decode_config import SpeculativeConfig

    args = parser.parse_args([])
    one_stage = server.scheduler_config(args, 4096)
    assert one_stage.async_scheduling and one_stage.max_steps_in_flight == 2
    two_stages = server.scheduler_config(args, 4096, pipeline_parallel_size=2)
    assert not two_stages.async_scheduling and two_stages.max_steps_in_flight == 2
    off = server.scheduler_config(parser.parse_args(["--no-async-scheduling"]), 4096)
    assert not off.async_scheduling and off.max_steps_in_flight == 1
    spec = SpeculativeConfig("ngram", 2, 2, 2)
    assert not SchedulerConfig(speculative=spec).async_scheduling
    with pytest.raises(ValueError, match="--async-scheduling does not work with "
                                         "--pipeline-parallel-size 2"):
        server.scheduler_config(parser.parse_args(["--async-scheduling"]), 4096, 2)
    with pytest.raises(ValueError, match="--async-scheduling does not work with "
                                         "--speculative-config"):
        SchedulerConfig(async_scheduling=True, speculative=spec)
    with pytest.raises(ValueError, match="--speculative-config does not work with "
                                         "--pipeline-parallel-size 2"):
        SchedulerConfig(speculative=spec, pipeline_parallel_size=2)
